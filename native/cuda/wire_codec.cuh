// wire_codec.cuh — the compressed wires (../wire.h) in the transport kernels: encoding a range of
// the input into a slot, and summing every rank's encoded values, dequantized, in fp32 in rank
// order with one rounding. The element functions are wire.h's, shared with the CPU transport, so
// the CUDA and CPU paths give the same bits.
//
// A thread takes four consecutive elements (a quad), so eight lanes of a warp hold one block of
// 32 and find its largest magnitude by shuffles; ranges start at multiples of 32 elements.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../wire.h"
#include "numerics.cuh"
#include "pack.cuh"

namespace nodecomm::cuda {

constexpr std::size_t kQuad = 4;

// A piece's encoding in a slot (wire.h's layout): element i's code at codes[i - first], its
// block's scale at scales[(i - first) / 32]; `first` is a multiple of 32.
struct Encoded {
  const std::uint8_t* codes;
  const float* scales;
  std::size_t first;
};

// The encoding of a whole piece of `count` elements at `at`.
__device__ __forceinline__ Encoded encoded_at(const std::uint8_t* at, std::size_t count) {
  return Encoded{at, reinterpret_cast<const float*>(at + wire::scales_offset(count)), 0};
}

// Encodes elements [lo, hi) of `input` into the piece of `count` elements at `to`; `thread` of
// `threads` (a multiple of 32, thread % 32 its lane) takes every threads-th quad. Whole warps run
// every iteration, so the shuffles see all eight lanes of each block.
template <typename T>
__device__ __forceinline__ void encode_range(const T* input, std::size_t lo, std::size_t hi, std::size_t count,
                                             std::uint8_t* to, wire::Wire format, std::size_t thread,
                                             std::size_t threads) {
  float* scales = reinterpret_cast<float*>(to + wire::scales_offset(count));
  const std::size_t first = lo / kQuad, quads = ((hi - lo + kQuad - 1) / kQuad + 31) / 32 * 32;
  for (std::size_t q = first + thread; q < first + quads; q += threads) {
    const std::size_t i = q * kQuad;
    float x[kQuad];
    float absmax = 0.0f;
#pragma unroll
    for (std::size_t j = 0; j < kQuad; ++j) {
      x[j] = i + j < hi ? widen(input[i + j]) : 0.0f;
      if (wire::finite(x[j])) absmax = fmaxf(absmax, fabsf(x[j]));
    }
#pragma unroll
    for (int lanes = 1; lanes < int(wire::kWireBlock / kQuad); lanes *= 2) {
      absmax = fmaxf(absmax, __shfl_xor_sync(0xFFFFFFFFu, absmax, lanes));
    }
    if (i >= hi) continue;
    std::uint32_t four = 0;
#pragma unroll
    for (std::size_t j = 0; j < kQuad; ++j) four |= std::uint32_t(wire::encode(x[j], absmax, format)) << (8 * j);
    *reinterpret_cast<std::uint32_t*>(to + i) = four;  // codes are padded to 64 bytes (wire.h)
    if (q % (wire::kWireBlock / kQuad) == 0) scales[i / wire::kWireBlock] = wire::block_scale(absmax, format);
  }
}

// Elements [i, i + 4) summed over ranks 0..N-1, where encoded_of(r) is rank r's encoding: every
// rank's codes and scale are loaded before any is added, so the peers' loads are in flight together.
template <int N, typename Source>
__device__ __forceinline__ void sum_quad(Source encoded_of, std::size_t i, wire::Wire format, float sum[kQuad]) {
  std::uint32_t codes[N];
  float scales[N];
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const Encoded e = encoded_of(r);
    codes[r] = *reinterpret_cast<const std::uint32_t*>(e.codes + (i - e.first));
    scales[r] = e.scales[(i - e.first) / wire::kWireBlock];
  }
#pragma unroll
  for (std::size_t j = 0; j < kQuad; ++j) {
    float acc = wire::decode(std::uint8_t(codes[0] >> (8 * j)), scales[0], format);
#pragma unroll
    for (int r = 1; r < N; ++r) acc = __fadd_rn(acc, wire::decode(std::uint8_t(codes[r] >> (8 * j)), scales[r], format));
    sum[j] = acc;
  }
}

// Sums elements [lo, hi) over every rank's encoding and stores each rounded sum with store(i, value);
// `thread` of `threads` takes every threads-th quad.
template <typename T, int N, typename Source, typename Store>
__device__ __forceinline__ void reduce_encoded(Source encoded_of, std::size_t lo, std::size_t hi, wire::Wire format,
                                             std::size_t thread, std::size_t threads, Store store) {
  for (std::size_t i = lo + thread * kQuad; i < hi; i += threads * kQuad) {
    float sum[kQuad];
    sum_quad<N>(encoded_of, i, format, sum);
#pragma unroll
    for (std::size_t j = 0; j < kQuad; ++j) {
      if (i + j < hi) store(i + j, narrow<T>(sum[j]));
    }
  }
}

// Block b's share of a compressed call: whole blocks of 32 elements, the same on every rank.
__device__ __forceinline__ BlockShare wire_share(std::size_t count) {
  const std::size_t per = ((count + gridDim.x - 1) / gridDim.x + wire::kWireBlock - 1) / wire::kWireBlock * wire::kWireBlock;
  const std::size_t begin = min(count, std::size_t(blockIdx.x) * per);
  return BlockShare{begin, min(count, begin + per)};
}

}  // namespace nodecomm::cuda
