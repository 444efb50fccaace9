// transport.cu — the CUDA collectives of collectives.h, instantiated per element type and world
// size.
//
// Barriers are block pairs: block b of rank p stores ++barriers[b] (its own counter, in device
// memory) into flags[b][p] of every rank's buffer (release, system scope) and waits until
// flags[b][q] reaches it for every q (acquire). Block b only reads what block b of each peer
// wrote, so block pairs suffice. Waits are bounded by the timeout and the group's abort word; a
// rank that times out records why and aborts the group, so every peer stops too.
//
// Kernel paths (oneshot, twoshot) pick the slot from ++launches[b], so consecutive launches and
// graph replays alternate slots without host patching; every launch advances all kMaxBlocks
// counters, so all blocks agree on the slot. A slot is rewritten two launches later only after
// this rank passed a barrier of the launch between, which no peer reaches before its previous
// launch, and with it every read of that slot, has completed. The copy paths (dma, all_gather) address fixed slots,
// since copies captured in a graph keep their addresses: a barrier before staging and one after
// the last read fence them off from whatever runs before and after.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../control.h"
#include "../errors.h"
#include "collectives.h"
#include "driver.h"
#include "layout.h"
#include "numerics.cuh"
#include "sync.cuh"
#include "topk.h"
#include "world.h"

namespace nodecomm::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kSignalThreads = 32;  // one warp: at most kMaxRanks peers to signal and wait for
constexpr int kReduceMaxBlocks = 132;
// The dma path pulls its segment from the peers in chunks of this many bytes per peer: the
// reduction of one chunk overlaps the copies of the next.
constexpr std::size_t kDmaChunkBytes = 1 << 20;

template <int N>
struct Peers {
  std::uint8_t* rank[N];
};

// 16 bytes of elements: what one thread loads or stores at a time where the pointers allow it.
// Reductions still widen, add in rank order and narrow element by element, so packed and
// element-wise code give the same bits.
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

// Rounds an element count up to whole packs, so that every share and segment starts aligned.
template <typename T>
__host__ __device__ __forceinline__ std::size_t round_to_packs(std::size_t n) {
  return (n + Pack<T>::kSize - 1) / Pack<T>::kSize * Pack<T>::kSize;
}

// Block-pair barrier among block b of every rank. Returns false (after recording why) on a
// timeout or an abort; every thread of the block gets the same answer.
template <int N>
__device__ bool block_pair_barrier(const Peers<N>& peers, std::uint8_t* control, int rank, std::uint64_t timeout_ns,
                                   int* failed) {
  std::uint8_t* mine = peers.rank[rank];
  const int block = blockIdx.x;
  __shared__ std::uint64_t epoch_shared;
  // One release per signalling thread covers the whole block's writes: bar.sync orders them
  // before it and release is cumulative. A system fence in every thread costs more with each block.
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint64_t* barriers = word(mine, kCounterOffset + std::size_t(block) * 16 + 8);
    epoch_shared = *barriers + 1;
    *barriers = epoch_shared;
  }
  __syncthreads();
  const std::uint64_t epoch = epoch_shared;
  if (threadIdx.x < N) {
    const int peer = threadIdx.x;
    store_release(word(peers.rank[peer], kFlagOffset + (std::size_t(block) * kMaxRanks + rank) * 8), epoch);
    const std::uint64_t* flag = word(mine, kFlagOffset + (std::size_t(block) * kMaxRanks + peer) * 8);
    if (!wait_at_least(flag, epoch, control, rank, peer, timeout_ns)) *failed = 1;
  }
  __syncthreads();
  return *failed == 0;
}

// Every path reduces through these two: the sum over ranks 0..N-1, where source(r) points at rank
// r's value, accumulated in fp32 in rank order and rounded once.
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

template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(Peers<N> peers, std::uint8_t* control, int rank,
                                                              std::size_t slot_stride, const T* input, T* output,
                                                              std::size_t count, Algorithm algorithm,
                                                              std::uint64_t timeout_ns) {
  __shared__ std::uint64_t launch_shared;
  __shared__ int failed;
  std::uint8_t* mine = peers.rank[rank];
  if (threadIdx.x == 0) {
    std::uint64_t* launches = word(mine, kCounterOffset + std::size_t(blockIdx.x) * 16);
    launch_shared = *launches + 1;
    *launches = launch_shared;
    failed = 0;
  }
  // Block 0 also advances the counters of the blocks this grid lacks, so every block of every
  // launch picks the same slot whatever the grids before it were: with per-block parities a block
  // could overwrite a region that another block index of the previous launch still has peers reading.
  if (blockIdx.x == 0) {
    for (unsigned b = gridDim.x + threadIdx.x; b < kMaxBlocks; b += blockDim.x) ++*word(mine, kCounterOffset + b * 16);
  }
  __syncthreads();
  const std::size_t slot = kSlotOffset + (launch_shared & 1) * slot_stride;

  // This block's share of the elements, in whole packs and 64-bit offsets; the same on every rank
  // whether or not its pointers allow packed access.
  const std::size_t per = round_to_packs<T>((count + gridDim.x - 1) / gridDim.x);
  const std::size_t begin = min(count, std::size_t(blockIdx.x) * per);
  const std::size_t end = min(count, begin + per);
  T* staged = reinterpret_cast<T*>(mine + slot);
  block_for<T, kVector>(
      begin, end, [&](std::size_t i) { store_pack(staged + i, load_pack(input + i)); },
      [&](std::size_t i) { staged[i] = input[i]; });
  if (!block_pair_barrier(peers, control, rank, timeout_ns, &failed)) return;

  // Element i of every rank's slot.
  const auto slots_at = [&peers, slot](std::size_t i) {
    return [&peers, slot, i](int r) { return reinterpret_cast<const T*>(peers.rank[r] + slot) + i; };
  };
  if (algorithm == Algorithm::kOneshot) {
    block_for<T, kVector>(
        begin, end, [&](std::size_t i) { store_pack(output + i, sum_pack<T, N>(slots_at(i))); },
        [&](std::size_t i) { output[i] = sum_element<T, N>(slots_at(i)); });
    return;
  }
  const std::size_t segment = round_to_packs<T>((end - begin + N - 1) / N);
  const std::size_t own_begin = min(end, begin + std::size_t(rank) * segment);
  const std::size_t own_end = min(end, own_begin + segment);
  block_for<T, kVector>(
      own_begin, own_end,
      [&](std::size_t i) {
        const Pack<T> value = sum_pack<T, N>(slots_at(i));
        store_pack(staged + i, value);
        store_pack(output + i, value);
      },
      [&](std::size_t i) {
        const T value = sum_element<T, N>(slots_at(i));
        staged[i] = value;
        output[i] = value;
      });
  if (!block_pair_barrier(peers, control, rank, timeout_ns, &failed)) return;
  for (int r = 0; r < N; ++r) {
    if (r == rank) continue;
    const std::size_t lo = min(end, begin + std::size_t(r) * segment), hi = min(end, lo + segment);
    const T* owner = reinterpret_cast<const T*>(peers.rank[r] + slot);
    block_for<T, kVector>(
        lo, hi, [&](std::size_t i) { store_pack(output + i, load_pack(owner + i)); },
        [&](std::size_t i) { output[i] = owner[i]; });
  }
}

// One block-pair barrier on block 0's counters: the signal between the copy paths' steps.
template <int N>
__global__ void signal_kernel(Peers<N> peers, std::uint8_t* control, int rank, std::uint64_t timeout_ns) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  block_pair_barrier(peers, control, rank, timeout_ns, &failed);
}

// dma: elements [lo, lo + n) of this rank's segment [own_begin, ...): this rank's values are in
// slot 0, peer p's were pulled into slot 1 at (p < rank ? p : p - 1) * segment. The sum goes to
// slot 0, where peers gather it from, and to the output.
template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads) dma_reduce_kernel(Peers<N> peers, int rank, std::size_t slot_stride,
                                                              std::size_t own_begin, std::size_t lo, std::size_t n,
                                                              std::size_t segment, T* output) {
  std::uint8_t* mine = peers.rank[rank];
  T* staged = reinterpret_cast<T*>(mine + kSlotOffset);
  const T* pulled = reinterpret_cast<const T*>(mine + kSlotOffset + slot_stride);
  // Element i as rank r holds it: this rank's in its slot 0, a peer's where it was pulled to.
  const auto sources_at = [=](std::size_t i) {
    return [=](int r) -> const T* {
      return r == rank ? staged + i : pulled + std::size_t(r < rank ? r : r - 1) * segment + (i - own_begin);
    };
  };
  strided_for<T, kVector>(
      lo, lo + n, std::size_t(blockIdx.x) * blockDim.x + threadIdx.x, std::size_t(gridDim.x) * blockDim.x,
      [&](std::size_t i) {
        const Pack<T> sum = sum_pack<T, N>(sources_at(i));
        store_pack(staged + i, sum);
        store_pack(output + i, sum);
      },
      [&](std::size_t i) {
        const T sum = sum_element<T, N>(sources_at(i));
        staged[i] = sum;
        output[i] = sum;
      });
}

template <int N>
Peers<N> peers_of(const GroupView& group) {
  Peers<N> peers;
  for (int r = 0; r < N; ++r) peers.rank[r] = reinterpret_cast<std::uint8_t*>(group.buffers[r]);
  return peers;
}

template <int N>
void signal(const GroupView& group, const Peers<N>& peers, std::uint64_t timeout, cudaStream_t stream) {
  signal_kernel<N><<<1, kSignalThreads, 0, stream>>>(peers, reinterpret_cast<std::uint8_t*>(group.control),
                                                     group.rank, timeout);
  NODECOMM_CUDA(cudaGetLastError());
}

void copy(void* to, const void* from, std::size_t nbytes, cudaStream_t stream) {
  if (nbytes != 0) NODECOMM_CUDA(cudaMemcpyAsync(to, from, nbytes, cudaMemcpyDeviceToDevice, stream));
}

// Packed access needs 16-byte aligned caller pointers; the buffers' slots always are.
bool aligned(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

template <typename T, int N>
void kernel_all_reduce(const GroupView& group, const T* input, T* output, std::size_t count, Algorithm algorithm,
                       std::uint64_t timeout, cudaStream_t stream) {
  // The grid follows from the count alone, so every rank launches the same one.
  const std::size_t wanted = (count + kThreads * 4 - 1) / (kThreads * 4);
  const int blocks = int(std::clamp<std::size_t>(wanted, 1, std::size_t(group.max_blocks)));
  auto* control = reinterpret_cast<std::uint8_t*>(group.control);
  const std::size_t stride = slot_stride(group.slot_bytes);
  const auto kernel = aligned(input) && aligned(output) ? all_reduce_kernel<T, N, true> : all_reduce_kernel<T, N, false>;
  kernel<<<blocks, kThreads, 0, stream>>>(peers_of<N>(group), control, group.rank, stride, input, output, count,
                                          algorithm, timeout);
  NODECOMM_CUDA(cudaGetLastError());
}

template <typename T, int N>
void dma_all_reduce(const GroupView& group, const T* input, T* output, std::size_t count, std::uint64_t timeout,
                    cudaStream_t stream, const CopyPipeline& pipeline) {
  const Peers<N> peers = peers_of<N>(group);
  const int rank = group.rank;
  const std::size_t stride = slot_stride(group.slot_bytes);
  const std::size_t align = kSegmentAlign / sizeof(T);
  const std::size_t segment = ((count + N - 1) / N + align - 1) / align * align;
  NODECOMM_CHECK((N - 1) * segment * sizeof(T) <= stride, "dma segments exceed the scratch slot");
  auto begin_of = [&](int r) { return std::min(count, std::size_t(r) * segment); };
  auto end_of = [&](int r) { return std::min(count, begin_of(r) + segment); };
  T* staged = reinterpret_cast<T*>(peers.rank[rank] + kSlotOffset);
  T* pulled = reinterpret_cast<T*>(peers.rank[rank] + kSlotOffset + stride);

  signal<N>(group, peers, timeout, stream);  // peers are done with whatever read our slots before
  copy(staged, input, count * sizeof(T), stream);
  signal<N>(group, peers, timeout, stream);  // every rank has staged
  const std::size_t own_begin = begin_of(rank), own_end = end_of(rank);
  if (own_end > own_begin) {
    NODECOMM_CUDA(cudaEventRecord(pipeline.fork, stream));
    NODECOMM_CUDA(cudaStreamWaitEvent(pipeline.copy_stream, pipeline.fork, 0));
    const std::size_t chunk = kDmaChunkBytes / sizeof(T);
    const auto reduce = aligned(output) ? dma_reduce_kernel<T, N, true> : dma_reduce_kernel<T, N, false>;
    for (std::size_t lo = own_begin; lo < own_end; lo += chunk) {
      const std::size_t n = std::min(chunk, own_end - lo);
      for (int p = 0; p < N; ++p) {
        if (p == rank) continue;
        const T* theirs = reinterpret_cast<const T*>(peers.rank[p] + kSlotOffset) + lo;
        copy(pulled + std::size_t(p < rank ? p : p - 1) * segment + (lo - own_begin), theirs, n * sizeof(T),
             pipeline.copy_stream);
      }
      NODECOMM_CUDA(cudaEventRecord(pipeline.ready, pipeline.copy_stream));
      NODECOMM_CUDA(cudaStreamWaitEvent(stream, pipeline.ready, 0));
      const int blocks = int(std::clamp<std::size_t>((n + kThreads * 4 - 1) / (kThreads * 4), 1, kReduceMaxBlocks));
      reduce<<<blocks, kThreads, 0, stream>>>(peers, rank, stride, own_begin, lo, n, segment, output);
      NODECOMM_CUDA(cudaGetLastError());
    }
  }
  signal<N>(group, peers, timeout, stream);  // every segment is reduced
  for (int p = 0; p < N; ++p) {
    if (p == rank) continue;
    const std::size_t lo = begin_of(p), hi = end_of(p);
    copy(output + lo, reinterpret_cast<const T*>(peers.rank[p] + kSlotOffset) + lo, (hi - lo) * sizeof(T), stream);
  }
  signal<N>(group, peers, timeout, stream);  // nobody reads our slots any more
}

template <typename T, int N>
void all_reduce_typed(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                      Algorithm algorithm, std::uint64_t timeout, cudaStream_t stream, const CopyPipeline& pipeline) {
  const auto* in = reinterpret_cast<const T*>(input);
  auto* out = reinterpret_cast<T*>(output);
  if (algorithm == Algorithm::kDma) return dma_all_reduce<T, N>(group, in, out, count, timeout, stream, pipeline);
  kernel_all_reduce<T, N>(group, in, out, count, algorithm, timeout, stream);
}

void check_group(const GroupView& group) {
  NODECOMM_CHECK(group.rank >= 0 && group.rank < group.world_size, "rank out of range");
  NODECOMM_CHECK(group.control != 0, "control segment address is null");
}

}  // namespace

void all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count, int dtype,
                Algorithm algorithm, double timeout_s, cudaStream_t stream, const CopyPipeline& pipeline) {
  check_group(group);
  NODECOMM_CHECK(group.max_blocks >= 1 && group.max_blocks <= kMaxBlocks,
                 "max_blocks " + std::to_string(group.max_blocks) + ": expected 1.." + std::to_string(kMaxBlocks));
  NODECOMM_CHECK(algorithm == Algorithm::kOneshot || algorithm == Algorithm::kTwoshot || algorithm == Algorithm::kDma,
                 "unknown algorithm code " + std::to_string(int(algorithm)));
  NODECOMM_CHECK(dtype >= 1 && dtype <= 3, "unknown dtype code " + std::to_string(dtype));
  const std::size_t element = dtype == 1 ? 4 : 2;
  NODECOMM_CHECK(count * element <= group.slot_bytes, "payload of " + std::to_string(count * element) +
                                                          " bytes exceeds the slot of " +
                                                          std::to_string(group.slot_bytes));
  if (count == 0) return;
  const std::uint64_t timeout = timeout_ns(timeout_s);
  for_world(group.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    switch (dtype) {
      case 1: return all_reduce_typed<float, N>(group, input, output, count, algorithm, timeout, stream, pipeline);
      case 2: return all_reduce_typed<__half, N>(group, input, output, count, algorithm, timeout, stream, pipeline);
      default:
        return all_reduce_typed<__nv_bfloat16, N>(group, input, output, count, algorithm, timeout, stream, pipeline);
    }
  });
}

void all_gather(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t nbytes,
                std::size_t output_stride, double timeout_s, cudaStream_t stream) {
  check_group(group);
  NODECOMM_CHECK(nbytes <= group.slot_bytes,
                 "payload of " + std::to_string(nbytes) + " bytes exceeds the slot of " +
                     std::to_string(group.slot_bytes));
  if (nbytes == 0) return;
  const std::uint64_t timeout = timeout_ns(timeout_s);
  for_world(group.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    const Peers<N> peers = peers_of<N>(group);
    signal<N>(group, peers, timeout, stream);
    copy(peers.rank[group.rank] + kSlotOffset, reinterpret_cast<const void*>(input), nbytes, stream);
    signal<N>(group, peers, timeout, stream);
    for (int p = 0; p < N; ++p) {
      copy(reinterpret_cast<std::uint8_t*>(output) + std::size_t(p) * output_stride, peers.rank[p] + kSlotOffset,
           nbytes, stream);
    }
    signal<N>(group, peers, timeout, stream);
  });
}

int resident_blocks(int device) {
  // Every kernel whose blocks wait on peers' blocks needs its whole grid resident at once, so the
  // one with the fewest blocks per SM bounds them all; register use does not follow the element
  // size or the world size, so each instantiation is asked.
  int per_sm = topk_blocks_per_sm();
  for (const int world_size : kWorldSizes) {
    for_world(world_size, [&](auto world) {
      constexpr int N = decltype(world)::value;
      per_sm = std::min({per_sm, blocks_per_sm(all_reduce_kernel<float, N, true>, kThreads),
                         blocks_per_sm(all_reduce_kernel<float, N, false>, kThreads),
                         blocks_per_sm(all_reduce_kernel<__half, N, true>, kThreads),
                         blocks_per_sm(all_reduce_kernel<__half, N, false>, kThreads),
                         blocks_per_sm(all_reduce_kernel<__nv_bfloat16, N, true>, kThreads),
                         blocks_per_sm(all_reduce_kernel<__nv_bfloat16, N, false>, kThreads)});
    });
  }
  int sms = 0;
  NODECOMM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return per_sm * sms;
}

void barrier(const GroupView& group, double timeout_s, cudaStream_t stream) {
  check_group(group);
  const std::uint64_t timeout = timeout_ns(timeout_s);
  for_world(group.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    signal<N>(group, peers_of<N>(group), timeout, stream);
  });
}

}  // namespace nodecomm::cuda
