// oneshot.cu — oneshot all-reduce: every rank sums every rank's whole payload, in one of two variants.
//
// Pushed, while the payload fits the push slots and every thread carries at most one line: each
// rank writes its input, 4 bytes beside a flag in every 8-byte word, into its part of every peer's
// push slot, and each rank waits for those words in its own memory; no barrier, no read across
// the fabric. A reader clears every line it took, so a line holds either nothing or this launch's
// words: the launch that next writes it, two launches on, starts only after every peer's launch
// between has started, which a peer does once it has finished reading this one. Every line's flag
// carries a digest of the call and the launch, so ranks in different calls see other flags.
//
// Pulled, past that: stage into this launch's slot, one barrier, every rank sums every slot.
// Over a compressed wire always pulled: encode into this launch's slot, one barrier, every rank
// sums every slot's values, dequantized (wire_codec.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "../errors.h"
#include "driver.h"
#include "pack.cuh"
#include "paths.h"
#include "rms_norm.cuh"
#include "signal.cuh"
#include "wire_codec.cuh"
#include "world.h"

namespace nodecomm::cuda {
namespace {

// The flag of every line a launch pushes: never 0, which a cleared line holds, different for the
// launch two on (which reuses the slot) and for another call (the call's digest, so two calls go
// unnoticed with odds of 2^-31 per launch).
__device__ __forceinline__ std::uint32_t push_flag(std::uint64_t launch, TaggedCall call) {
  return (call.digest + std::uint32_t(launch) * 0x9E3779B9u) | 1;
}

// Line `line` of the input, its two 4-byte words: elements [line * per_line, ...) as they are, bit
// for bit, zero past count.
template <typename T>
__device__ __forceinline__ uint2 words_of(const T* input, std::size_t line, std::size_t count, bool whole_words) {
  constexpr int kPerLine = 8 / sizeof(T);
  if (whole_words && (line + 1) * kPerLine <= count) return reinterpret_cast<const uint2*>(input)[line];
  std::uint32_t words[2] = {0, 0};
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>;
  const Bits* bits = reinterpret_cast<const Bits*>(input);
#pragma unroll
  for (int j = 0; j < kPerLine; ++j) {
    const std::size_t i = line * kPerLine + j;
    if (i < count) words[j * sizeof(T) / 4] |= std::uint32_t(bits[i]) << ((8 * sizeof(T) * j) % 32);
  }
  return make_uint2(words[0], words[1]);
}

// Threads per block of a push grid while max_blocks of them carry its lines: twice the blocks of
// kThreads, half the warps polling on each SM (docs/bench-gpu.md, "The constants in the kernels").
constexpr int kPushThreads = 256;

// Element j of a line, widened.
template <typename T>
__device__ __forceinline__ float widen_element(const PushLine& line, int j) {
  const std::uint32_t bits = (j * sizeof(T) / 4 == 0 ? line.low : line.high) >> ((8 * sizeof(T) * j) % 32);
  if constexpr (std::is_same_v<T, float>) return __uint_as_float(bits);
  else if constexpr (std::is_same_v<T, __half>) return widen(__ushort_as_half((unsigned short)(bits & 0xffff)));
  else return widen(__ushort_as_bfloat16((unsigned short)(bits & 0xffff)));
}

// A pushing rank's evidence that `peer` is in another call: a line of it with another flag, or
// an arrival at block 0's next barrier, which this launch has none of.
struct PeerElsewhere {
  std::uint8_t* mine;
  const PushLine* at;
  std::uint32_t flag;
  int peer;
  __device__ bool operator()() const {
    const PushLine line = load_line(at);
    if ((line.low_flag != 0 && line.low_flag != flag) || (line.high_flag != 0 && line.high_flag != flag)) return true;
    const std::uint64_t passed = load_volatile(word(mine, kCounterOffset + 8));  // block 0's barriers
    return epochs_past(load_acquire(word(mine, flag_offset(0, peer))), passed) > 0;
  }
};

// Part r of a push slot holds rank r's lines. Thread t of the grid sends line t to every peer and
// sums line t of every rank (the launcher gives every line a thread), so block b only waits for
// what block b of each peer sends, and this rank's own line is loaded once, before any wait.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    push_kernel(__grid_constant__ const Signal<N> signal, const T* input, T* output, std::size_t count,
                TaggedCall call) {
  constexpr int kPerLine = 8 / sizeof(T);
  const std::size_t line = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool carries = line < (count + kPerLine - 1) / kPerLine;
  // The input, the stop words and the launch counter are loaded together, not one after the other.
  const uint2 words =
      carries ? words_of(input, line, count, reinterpret_cast<std::uintptr_t>(input) % 8 == 0) : make_uint2(0, 0);
  const bool stopped = signal.stopped();
  const std::uint64_t launch = signal.next_launch();
  if (stopped) {  // as at a barrier: nothing of this launch reaches the peers
    if (blockIdx.x == 0 && threadIdx.x == 0) signal.note_asked(launch, call.call);
    return;
  }
  if (!carries) return;
  const std::uint32_t flag = push_flag(launch, call);
  const auto part_of = [&](int owner, int source) {
    return pushed_lines(signal.peers.at(owner), signal.push, launch, source);
  };
  const PushLine mine{words.x, flag, words.y, flag};
#pragma unroll
  for (int p = 0; p < N; ++p) {
    if (p != signal.rank) store_line(part_of(p, signal.rank) + line, mine);
  }
  PushLine got[N];
#pragma unroll
  for (int r = 0; r < N; ++r) {
    if (r == signal.rank) {
      got[r] = mine;
      continue;
    }
    PushLine* at = part_of(signal.rank, r) + line;
    const auto arrived = [&] {
      got[r] = load_line(at);
      return got[r].low_flag == flag && got[r].high_flag == flag;
    };
    if (!wait_until(arrived, launch, signal.control, signal.rank, r, signal.timeout_ns, call.call,
                    PeerElsewhere{signal.mine(), at, flag, r}, signal.stop_word())) {
      signal.give_up();
      return;
    }
    store_line(at, PushLine{});
  }
#pragma unroll
  for (int j = 0; j < kPerLine; ++j) {
    const std::size_t i = line * kPerLine + j;
    float acc = widen_element<T>(got[0], j);
#pragma unroll
    for (int r = 1; r < N; ++r) acc += widen_element<T>(got[r], j);
    if (i < count) output[i] = narrow<T>(acc);
  }
}

template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads)
    pull_kernel(__grid_constant__ const Signal<N> signal, std::size_t slot_stride, const T* input, T* output,
                std::size_t count, TaggedCall call) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const std::size_t slot = kSlotOffset + (signal.next_launch() & 1) * slot_stride;
  const BlockShare share = block_share<T>(count);
  block_copy<T, kVector>(input, reinterpret_cast<T*>(signal.mine() + slot), share.begin, share.end);
  if (!signal.barrier(&failed, call, true)) return;
  // Element i of every rank's slot.
  const auto slots_at = [&signal, slot](std::size_t i) {
    return [&signal, slot, i](int r) { return reinterpret_cast<const T*>(signal.peers.at(r) + slot) + i; };
  };
  block_for<T, kVector>(
      share.begin, share.end, [&](std::size_t i) { store_pack(output + i, sum_pack<T, N>(slots_at(i))); },
      [&](std::size_t i) { output[i] = sum_element<T, N>(slots_at(i)); });
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    wire_pull_kernel(__grid_constant__ const Signal<N> signal, std::size_t slot_stride, const T* input, T* output,
                     std::size_t count, wire::Wire format, TaggedCall call) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const std::size_t slot = kSlotOffset + (signal.next_launch() & 1) * slot_stride;
  const BlockShare share = wire_share(count);
  encode_range(input, share.begin, share.end, count, signal.mine() + slot, format, threadIdx.x, blockDim.x);
  if (!signal.barrier(&failed, call, true)) return;
  reduce_encoded<T, N>([&](int r) { return encoded_at(signal.peers.at(r) + slot, count); }, share.begin, share.end,
                       format, threadIdx.x, blockDim.x, [&](std::size_t i, T value) { output[i] = value; });
}

// all_reduce_rms_norm, pulled: block b stages rows b, b + grid, ..., meets its peers once and
// sums, adds and normalizes each of those rows from every rank's slot.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    norm_pull_kernel(__grid_constant__ const Signal<N> signal, std::size_t slot_stride, NormArgs<T> args,
                     TaggedCall call) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const std::size_t slot = kSlotOffset + (signal.next_launch() & 1) * slot_stride;
  const std::size_t hidden = args.hidden;
  for (std::size_t row = blockIdx.x; row < args.rows; row += gridDim.x)
    block_copy<T, true>(args.input, reinterpret_cast<T*>(signal.mine() + slot), row * hidden, (row + 1) * hidden);
  if (!signal.barrier(&failed, call, true)) return;
  for (std::size_t row = blockIdx.x; row < args.rows; row += gridDim.x) {
    const std::size_t base = row * hidden;
    const auto summed = [&](std::size_t i) {
      return summed_chunk<T, N>([&](int r) { return reinterpret_cast<const T*>(signal.peers.at(r) + slot) + base; }, i);
    };
    add_rms_norm_row<T, true>(summed, args.residual + base, args.weight, args.out + base, args.residual_out + base,
                              hidden, args.eps, KeepNothing{});
  }
}

}  // namespace

void oneshot_all_reduce_rms_norm(const GroupView& group, const norm::Rows& rows, DType dtype, TaggedCall call,
                                 std::uint64_t timeout_ns, cudaStream_t stream) {
  // A block per row up to the grid's limit: the grid follows from the shape alone.
  const int blocks = int(std::clamp<std::size_t>(rows.rows, 1, std::size_t(group.max_blocks)));
  for_instance<DeviceElements>(group.world_size, dtype, [&](auto world, auto element) {
    constexpr int N = decltype(world)::value;
    using T = typename decltype(element)::type;
    norm_pull_kernel<T, N><<<blocks, kThreads, 0, stream>>>(signal_of<N>(group, timeout_ns),
                                                           slot_stride(group.capacity_bytes), typed<T>(rows), call);
    NODECOMM_CUDA(cudaGetLastError());
  });
}

// The push variant while its lines fit a part and every thread of the grid carries at most one: past
// that the doubled traffic costs more than the round trip it saves (docs/bench-gpu.md, "The
// constants in the kernels").
bool oneshot_pushes(const GroupView& group, std::size_t nbytes) {
  const std::size_t lines = (nbytes + 7) / 8;
  return lines * sizeof(PushLine) <= push_part_bytes(group) && lines <= std::size_t(group.max_blocks) * kThreads;
}

void oneshot_all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                        DType dtype, wire::Wire format, TaggedCall call, std::uint64_t timeout_ns,
                        cudaStream_t stream) {
  // Grids follow from the count alone, so every rank that agrees on the call launches the same one.
  const bool compressed = format != wire::Wire::kLossless;
  const bool pushed = !compressed && oneshot_pushes(group, count * dtype_bytes(dtype));
  for_instance<DeviceElements>(group.world_size, dtype, [&](auto world, auto element) {
    constexpr int N = decltype(world)::value;
    using T = typename decltype(element)::type;
    const Signal<N> signal = signal_of<N>(group, timeout_ns);
    const auto* in = reinterpret_cast<const T*>(input);
    auto* out = reinterpret_cast<T*>(output);
    if (compressed) {
      const int blocks = int(std::clamp<std::size_t>((count + kThreads * kQuad - 1) / (kThreads * kQuad), 1,
                                                     std::size_t(group.max_blocks)));
      wire_pull_kernel<T, N>
          <<<blocks, kThreads, 0, stream>>>(signal, slot_stride(group.capacity_bytes), in, out, count, format, call);
    } else if (pushed) {
      // A thread per line: oneshot_pushes holds the lines to what max_blocks grids carry.
      const std::size_t lines = (count * sizeof(T) + 7) / 8;
      const int threads = lines <= std::size_t(group.max_blocks) * kPushThreads ? kPushThreads : kThreads;
      const int blocks = int(std::max<std::size_t>((lines + threads - 1) / threads, 1));
      push_kernel<T, N><<<blocks, threads, 0, stream>>>(signal, in, out, count, call);
    } else {
      const std::size_t wanted = (count + kThreads * 4 - 1) / (kThreads * 4);
      const int blocks = int(std::clamp<std::size_t>(wanted, 1, std::size_t(group.max_blocks)));
      const auto kernel = aligned(in) && aligned(out) ? pull_kernel<T, N, true> : pull_kernel<T, N, false>;
      kernel<<<blocks, kThreads, 0, stream>>>(signal, slot_stride(group.capacity_bytes), in, out, count, call);
    }
    NODECOMM_CUDA(cudaGetLastError());
  });
}

int oneshot_blocks_per_sm() {
  int per_sm = 1 << 30;
  for_every_instance<DeviceElements>([&](auto world, auto element) {
    constexpr int N = decltype(world)::value;
    using T = typename decltype(element)::type;
    per_sm = std::min({per_sm, blocks_per_sm(push_kernel<T, N>, kThreads), blocks_per_sm(pull_kernel<T, N, true>, kThreads),
                       blocks_per_sm(pull_kernel<T, N, false>, kThreads), blocks_per_sm(wire_pull_kernel<T, N>, kThreads),
                       blocks_per_sm(norm_pull_kernel<T, N>, kThreads)});
  });
  return per_sm;
}

}  // namespace nodecomm::cuda
