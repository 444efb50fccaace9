// transport.cu — the CUDA all-reduce kernels, instantiated per element type and world size,
// behind the C-style ABI of all_reduce.h.
//
// Per block b of every rank:
//   1. launch = ++launches[b] (device memory: consecutive launches and graph replays alternate
//      slots without host patching); copy this block's share of the input into slot (launch & 1)
//   2. block-pair barrier: store ++barriers[b] into flags[b][rank] of every rank (release, system
//      scope), wait until flags[b][p] reaches it for every p (acquire), bounded by the timeout and
//      the abort word
//   3. oneshot: sum the share of every rank's slot in rank order, round once, write the output.
//      twoshot: reduce segment `rank` of the share into this rank's slot and the output, barrier
//      again, copy the other segments from their owners' slots.
// Block b only reads what block b of each peer wrote, so block pairs suffice. A slot is rewritten
// two launches later only after every peer's block b has passed a barrier of the launch between,
// which it reaches after finishing its reads of that slot.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "../errors.h"
#include "driver.h"
#include "layout.h"
#include "all_reduce.h"

namespace nodecomm::cuda {
namespace {

constexpr int kThreads = 512;

template <int N>
struct Buffers {
  std::uint8_t* rank[N];
};

__device__ __forceinline__ void store_release(std::uint64_t* address, std::uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ std::uint64_t load_acquire(const std::uint64_t* address) {
  std::uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ std::uint64_t load_volatile(const std::uint64_t* address) {
  std::uint64_t value;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(value) : "l"(address));
  return value;
}

__device__ __forceinline__ std::uint64_t now_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ std::uint64_t* word(std::uint8_t* buffer, std::size_t offset) {
  return reinterpret_cast<std::uint64_t*>(buffer + offset);
}

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Record the first error in this rank's buffer.
__device__ void record_error(std::uint8_t* mine, std::uint64_t code, int peer, std::uint64_t epoch) {
  std::uint64_t* record = word(mine, kErrorOffset);
  if (atomicCAS(reinterpret_cast<unsigned long long*>(record), 0ull, (unsigned long long)code) == 0) {
    record[1] = std::uint64_t(peer);
    record[2] = epoch;
    __threadfence_system();
  }
}

// Block-pair barrier among block b of every rank. Returns false (after recording why) on a
// timeout or an abort; every thread of the block gets the same answer.
template <int N>
__device__ bool block_pair_barrier(const Buffers<N>& buffers, int rank, std::uint64_t timeout_ns, int* failed) {
  std::uint8_t* mine = buffers.rank[rank];
  const int block = blockIdx.x;
  __shared__ std::uint64_t epoch_shared;
  __threadfence_system();  // this thread's writes before the signal
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
    store_release(word(buffers.rank[peer], kFlagOffset + (std::size_t(block) * kMaxRanks + rank) * 8), epoch);
    const std::uint64_t* flag = word(mine, kFlagOffset + (std::size_t(block) * kMaxRanks + peer) * 8);
    const std::uint64_t started = now_ns();
    while (load_acquire(flag) < epoch) {
      if (load_volatile(word(mine, kAbortOffset)) != 0) {
        record_error(mine, kErrorAborted, peer, epoch);
        *failed = 1;
        break;
      }
      if (now_ns() - started > timeout_ns) {
        record_error(mine, kErrorTimeout, peer, epoch);
        *failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  return *failed == 0;
}

template <typename T, int N>
__device__ __forceinline__ float sum_ranks(const Buffers<N>& buffers, std::size_t slot, std::size_t i) {
  float acc = widen(reinterpret_cast<const T*>(buffers.rank[0] + slot)[i]);
#pragma unroll
  for (int r = 1; r < N; ++r) acc += widen(reinterpret_cast<const T*>(buffers.rank[r] + slot)[i]);
  return acc;
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(Buffers<N> buffers, int rank, std::size_t slot_stride,
                                                              const T* __restrict__ input, T* __restrict__ output,
                                                              std::size_t count, Algorithm algorithm,
                                                              std::uint64_t timeout_ns) {
  __shared__ std::uint64_t launch_shared;
  __shared__ int failed;
  std::uint8_t* mine = buffers.rank[rank];
  if (threadIdx.x == 0) {
    std::uint64_t* launches = word(mine, kCounterOffset + std::size_t(blockIdx.x) * 16);
    launch_shared = *launches + 1;
    *launches = launch_shared;
    failed = 0;
  }
  __syncthreads();
  const std::size_t slot = kSlotOffset + (launch_shared & 1) * slot_stride;

  // This block's share of the elements, in 64-bit offsets.
  const std::size_t per = (count + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = min(count, std::size_t(blockIdx.x) * per);
  const std::size_t end = min(count, begin + per);
  T* staged = reinterpret_cast<T*>(mine + slot);
  for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) staged[i] = input[i];
  if (!block_pair_barrier(buffers, rank, timeout_ns, &failed)) return;

  if (algorithm == Algorithm::kOneshot) {
    for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) output[i] = narrow<T>(sum_ranks<T, N>(buffers, slot, i));
    return;
  }
  const std::size_t segment = (end - begin + N - 1) / N;
  const std::size_t own_begin = min(end, begin + std::size_t(rank) * segment);
  const std::size_t own_end = min(end, own_begin + segment);
  for (std::size_t i = own_begin + threadIdx.x; i < own_end; i += blockDim.x) {
    const T value = narrow<T>(sum_ranks<T, N>(buffers, slot, i));
    staged[i] = value;
    output[i] = value;
  }
  if (!block_pair_barrier(buffers, rank, timeout_ns, &failed)) return;
  for (int r = 0; r < N; ++r) {
    if (r == rank) continue;
    const std::size_t lo = min(end, begin + std::size_t(r) * segment), hi = min(end, lo + segment);
    const T* owner = reinterpret_cast<const T*>(buffers.rank[r] + slot);
    for (std::size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) output[i] = owner[i];
  }
}

template <typename T, int N>
void launch(const std::uintptr_t* addresses, int rank, std::size_t slot_bytes, std::uintptr_t input,
            std::uintptr_t output, std::size_t count, Algorithm algorithm, std::uint64_t timeout_ns,
            cudaStream_t stream) {
  Buffers<N> buffers;
  for (int r = 0; r < N; ++r) buffers.rank[r] = reinterpret_cast<std::uint8_t*>(addresses[r]);
  // The grid follows from the count alone, so every rank launches the same one.
  const std::size_t wanted = (count + kThreads * 4 - 1) / (kThreads * 4);
  const int blocks = int(wanted < 1 ? 1 : (wanted > kMaxBlocks ? kMaxBlocks : wanted));
  all_reduce_kernel<T, N><<<blocks, kThreads, 0, stream>>>(buffers, rank, slot_stride(slot_bytes),
                                                            reinterpret_cast<const T*>(input),
                                                            reinterpret_cast<T*>(output), count, algorithm, timeout_ns);
  NODECOMM_CUDA(cudaGetLastError());
}

template <typename T>
void launch_for_world(int world_size, const std::uintptr_t* addresses, int rank, std::size_t slot_bytes,
                      std::uintptr_t input, std::uintptr_t output, std::size_t count, Algorithm algorithm,
                      std::uint64_t timeout_ns, cudaStream_t stream) {
  switch (world_size) {
#define NODECOMM_WORLD(n) \
  case n: return launch<T, n>(addresses, rank, slot_bytes, input, output, count, algorithm, timeout_ns, stream);
    NODECOMM_WORLD(1) NODECOMM_WORLD(2) NODECOMM_WORLD(3) NODECOMM_WORLD(4) NODECOMM_WORLD(5) NODECOMM_WORLD(6)
    NODECOMM_WORLD(7) NODECOMM_WORLD(8) NODECOMM_WORLD(16)
#undef NODECOMM_WORLD
  }
  NODECOMM_RAISE(kInvalidArgument, "CUDA paths support world sizes 1-8 and 16, got " + std::to_string(world_size));
}

}  // namespace

void all_reduce(const std::uintptr_t* buffers, int world_size, int rank, std::size_t slot_bytes,
                std::uintptr_t input, std::uintptr_t output, std::size_t count, int dtype, Algorithm algorithm,
                double timeout_s, std::uintptr_t stream) {
  NODECOMM_CHECK(rank >= 0 && rank < world_size, "rank out of range");
  NODECOMM_CHECK(algorithm == Algorithm::kOneshot || algorithm == Algorithm::kTwoshot,
                 "unknown algorithm code " + std::to_string(int(algorithm)));
  const std::size_t element = dtype == 1 ? 4 : 2;
  NODECOMM_CHECK(count * element <= slot_bytes, "payload of " + std::to_string(count * element) +
                                                    " bytes exceeds the slot of " + std::to_string(slot_bytes));
  if (count == 0) return;
  const auto timeout_ns = std::uint64_t(timeout_s * 1e9);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 1: return launch_for_world<float>(world_size, buffers, rank, slot_bytes, input, output, count, algorithm, timeout_ns, s);
    case 2: return launch_for_world<__half>(world_size, buffers, rank, slot_bytes, input, output, count, algorithm, timeout_ns, s);
    case 3:
      return launch_for_world<__nv_bfloat16>(world_size, buffers, rank, slot_bytes, input, output, count, algorithm,
                                             timeout_ns, s);
  }
  NODECOMM_RAISE(kInvalidArgument, "unknown dtype code " + std::to_string(dtype));
}

void read_error(std::uintptr_t buffer, std::uint64_t record[3]) {
  NODECOMM_CUDA(cudaDeviceSynchronize());
  NODECOMM_CUDA(cudaMemcpy(record, reinterpret_cast<const void*>(buffer + kErrorOffset), 24, cudaMemcpyDeviceToHost));
}

}  // namespace nodecomm::cuda
