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

// Every code's value under a scale of 1 (NaN for the NaN codes): decoding is one lookup and one
// multiply, the same bits as wire::decode.
struct DecodeTable {
  alignas(64) float value[256];
  explicit DecodeTable(wire::Wire format) {
    for (int code = 0; code < 256; ++code) value[code] = wire::decode(std::uint8_t(code), 1.0f, format);
  }
  static const DecodeTable& of(wire::Wire format) {
    static const DecodeTable int8(wire::Wire::kInt8), fp8(wire::Wire::kFp8);
    return format == wire::Wire::kInt8 ? int8 : fp8;
  }
};

#ifdef __AVX2__
inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
inline __m256 finite8(__m256 v) { return _mm256_cmp_ps(abs8(v), _mm256_set1_ps(INFINITY), _CMP_LT_OQ); }

// wire::encode of eight values of a block whose largest finite magnitude is absmax (> 2^-100).
inline __m256i encode8(__m256 x, float absmax, wire::Wire format) {
  const float limit = wire::code_limit(format);
  const __m256 finite = finite8(x);
  const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(limit / absmax)),
                                               _mm256_set1_ps(-limit)), _mm256_set1_ps(limit));
  __m256i code;
  if (format == wire::Wire::kInt8) {
    code = _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    code = _mm256_and_si256(code, _mm256_set1_epi32(0xFF));
    return _mm256_blendv_epi8(_mm256_set1_epi32(wire::kInt8NaN), code, _mm256_castps_si256(finite));
  }
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  // Below 2^-6: m * 2^-9, m = rint(|y| * 512).
  const __m256 scaled = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(512.0f));
  const __m256i subnormal = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // Normal: exponent (rebiased) and 3 mantissa bits, rounded to nearest even.
  const __m256i exponent = _mm256_sub_epi32(_mm256_srli_epi32(magnitude, 23), _mm256_set1_epi32(120));
  const __m256i kept = _mm256_and_si256(_mm256_srli_epi32(magnitude, 20), _mm256_set1_epi32(7));
  const __m256i rest = _mm256_and_si256(magnitude, _mm256_set1_epi32(0xFFFFF));
  const __m256i half = _mm256_set1_epi32(0x80000);
  const __m256i above = _mm256_cmpgt_epi32(rest, half);
  const __m256i tie_odd = _mm256_and_si256(_mm256_cmpeq_epi32(rest, half),
                                           _mm256_cmpeq_epi32(_mm256_and_si256(kept, _mm256_set1_epi32(1)),
                                                              _mm256_set1_epi32(1)));
  const __m256i up = _mm256_srli_epi32(_mm256_or_si256(above, tie_odd), 31);
  __m256i normal = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(exponent, 3), kept), up);
  normal = _mm256_min_epi32(normal, _mm256_set1_epi32(0x7E));
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), magnitude);
  code = _mm256_or_si256(sign, _mm256_blendv_epi8(normal, subnormal, small));
  return _mm256_blendv_epi8(_mm256_set1_epi32(wire::kFp8NaN), code, _mm256_castps_si256(finite));
}

// The low byte of each of eight 32-bit lanes, stored as eight bytes.
inline void store_bytes8(std::uint8_t* to, __m256i codes) {
  const __m256i packed = _mm256_shuffle_epi8(codes, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                      -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                                                      -1, -1, -1, -1, -1, -1, -1, -1));
  const std::uint32_t low = std::uint32_t(_mm256_extract_epi32(packed, 0));
  const std::uint32_t high = std::uint32_t(_mm256_extract_epi32(packed, 4));
  std::memcpy(to, &low, 4);
  std::memcpy(to + 4, &high, 4);
}
#endif

// Encode `count` elements of `input` (whole blocks but the last) into `to`: codes, then scales
// at wire::scales_offset(count).
template <typename T>
void encode_range(const T* input, std::size_t count, wire::Wire format, std::uint8_t* to) {
  auto* scales = reinterpret_cast<float*>(to + wire::scales_offset(count));
  for (std::size_t block = 0; block < wire::blocks_of(count); ++block) {
    const std::size_t begin = block * wire::kWireBlock, end = std::min(count, begin + wire::kWireBlock);
#ifdef __AVX2__
    if (end - begin == wire::kWireBlock) {
      __m256 x[4], largest = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        x[j] = load8(input + begin + 8 * j);
        largest = _mm256_max_ps(largest, _mm256_and_ps(abs8(x[j]), finite8(x[j])));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, largest);
      float absmax = 0.0f;
      for (const float lane : lanes) absmax = std::max(absmax, lane);
      scales[block] = wire::block_scale(absmax, format);
      for (int j = 0; j < 4; ++j) {
        if (absmax < wire::kZeroBelow) {  // zeros, and the NaN code where not finite
          for (int k = 0; k < 8; ++k) to[begin + 8 * j + k] = wire::encode(to_float(input[begin + 8 * j + k]), absmax, format);
        } else {
          store_bytes8(to + begin + 8 * j, encode8(x[j], absmax, format));
        }
      }
      continue;
    }
#endif
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
  const float* table = DecodeTable::of(format).value;
  const std::size_t scales = wire::scales_offset(count);
  const auto scale_of = [&](int r, std::size_t block) {
    return reinterpret_cast<const float*>(sources[r] + scales)[block];
  };
  std::size_t i = begin;
#ifdef __AVX2__
  for (; i + 8 <= end; i += 8) {  // eight elements of one block (blocks are 32 long, begin aligned)
    const std::size_t block = i / wire::kWireBlock;
    __m256 acc = _mm256_setzero_ps();
    for (int r = 0; r < n; ++r) {
      std::uint64_t eight;
      std::memcpy(&eight, sources[r] + i, 8);
      const __m256i codes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(std::int64_t(eight)));
      const __m256 value = _mm256_mul_ps(_mm256_i32gather_ps(table, codes, 4), _mm256_set1_ps(scale_of(r, block)));
      acc = r == 0 ? value : _mm256_add_ps(acc, value);
    }
    store8(out + i, acc);
    if (copy != nullptr) store8(copy + i, acc);
  }
#endif
  for (; i < end; ++i) {
    const std::size_t block = i / wire::kWireBlock;
    float acc = 0.0f;
    for (int r = 0; r < n; ++r) {
      const float value = table[sources[r][i]] * scale_of(r, block);
      acc = r == 0 ? value : acc + value;
    }
    out[i] = from_float<T>(acc);
    if (copy != nullptr) copy[i] = out[i];
  }
}

}  // namespace nodecomm::shm
