// dma.cu — the copy paths: dma all-reduce (lossless or over a compressed wire) and all_gather,
// whose bulk moves are copy-engine copies, with small SM kernels between them: the signal (one
// block-pair barrier), the reduction, and the copy out. They address fixed slots, since copies captured in a graph keep their addresses: a
// signal before staging and one after the last read fence them off from whatever runs before and
// after. Copies run whatever a kernel before them found, so the copy paths copy peers' data into
// this rank's slot 1 and a kernel moves it to the output only if no barrier of this rank gave up
// (layout.h). The signal is also the group's barrier and what a call of nothing meets at.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "../agreement.h"
#include "../errors.h"
#include "collectives.h"
#include "driver.h"
#include "pack.cuh"
#include "paths.h"
#include "signal.cuh"
#include "wire_codec.cuh"
#include "world.h"

namespace nodecomm::cuda {
namespace {

constexpr int kSignalThreads = 32;  // one warp: at most kMaxRanks peers to signal and wait for
constexpr int kReduceMaxBlocks = 132;
// The dma path pulls its segment from the peers in chunks of this many bytes per peer: the
// reduction of one chunk overlaps the copies of the next.
constexpr std::size_t kDmaChunkBytes = 1 << 20;

// One block-pair barrier on block 0's counters: the signal between the copy paths' steps.
template <int N>
__global__ void signal_kernel(__grid_constant__ const Signal<N> signal, TaggedCall call) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  signal.barrier(&failed, call, false);
}

// dma: elements [lo, lo + n) of this rank's segment [own_begin, ...): this rank's values are in
// slot 0, peer p's were pulled into slot 1 at (p < rank ? p : p - 1) * segment. The sum goes to
// slot 0, where peers gather it from, and to the output.
template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads)
    dma_reduce_kernel(Signal<N> signal, std::size_t slot_stride, std::size_t own_begin, std::size_t lo, std::size_t n,
                      std::size_t segment, T* output) {
  const int rank = signal.rank;
  // Checked at the stores, so that the word's load overlaps the sums' loads.
  const bool stopped = signal.gave_up();
  T* staged = reinterpret_cast<T*>(signal.mine() + kSlotOffset);
  const T* pulled = reinterpret_cast<const T*>(signal.mine() + kSlotOffset + slot_stride);
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
        if (stopped) return;
        store_pack(staged + i, sum);
        store_pack(output + i, sum);
      },
      [&](std::size_t i) {
        const T sum = sum_element<T, N>(sources_at(i));
        if (stopped) return;
        staged[i] = sum;
        output[i] = sum;
      });
}

// dma over a compressed wire: the input's encoding, into slot 0 (the grid strides over all of it).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    wire_encode_kernel(const T* input, std::size_t count, std::uint8_t* to, wire::Wire format) {
  encode_range(input, 0, count, count, to, format, std::size_t(blockIdx.x) * blockDim.x + threadIdx.x,
               std::size_t(gridDim.x) * blockDim.x);
}

// dma over a compressed wire: this rank's segment [lo, hi) summed from its own encoding in slot 0
// and the peers' codes and scales pulled into slot 1 (peer p's codes at (p < rank ? p : p - 1) *
// segment, every peer's scales behind all the codes). The sums go to the output and behind the
// encoding in slot 0, where the peers gather them from.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    wire_dma_reduce_kernel(Signal<N> signal, std::size_t slot_stride, std::size_t count, std::size_t lo,
                           std::size_t hi, std::size_t segment, T* output, wire::Wire format) {
  const int rank = signal.rank;
  const bool stopped = signal.gave_up();
  const std::uint8_t* staged = signal.mine() + kSlotOffset;
  const std::uint8_t* pulled = staged + slot_stride;
  const float* pulled_scales = reinterpret_cast<const float*>(pulled + std::size_t(N - 1) * segment);
  T* kept = reinterpret_cast<T*>(signal.mine() + kSlotOffset + wire::reduced_offset(count));
  const auto encoded_of = [=](int r) {
    if (r == rank) return encoded_at(staged, count);
    const std::size_t j = std::size_t(r < rank ? r : r - 1);
    return Encoded{pulled + j * segment, pulled_scales + j * (segment / wire::kWireBlock), lo};
  };
  reduce_encoded<T, N>(encoded_of, lo, hi, format, std::size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                       std::size_t(gridDim.x) * blockDim.x, [&](std::size_t i, T value) {
                         if (stopped) return;
                         kept[i] = value;
                         output[i] = value;
                       });
}

// What a copy path's last kernel moves from this rank's slot 1 to the output: piece p's bytes.
struct Pieces {
  const std::uint8_t* from[kMaxRanks];
  std::uint8_t* to[kMaxRanks];
  std::size_t bytes[kMaxRanks];
  int count;
};

// Bytes one thread of copy_out moves per step: four 16-byte loads in flight before their stores.
constexpr std::size_t kCopyLanes = 4;
constexpr std::size_t kCopyStepBytes = 16 * kCopyLanes;

// Copies [from, from + n) to `to`, `thread` of `threads` taking every threads-th 16-byte lane.
__device__ __forceinline__ void copy_bytes(const std::uint8_t* from, std::uint8_t* to, std::size_t n,
                                           std::size_t thread, std::size_t threads) {
  std::size_t tail = 0;
  if (reinterpret_cast<std::uintptr_t>(from) % 16 == 0 && reinterpret_cast<std::uintptr_t>(to) % 16 == 0) {
    const auto* from_lanes = reinterpret_cast<const uint4*>(from);
    auto* to_lanes = reinterpret_cast<uint4*>(to);
    const std::size_t lanes = n / 16;
    for (std::size_t i = thread; i < lanes; i += threads * kCopyLanes) {
      uint4 value[kCopyLanes];
#pragma unroll
      for (std::size_t k = 0; k < kCopyLanes; ++k) {
        if (i + k * threads < lanes) value[k] = from_lanes[i + k * threads];
      }
#pragma unroll
      for (std::size_t k = 0; k < kCopyLanes; ++k) {
        if (i + k * threads < lanes) to_lanes[i + k * threads] = value[k];
      }
    }
    tail = lanes * 16;
  }
  for (std::size_t i = tail + thread; i < n; i += threads) to[i] = from[i];
}

// A copy path's last step. Block 0 meets the peers at the barrier after their last reads of this
// rank's slots, as a signal would, while the other blocks copy the pieces out unless a barrier of
// this rank gave up (then the output keeps what it held). The copy reads only this rank's slot 1,
// which no peer touches, so neither waits for the other; every mismatch shows at a call's first
// barrier, long before.
template <int N>
__global__ void __launch_bounds__(kThreads)
    copy_out_kernel(__grid_constant__ const Signal<N> signal, TaggedCall call, Pieces pieces) {
  __shared__ int failed;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) failed = 0;
    signal.barrier(&failed, call, false);
    return;
  }
  if (signal.gave_up()) return;
  const std::size_t thread = std::size_t(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  const std::size_t threads = std::size_t(gridDim.x - 1) * blockDim.x;
  for (int p = 0; p < pieces.count; ++p) copy_bytes(pieces.from[p], pieces.to[p], pieces.bytes[p], thread, threads);
}

// The last barrier of `call`, and the pieces copied out unless this rank gave up.
template <int N>
void copy_out(const Signal<N>& signal, TaggedCall call, const Pieces& pieces, cudaStream_t stream) {
  std::size_t total = 0;
  for (int p = 0; p < pieces.count; ++p) total += pieces.bytes[p];
  const std::size_t steps = (total + kCopyStepBytes - 1) / kCopyStepBytes;
  // Only block 0 waits, so the grid need not be resident: four blocks per SM keep more loads in flight.
  const int copiers = int(std::clamp<std::size_t>((steps + kThreads - 1) / kThreads, 1, 4 * kReduceMaxBlocks));
  copy_out_kernel<N><<<1 + copiers, kThreads, 0, stream>>>(signal, call, pieces);
  NODECOMM_CUDA(cudaGetLastError());
}

template <int N>
void signal_once(const Signal<N>& signal, TaggedCall call, cudaStream_t stream) {
  signal_kernel<N><<<1, kSignalThreads, 0, stream>>>(signal, call);
  NODECOMM_CUDA(cudaGetLastError());
}

void copy(void* to, const void* from, std::size_t nbytes, cudaStream_t stream) {
  if (nbytes != 0) NODECOMM_CUDA(cudaMemcpyAsync(to, from, nbytes, cudaMemcpyDeviceToDevice, stream));
}

template <typename T, int N>
void dma_typed(const GroupView& group, const Signal<N>& signal, const T* input, T* output, std::size_t count,
               TaggedCall call, cudaStream_t stream, const CopyPipeline& pipeline) {
  const int rank = group.rank;
  std::uint8_t* const* buffers = signal.peers.rank;
  const std::size_t stride = slot_stride(group.capacity_bytes);
  const std::size_t align = kSegmentAlign / sizeof(T);
  const std::size_t segment = ((count + N - 1) / N + align - 1) / align * align;
  NODECOMM_ASSERT((N - 1) * segment * sizeof(T) <= stride, "dma segments exceed the scratch slot");
  auto begin_of = [&](int r) { return std::min(count, std::size_t(r) * segment); };
  auto end_of = [&](int r) { return std::min(count, begin_of(r) + segment); };
  T* staged = reinterpret_cast<T*>(buffers[rank] + kSlotOffset);
  T* pulled = reinterpret_cast<T*>(buffers[rank] + kSlotOffset + stride);

  // The first signal also compares the ranks' calls, before anything is copied.
  signal_once(signal, call, stream);  // peers are done with whatever read our slots before
  copy(staged, input, count * sizeof(T), stream);
  signal_once(signal, call, stream);  // every rank has staged
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
        const T* theirs = reinterpret_cast<const T*>(buffers[p] + kSlotOffset) + lo;
        copy(pulled + std::size_t(p < rank ? p : p - 1) * segment + (lo - own_begin), theirs, n * sizeof(T),
             pipeline.copy_stream);
      }
      NODECOMM_CUDA(cudaEventRecord(pipeline.ready, pipeline.copy_stream));
      NODECOMM_CUDA(cudaStreamWaitEvent(stream, pipeline.ready, 0));
      const int blocks = int(std::clamp<std::size_t>((n + kThreads * 4 - 1) / (kThreads * 4), 1, kReduceMaxBlocks));
      reduce<<<blocks, kThreads, 0, stream>>>(signal, stride, own_begin, lo, n, segment, output);
      NODECOMM_CUDA(cudaGetLastError());
    }
  }
  signal_once(signal, call, stream);  // every segment is reduced
  // Peers' segments come to slot 1, where the pulled ones were, and go out from there.
  Pieces pieces{};
  for (int p = 0; p < N; ++p) {
    if (p == rank) continue;
    const std::size_t lo = begin_of(p), hi = end_of(p);
    T* gathered = pulled + std::size_t(p < rank ? p : p - 1) * segment;
    copy(gathered, reinterpret_cast<const T*>(buffers[p] + kSlotOffset) + lo, (hi - lo) * sizeof(T), stream);
    pieces.from[pieces.count] = reinterpret_cast<const std::uint8_t*>(gathered);
    pieces.to[pieces.count] = reinterpret_cast<std::uint8_t*>(output + lo);
    pieces.bytes[pieces.count++] = (hi - lo) * sizeof(T);
  }
  copy_out(signal, call, pieces, stream);  // nobody reads our slots any more
}

// dma's steps over a compressed wire: the copy engines pull codes and scales, not values, for the
// reduction (one pull, no pipeline: the codes are a quarter to a half of the values), and gather
// the sums in the element type, so nothing is quantized twice. Segments are whole multiples of 64
// elements, so the pulled codes and the gathered sums of the peers fit slot 1.
template <typename T, int N>
void wire_dma_typed(const GroupView& group, const Signal<N>& signal, const T* input, T* output, std::size_t count,
                    wire::Wire format, TaggedCall call, cudaStream_t stream) {
  constexpr std::size_t kAlign = 64;
  const int rank = group.rank;
  std::uint8_t* const* buffers = signal.peers.rank;
  const std::size_t stride = slot_stride(group.capacity_bytes);
  const std::size_t segment = ((count + N - 1) / N + kAlign - 1) / kAlign * kAlign;
  NODECOMM_ASSERT((N - 1) * segment * sizeof(T) <= stride && wire::reduced_offset(count) + count * sizeof(T) <= stride,
                  "compressed dma segments exceed the slots");
  auto begin_of = [&](int r) { return std::min(count, std::size_t(r) * segment); };
  auto end_of = [&](int r) { return std::min(count, begin_of(r) + segment); };
  std::uint8_t* staged = buffers[rank] + kSlotOffset;
  std::uint8_t* pulled = staged + stride;
  const int blocks = int(std::clamp<std::size_t>((count + kThreads * kQuad - 1) / (kThreads * kQuad), 1, kReduceMaxBlocks));

  signal_once(signal, call, stream);  // compares the calls; peers are done with our slots
  wire_encode_kernel<T><<<blocks, kThreads, 0, stream>>>(input, count, staged, format);
  NODECOMM_CUDA(cudaGetLastError());
  signal_once(signal, call, stream);  // every rank has encoded
  const std::size_t own_begin = begin_of(rank), own_end = end_of(rank);
  if (own_end > own_begin) {
    const std::size_t n = own_end - own_begin;
    for (int p = 0; p < N; ++p) {
      if (p == rank) continue;
      const std::size_t j = std::size_t(p < rank ? p : p - 1);
      const std::uint8_t* theirs = buffers[p] + kSlotOffset;
      copy(pulled + j * segment, theirs + own_begin, n, stream);
      copy(pulled + std::size_t(N - 1) * segment + j * (segment / wire::kWireBlock) * 4,
           theirs + wire::scales_offset(count) + own_begin / wire::kWireBlock * 4, wire::blocks_of(n) * 4, stream);
    }
    wire_dma_reduce_kernel<T, N><<<blocks, kThreads, 0, stream>>>(signal, stride, count, own_begin, own_end, segment,
                                                                   output, format);
    NODECOMM_CUDA(cudaGetLastError());
  }
  signal_once(signal, call, stream);  // every segment is reduced
  Pieces pieces{};
  T* gathered = reinterpret_cast<T*>(pulled);
  for (int p = 0; p < N; ++p) {
    if (p == rank) continue;
    const std::size_t lo = begin_of(p), hi = end_of(p);
    T* to = gathered + std::size_t(p < rank ? p : p - 1) * segment;
    copy(to, reinterpret_cast<const T*>(buffers[p] + kSlotOffset + wire::reduced_offset(count)) + lo,
         (hi - lo) * sizeof(T), stream);
    pieces.from[pieces.count] = reinterpret_cast<const std::uint8_t*>(to);
    pieces.to[pieces.count] = reinterpret_cast<std::uint8_t*>(output + lo);
    pieces.bytes[pieces.count++] = (hi - lo) * sizeof(T);
  }
  copy_out(signal, call, pieces, stream);  // nobody reads our slots any more
}

}  // namespace

void dma_all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                    DType dtype, wire::Wire format, TaggedCall call, std::uint64_t timeout_ns, cudaStream_t stream,
                    const CopyPipeline& pipeline) {
  for_instance<DeviceElements>(group.world_size, dtype, [&](auto world, auto element) {
    constexpr int N = decltype(world)::value;
    using T = typename decltype(element)::type;
    const auto* in = reinterpret_cast<const T*>(input);
    auto* out = reinterpret_cast<T*>(output);
    if (format != wire::Wire::kLossless) {
      return wire_dma_typed<T, N>(group, signal_of<N>(group, timeout_ns), in, out, count, format, call, stream);
    }
    dma_typed<T, N>(group, signal_of<N>(group, timeout_ns), in, out, count, call, stream, pipeline);
  });
}

void meet_peers(const GroupView& group, TaggedCall call, std::uint64_t timeout_ns, cudaStream_t stream) {
  for_world(group.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    signal_once(signal_of<N>(group, timeout_ns), call, stream);
  });
}

void all_gather(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t nbytes,
                std::size_t output_stride, double timeout_s, cudaStream_t stream) {
  check_group(group);
  NODECOMM_CHECK(nbytes * std::size_t(group.world_size) <= group.capacity_bytes,
                 "payload of " + std::to_string(nbytes) + " bytes from each of " + std::to_string(group.world_size) +
                     " ranks exceeds the slot of " + std::to_string(group.capacity_bytes));
  NODECOMM_CHECK(nbytes <= output_stride, "a piece of " + std::to_string(nbytes) + " bytes past the output stride of " +
                                              std::to_string(output_stride));
  // The ranks compare the whole call's bytes, which the stride is.
  const TaggedCall call = tagged(Call{Collective::kAllGather, output_stride}.packed());
  for_world(group.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    const Signal<N> signal = signal_of<N>(group, timeout_ns(timeout_s));
    std::uint8_t* const* buffers = signal.peers.rank;
    signal_once(signal, call, stream);
    if (nbytes == 0) return;  // the calls met
    std::uint8_t* gathered = buffers[group.rank] + kSlotOffset + slot_stride(group.capacity_bytes);
    copy(buffers[group.rank] + kSlotOffset, reinterpret_cast<const void*>(input), nbytes, stream);
    signal_once(signal, call, stream);
    Pieces pieces{};
    for (int p = 0; p < N; ++p) {
      copy(gathered + std::size_t(p) * nbytes, buffers[p] + kSlotOffset, nbytes, stream);
      pieces.from[p] = gathered + std::size_t(p) * nbytes;
      pieces.to[p] = reinterpret_cast<std::uint8_t*>(output) + std::size_t(p) * output_stride;
      pieces.bytes[p] = nbytes;
    }
    pieces.count = N;
    copy_out(signal, call, pieces, stream);
  });
}

void barrier(const GroupView& group, double timeout_s, cudaStream_t stream) {
  check_group(group);
  meet_peers(group, tagged(Call{Collective::kBarrier}.packed()), timeout_ns(timeout_s), stream);
}

}  // namespace nodecomm::cuda
