// rms_norm.cuh — a block's residual add and RMSNorm of one row, in the order ../rms_norm.h states
// (and nodecomm/rms_norm.py spells out): thread t is lane t, taking chunks t, t + kLanes, ... of
// kChunk elements; the lanes meet in a butterfly, through shared memory across warps and shuffles
// within one. Explicit _rn intrinsics keep nvcc from fusing a multiply and an add.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../rms_norm.h"
#include "collectives.h"
#include "pack.cuh"

namespace nodecomm::cuda {

static_assert(kThreads == norm::kLanes, "a norm's lanes are a block's threads");
static_assert(norm::kChunk * 2 == 16, "a chunk of 16-bit elements is one pack");

// One call's rows, typed.
template <typename T>
struct NormArgs {
  const T* input;
  const T* residual;
  const T* weight;
  T* out;
  T* residual_out;
  std::size_t rows, hidden;
  float eps;
};

template <typename T>
NormArgs<T> typed(const norm::Rows& rows) {
  return NormArgs<T>{reinterpret_cast<const T*>(rows.input),  reinterpret_cast<const T*>(rows.residual),
                     reinterpret_cast<const T*>(rows.weight), reinterpret_cast<T*>(rows.out),
                     reinterpret_cast<T*>(rows.residual_out), rows.rows, rows.hidden, rows.eps};
}

// Whole chunks in 16-byte packs: every pointer aligned and rows of whole chunks.
inline bool chunks_pack(const norm::Rows& rows) {
  return rows.hidden % norm::kChunk == 0 && aligned(reinterpret_cast<const void*>(rows.input)) &&
         aligned(reinterpret_cast<const void*>(rows.residual)) && aligned(reinterpret_cast<const void*>(rows.weight)) &&
         aligned(reinterpret_cast<const void*>(rows.out)) && aligned(reinterpret_cast<const void*>(rows.residual_out));
}

template <typename T>
struct Chunk {
  T v[norm::kChunk];
};

// Elements [i, i + kChunk) of a row of `hidden` (zero past its end).
template <typename T, bool kVector>
__device__ __forceinline__ Chunk<T> load_chunk(const T* row, std::size_t i, std::size_t hidden) {
  Chunk<T> chunk;
  if constexpr (kVector) {
#pragma unroll
    for (int k = 0; k < norm::kChunk; k += Pack<T>::kSize) *reinterpret_cast<Pack<T>*>(chunk.v + k) = load_pack(row + i + k);
  } else {
#pragma unroll
    for (int j = 0; j < norm::kChunk; ++j) chunk.v[j] = i + j < hidden ? row[i + j] : narrow<T>(0.0f);
  }
  return chunk;
}

template <typename T, bool kVector>
__device__ __forceinline__ void store_chunk(T* row, std::size_t i, std::size_t hidden, const Chunk<T>& chunk) {
  if constexpr (kVector) {
#pragma unroll
    for (int k = 0; k < norm::kChunk; k += Pack<T>::kSize) store_pack(row + i + k, *reinterpret_cast<const Pack<T>*>(chunk.v + k));
  } else {
#pragma unroll
    for (int j = 0; j < norm::kChunk; ++j)
      if (i + j < hidden) row[i + j] = chunk.v[j];
  }
}

// The all-reduce's chunk at i of a row from every rank's staged copy of the row (`row(r)`): the
// rank-order sum of pack.cuh, a pack at a time.
template <typename T, int N, typename Row>
__device__ __forceinline__ Chunk<T> summed_chunk(Row row, std::size_t i) {
  Chunk<T> chunk;
#pragma unroll
  for (int k = 0; k < norm::kChunk; k += Pack<T>::kSize)
    *reinterpret_cast<Pack<T>*>(chunk.v + k) = sum_pack<T, N>([&](int r) { return row(r) + i + k; });
  return chunk;
}

// The row's 1 / sqrt(mean + eps), in every thread, from each lane's partial sum of squares.
__device__ __forceinline__ float block_inverse_rms(float partial, std::size_t hidden, float eps) {
  __shared__ float lanes[norm::kLanes];
  const int lane = threadIdx.x;
  lanes[lane] = partial;
#pragma unroll
  for (int offset = norm::kLanes / 2; offset >= 32; offset /= 2) {
    __syncthreads();
    const float sum = __fadd_rn(lanes[lane], lanes[lane ^ offset]);
    __syncthreads();
    lanes[lane] = sum;
  }
  __syncthreads();
  float sum = lanes[lane];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
  __syncthreads();  // lanes[] is free for the next row
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sum, float(hidden)), eps)));
}

// One row with the block's threads: `summed(i)` is the all-reduce's chunk at i; residual_out and
// out are written (row-relative pointers), and `keep(i, out, residual_out)` sees every chunk of
// both (a twoshot owner keeps them for its peers).
template <typename T, bool kVector, typename Summed, typename Keep>
__device__ __forceinline__ void add_rms_norm_row(Summed summed, const T* residual, const T* weight, T* out,
                                                 T* residual_out, std::size_t hidden, float eps, Keep keep) {
  float partial = 0.0f;
  for (std::size_t i = std::size_t(threadIdx.x) * norm::kChunk; i < hidden; i += std::size_t(norm::kLanes) * norm::kChunk) {
    const Chunk<T> sum = summed(i);
    const Chunk<T> add = load_chunk<T, kVector>(residual, i, hidden);
    Chunk<T> kept;
#pragma unroll
    for (int j = 0; j < norm::kChunk; ++j) {
      kept.v[j] = narrow<T>(__fadd_rn(widen(sum.v[j]), widen(add.v[j])));
      const float value = widen(kept.v[j]);
      partial = __fadd_rn(partial, __fmul_rn(value, value));  // zero past the row's end adds nothing
    }
    store_chunk<T, kVector>(residual_out, i, hidden, kept);
  }
  const float inverse = block_inverse_rms(partial, hidden, eps);
  for (std::size_t i = std::size_t(threadIdx.x) * norm::kChunk; i < hidden; i += std::size_t(norm::kLanes) * norm::kChunk) {
    const Chunk<T> kept = load_chunk<T, kVector>(residual_out, i, hidden);  // this thread's own stores
    const Chunk<T> scale = load_chunk<T, kVector>(weight, i, hidden);
    Chunk<T> normed;
#pragma unroll
    for (int j = 0; j < norm::kChunk; ++j)
      normed.v[j] = narrow<T>(__fmul_rn(__fmul_rn(widen(kept.v[j]), inverse), widen(scale.v[j])));
    store_chunk<T, kVector>(out, i, hidden, normed);
    keep(i, normed, kept);
  }
}

struct KeepNothing {
  template <typename Chunk>
  __device__ void operator()(std::size_t, const Chunk&, const Chunk&) const {}
};

}  // namespace nodecomm::cuda
