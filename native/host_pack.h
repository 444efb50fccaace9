// host_pack.h — how the CPU transport moves and sums elements: eight at a time with AVX2 where it
// is built with it (to_float/from_float's numerics), element by element elsewhere; the one
// lossless sum (fp32 in rank order 0..n-1, one rounding), and its counterpart over a wire format
// (wire.h): each rank's chunk encoded once, every rank's blocks decoded and summed the same way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "numerics.h"
#include "wire.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace nodecomm::shm {

#ifdef __AVX2__
// Eight elements at a time, widened to fp32. These keep the numerics of to_float/from_float.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const Float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void stream8(float* p, __m256 v) { _mm256_stream_ps(p, v); }
inline void store8(BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void stream8(BFloat16* p, __m256 v) {
  alignas(16) BFloat16 lanes[8];
  store8(lanes, v);
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm_load_si128(reinterpret_cast<const __m128i*>(lanes)));
}
inline void store8(Float16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int j = 0; j < 8; ++j) p[j] = from_float<Float16>(lanes[j]);  // canonical NaNs
  }
}
inline void stream8(Float16* p, __m256 v) {
  alignas(16) Float16 lanes[8];
  store8(lanes, v);
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm_load_si128(reinterpret_cast<const __m128i*>(lanes)));
}
#endif

// Copy to a destination nobody reads soon: non-temporal stores skip reading the lines first.
inline void copy_out(void* destination, const void* source, std::size_t len, bool stream) {
  auto* dst = static_cast<std::uint8_t*>(destination);
  const auto* src = static_cast<const std::uint8_t*>(source);
  std::size_t i = 0;
#ifdef __AVX2__
  if (stream) {
    while (i < len && (reinterpret_cast<std::uintptr_t>(dst + i) & 31)) { dst[i] = src[i]; ++i; }
    for (; i + 32 <= len; i += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    }
  }
#endif
  std::memcpy(dst + i, src + i, len - i);
}

// Sum the n sources element-wise over [begin, end) into out (and copy, when given): fp32
// accumulation in rank order 0..n-1, one rounding. One pass: each element is loaded once per
// rank and stored once per destination. out may be one of the sources (same indices only).
template <typename T>
void reduce_range(const std::uint8_t* const* sources, int n, T* out, std::size_t begin, std::size_t end,
                  T* copy = nullptr, bool stream_out = false) {
  std::size_t i = begin;
#ifdef __AVX2__
  stream_out = stream_out && (reinterpret_cast<std::uintptr_t>(out + i) % (8 * sizeof(T))) == 0;
  for (; i + 8 <= end; i += 8) {
    __m256 acc = load8(reinterpret_cast<const T*>(sources[0]) + i);
    for (int r = 1; r < n; ++r) acc = _mm256_add_ps(acc, load8(reinterpret_cast<const T*>(sources[r]) + i));
    if (stream_out) stream8(out + i, acc); else store8(out + i, acc);
    if (copy != nullptr) store8(copy + i, acc);
  }
#endif
  for (; i < end; ++i) {
    float acc = to_float(reinterpret_cast<const T*>(sources[0])[i]);
    for (int r = 1; r < n; ++r) acc += to_float(reinterpret_cast<const T*>(sources[r])[i]);
    out[i] = from_float<T>(acc);
    if (copy != nullptr) copy[i] = out[i];
  }
}

// Encode `count` elements of `input` (whole blocks but the last) into `to`: codes, then scales
// at wire::scales_offset(count).
template <typename T>
void encode_range(const T* input, std::size_t count, wire::Wire format, std::uint8_t* to) {
  auto* scales = reinterpret_cast<float*>(to + wire::scales_offset(count));
  for (std::size_t block = 0; block < wire::blocks_of(count); ++block) {
    const std::size_t begin = block * wire::kWireBlock, end = std::min(count, begin + wire::kWireBlock);
    float values[wire::kWireBlock];
    float absmax = 0.0f;
    for (std::size_t i = begin; i < end; ++i) {
      values[i - begin] = to_float(input[i]);
      if (wire::finite(values[i - begin])) absmax = std::max(absmax, std::fabs(values[i - begin]));
    }
    for (std::size_t i = begin; i < end; ++i) to[i] = wire::encode(values[i - begin], absmax, format);
    scales[block] = wire::block_scale(absmax, format);
  }
}

// Decode the n encoded chunks of `count` elements over [begin, end) (block-aligned begin) and sum
// them in rank order into out (and copy, when given), one rounding.
template <typename T>
void reduce_encoded(const std::uint8_t* const* sources, int n, std::size_t count, wire::Wire format, T* out,
                    std::size_t begin, std::size_t end, T* copy = nullptr) {
  const std::size_t scales = wire::scales_offset(count);
  for (std::size_t i = begin; i < end; ++i) {
    const std::size_t block = i / wire::kWireBlock;
    float acc = 0.0f;
    for (int r = 0; r < n; ++r) {
      const float scale = reinterpret_cast<const float*>(sources[r] + scales)[block];
      const float value = wire::decode(sources[r][i], scale, format);
      acc = r == 0 ? value : acc + value;
    }
    out[i] = from_float<T>(acc);
    if (copy != nullptr) copy[i] = out[i];
  }
}

}  // namespace nodecomm::shm
