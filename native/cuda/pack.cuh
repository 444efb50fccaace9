// pack.cuh — how the transport kernels move and sum elements: 16-byte packs where the pointers
// allow, element by element where they do not, and the one sum every path reduces through
// (fp32 in rank order 0..N-1, one rounding), so packed and element-wise code give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "numerics.cuh"

namespace nodecomm::cuda {

// Threads of every transport kernel's blocks.
constexpr int kThreads = 512;

// 16 bytes of elements: what one thread loads or stores at a time where the pointers allow it.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& value) {
  *reinterpret_cast<Pack<T>*>(p) = value;
}

// Packed access needs 16-byte aligned caller pointers; the buffers' slots always are.
inline bool aligned(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

// Calls pack(i) for every whole pack of [lo, hi) when kVector (lo pack-aligned), element(i) for
// the rest; `thread` of `threads` takes every threads-th pack or element.
template <typename T, bool kVector, typename PackOp, typename ElementOp>
__device__ __forceinline__ void strided_for(std::size_t lo, std::size_t hi, std::size_t thread, std::size_t threads,
                                            PackOp pack, ElementOp element) {
  std::size_t tail = lo;
  if constexpr (kVector) {
    constexpr std::size_t k = Pack<T>::kSize;
    tail = lo + (hi - lo) / k * k;
    for (std::size_t i = lo + thread * k; i < tail; i += threads * k) pack(i);
  }
  for (std::size_t i = tail + thread; i < hi; i += threads) element(i);
}

template <typename T, bool kVector, typename PackOp, typename ElementOp>
__device__ __forceinline__ void block_for(std::size_t lo, std::size_t hi, PackOp pack, ElementOp element) {
  strided_for<T, kVector>(lo, hi, threadIdx.x, blockDim.x, pack, element);
}

// Copies elements [lo, hi) from `from` to `to` with the block's threads.
template <typename T, bool kVector>
__device__ __forceinline__ void block_copy(const T* from, T* to, std::size_t lo, std::size_t hi) {
  block_for<T, kVector>(
      lo, hi, [&](std::size_t i) { store_pack(to + i, load_pack(from + i)); }, [&](std::size_t i) { to[i] = from[i]; });
}

// Rounds an element count up to whole packs, so that every share and segment starts aligned.
template <typename T>
__host__ __device__ __forceinline__ std::size_t round_to_packs(std::size_t n) {
  return (n + Pack<T>::kSize - 1) / Pack<T>::kSize * Pack<T>::kSize;
}

// The sum over ranks 0..N-1, where source(r) points at rank r's value, accumulated in fp32 in
// rank order and rounded once.
template <typename T, int N, typename Source>
__device__ __forceinline__ T sum_element(Source source) {
  float acc = widen(*source(0));
#pragma unroll
  for (int r = 1; r < N; ++r) acc += widen(*source(r));
  return narrow<T>(acc);
}

// The packed form: every rank's pack is loaded before any is added, so the loads of all peers
// are in flight together.
template <typename T, int N, typename Source>
__device__ __forceinline__ Pack<T> sum_pack(Source source) {
  Pack<T> in[N];
#pragma unroll
  for (int r = 0; r < N; ++r) in[r] = load_pack(source(r));
  Pack<T> out;
#pragma unroll
  for (int e = 0; e < Pack<T>::kSize; ++e) {
    float acc = widen(in[0].v[e]);
#pragma unroll
    for (int r = 1; r < N; ++r) acc += widen(in[r].v[e]);
    out.v[e] = narrow<T>(acc);
  }
  return out;
}

// Block b's share of a call's elements, in whole packs and 64-bit offsets: the same on every rank
// whether or not its pointers allow packed access.
struct BlockShare {
  std::size_t begin, end;
};

template <typename T>
__device__ __forceinline__ BlockShare block_share(std::size_t count) {
  const std::size_t per = round_to_packs<T>((count + gridDim.x - 1) / gridDim.x);
  const std::size_t begin = min(count, std::size_t(blockIdx.x) * per);
  return BlockShare{begin, min(count, begin + per)};
}

}  // namespace nodecomm::cuda
