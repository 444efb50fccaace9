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
// launch, and with it every read of that slot, has completed.
//
// Oneshot payloads that fit the push slots skip the barrier and every read across the fabric:
// each rank writes its input, 4 bytes beside a flag in every 8-byte word, into its part of every
// peer's push slot, and each rank waits for those words in its own memory. A reader clears every
// line it took, so a line holds either nothing or this launch's words: the launch that next writes
// it, two launches on, starts only after every peer's launch between has started, which a peer
// does once it has finished reading this one. The copy paths (dma, all_gather) address fixed slots,
// since copies captured in a graph keep their addresses: a barrier before staging and one after
// the last read fence them off from whatever runs before and after. Copies run whatever a kernel
// before them found, so the copy paths copy peers' data into this rank's slot 1 and a kernel
// moves it to the output only if no barrier of this rank gave up (layout.h).
//
// Agreement (../agreement.h): every barrier's arrival word carries a digest of the call the rank
// is in beside its epoch (sync.cuh), and every pushed line a digest of the call and the launch in
// its flags, so ranks compare calls with what they exchange anyway, at no store more. Ranks in
// different kernels for one launch (one pushes, another meets at barriers) never see each other's
// arrivals; their waits look, once a poll interval, for the other kind's: a pushed line where a
// barrier was expected, a barrier where lines were. A rank that finds a mismatch, or that a
// peer's mismatch stops, records its own call and the group is aborted before anything is written
// to an output (a kernel cannot raise; the host's next call does).
// Only the kernel paths count launches (the copy paths address fixed slots), so the ranks' launch
// numbers, and with them the slots, stay equal as long as their calls do; a copy path's waits look
// for a pushing peer's lines at the launch that peer is in, one past the count.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../agreement.h"
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

// One 16-byte line of a push slot: 8 payload bytes, each 4 beside the launch's flag. 8-byte stores
// arrive whole and 16-byte ones may not, so a reader that sees both flags has both halves.
struct alignas(16) PushLine {
  std::uint32_t low, low_flag, high, high_flag;
};

__device__ __forceinline__ void store_line(PushLine* to, const PushLine& line) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(to), "r"(line.low), "r"(line.low_flag),
               "r"(line.high), "r"(line.high_flag)
               : "memory");
}

__device__ __forceinline__ PushLine load_line(const PushLine* from) {
  PushLine line;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(line.low), "=r"(line.low_flag), "=r"(line.high), "=r"(line.high_flag)
               : "l"(from)
               : "memory");
  return line;
}

// Where the push form of oneshot puts its lines: `stride` bytes per slot from `at`, two slots by
// launch parity, `part` bytes of each for every source rank.
struct PushSlots {
  std::size_t at, stride, part;
};

__device__ __forceinline__ PushLine* pushed_lines(std::uint8_t* buffer, const PushSlots& push, std::uint64_t launch,
                                                  int source) {
  return reinterpret_cast<PushLine*>(buffer + push.at + (launch & 1) * push.stride + std::size_t(source) * push.part);
}

// The flag of every line a launch pushes: never 0, which a cleared line holds, and different for
// another call (a 31-bit digest, so two calls go unnoticed with odds of 2^-31 per launch).
__device__ __forceinline__ std::uint32_t push_flag(std::uint64_t launch, std::uint64_t call) {
  return call_digest(call ^ (launch * 0x9E3779B97F4A7C15ull)) | 1;
}

__device__ __forceinline__ std::size_t flag_offset(int block, int rank) {
  return kFlagOffset + (std::size_t(block) * kMaxRanks + rank) * 8;
}

// A barrier kernel's evidence that `peer` pushes in this launch instead: its first line is there.
// (Lines are cleared as they are read, so one at this launch's parity is this launch's.)
struct PeerPushes {
  std::uint8_t* mine;
  PushSlots push;
  std::uint64_t launch;
  int peer;
  __device__ bool operator()() const {
    const PushLine line = load_line(pushed_lines(mine, push, launch, peer));
    return (line.low_flag | line.high_flag) != 0;
  }
};

// Whether a barrier of this rank failed (layout.h): the copy paths then write no output.
__device__ __forceinline__ bool gave_up(const std::uint8_t* mine) {
  return load_volatile(reinterpret_cast<const std::uint64_t*>(mine + kGaveUpOffset)) != 0;
}

// Block-pair barrier among block b of every rank, for the call `call` of launch `launch`. Returns
// false (after recording why) on a timeout, an abort or a peer that arrived with another call;
// every thread of the block gets the same answer.
template <int N>
__device__ bool block_pair_barrier(const Peers<N>& peers, std::uint8_t* control, int rank, std::uint64_t timeout_ns,
                                   int* failed, std::uint64_t call, std::uint64_t launch, const PushSlots& push) {
  std::uint8_t* mine = peers.rank[rank];
  const int block = blockIdx.x;
  __shared__ std::uint64_t epoch_shared;
  // One release per signalling thread covers the whole block's writes: bar.sync orders them
  // before it and release is cumulative. A system fence in every thread costs more with each block.
  __syncthreads();
  if (threadIdx.x == 0) {
    // A rank that gave up arrives nowhere any more: a peer still waiting at the barrier it left
    // must not take a later launch's arrival for one that agreed with it. Loaded before the
    // counter, so that the two loads overlap.
    const bool stopped = gave_up(mine);
    std::uint64_t* barriers = word(mine, kCounterOffset + std::size_t(block) * 16 + 8);
    epoch_shared = *barriers + 1;
    *barriers = epoch_shared;
    if (stopped) *failed = 1;
  }
  __syncthreads();
  if (*failed) return false;
  const std::uint64_t epoch = epoch_shared;
  if (threadIdx.x < N) {
    const int peer = threadIdx.x;
    store_release(word(peers.rank[peer], flag_offset(block, rank)), arrival(epoch, call));
    const std::uint64_t* flag = word(mine, flag_offset(block, peer));
    if (!wait_arrival(flag, epoch, call, control, rank, peer, timeout_ns, PeerPushes{mine, push, launch, peer})) {
      *failed = 1;
      store_volatile(word(mine, kGaveUpOffset), 1);
    }
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

// This launch's number, the same in every block: each block advances its own counter and block 0
// those of the blocks this grid lacks, so every block of every launch picks the same slot whatever
// the grids before it were (with per-block parities a block could overwrite a region that another
// block index of the previous launch still has peers reading). Every thread calls it; it syncs.
__device__ std::uint64_t next_launch(std::uint8_t* mine) {
  __shared__ std::uint64_t launch;
  if (threadIdx.x == 0) {
    std::uint64_t* launches = word(mine, kCounterOffset + std::size_t(blockIdx.x) * 16);
    launch = *launches + 1;
    *launches = launch;
  }
  if (blockIdx.x == 0) {
    for (unsigned b = gridDim.x + threadIdx.x; b < kMaxBlocks; b += blockDim.x) ++*word(mine, kCounterOffset + b * 16);
  }
  __syncthreads();
  return launch;
}

template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads)
    all_reduce_kernel(Peers<N> peers, std::uint8_t* control, int rank, std::size_t slot_stride, PushSlots push,
                      const T* input, T* output, std::size_t count, Algorithm algorithm, std::uint64_t call,
                      std::uint64_t timeout_ns) {
  __shared__ int failed;
  std::uint8_t* mine = peers.rank[rank];
  if (threadIdx.x == 0) failed = 0;
  const std::uint64_t launch = next_launch(mine);
  const std::size_t slot = kSlotOffset + (launch & 1) * slot_stride;

  // This block's share of the elements, in whole packs and 64-bit offsets; the same on every rank
  // whether or not its pointers allow packed access.
  const std::size_t per = round_to_packs<T>((count + gridDim.x - 1) / gridDim.x);
  const std::size_t begin = min(count, std::size_t(blockIdx.x) * per);
  const std::size_t end = min(count, begin + per);
  T* staged = reinterpret_cast<T*>(mine + slot);
  block_for<T, kVector>(
      begin, end, [&](std::size_t i) { store_pack(staged + i, load_pack(input + i)); },
      [&](std::size_t i) { staged[i] = input[i]; });
  if (!block_pair_barrier(peers, control, rank, timeout_ns, &failed, call, launch, push)) return;

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
  if (!block_pair_barrier(peers, control, rank, timeout_ns, &failed, call, launch, push)) return;
  for (int r = 0; r < N; ++r) {
    if (r == rank) continue;
    const std::size_t lo = min(end, begin + std::size_t(r) * segment), hi = min(end, lo + segment);
    const T* owner = reinterpret_cast<const T*>(peers.rank[r] + slot);
    block_for<T, kVector>(
        lo, hi, [&](std::size_t i) { store_pack(output + i, load_pack(owner + i)); },
        [&](std::size_t i) { output[i] = owner[i]; });
  }
}

// Line `line` of the input: elements [line * per_line, ...) as they are, bit for bit, zero past count.
template <typename T>
__device__ __forceinline__ PushLine line_of(const T* input, std::size_t line, std::size_t count, std::uint32_t flag,
                                            bool whole_words) {
  constexpr int kPerLine = 8 / sizeof(T);
  std::uint32_t words[2] = {0, 0};
  if (whole_words && (line + 1) * kPerLine <= count) {
    const uint2 both = reinterpret_cast<const uint2*>(input)[line];
    words[0] = both.x, words[1] = both.y;
  } else {
    using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>;
    const Bits* bits = reinterpret_cast<const Bits*>(input);
#pragma unroll
    for (int j = 0; j < kPerLine; ++j) {
      const std::size_t i = line * kPerLine + j;
      if (i < count) words[j * sizeof(T) / 4] |= std::uint32_t(bits[i]) << ((8 * sizeof(T) * j) % 32);
    }
  }
  return PushLine{words[0], flag, words[1], flag};
}

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

// Oneshot by push (see the top of this file): part r of a push slot holds rank r's lines. Thread
// t of the grid sends and then sums the lines t, t + threads, ... on every rank, so block b only
// waits for what block b of each peer sends.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    oneshot_push_kernel(Peers<N> peers, std::uint8_t* control, int rank, PushSlots push, const T* input, T* output,
                        std::size_t count, std::uint64_t call, std::uint64_t timeout_ns) {
  constexpr int kPerLine = 8 / sizeof(T);
  std::uint8_t* mine = peers.rank[rank];
  const bool stopped = gave_up(mine);  // loaded while the launch is counted
  const std::uint64_t launch = next_launch(mine);
  if (stopped) return;  // as at a barrier: nothing of this launch reaches the peers
  const std::uint32_t flag = push_flag(launch, call);
  const auto part_of = [&](int owner, int source) { return pushed_lines(peers.rank[owner], push, launch, source); };
  const bool whole_words = reinterpret_cast<std::uintptr_t>(input) % 8 == 0;
  const std::size_t lines = (count + kPerLine - 1) / kPerLine;
  const std::size_t first = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t threads = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t line = first; line < lines; line += threads) {
    const PushLine mine = line_of(input, line, count, flag, whole_words);
#pragma unroll
    for (int p = 0; p < N; ++p) {
      if (p != rank) store_line(part_of(p, rank) + line, mine);
    }
  }
  for (std::size_t line = first; line < lines; line += threads) {
    PushLine got[N];
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (r == rank) {
        got[r] = line_of(input, line, count, flag, whole_words);
        continue;
      }
      PushLine* at = part_of(rank, r) + line;
      const auto arrived = [&] {
        got[r] = load_line(at);
        return got[r].low_flag == flag && got[r].high_flag == flag;
      };
      if (!wait_until(arrived, launch, control, rank, r, timeout_ns, call, PeerElsewhere{mine, at, flag, r})) return;
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
}

// The launch a peer that pushes instead of meeting at a copy path's barrier is in (the copy paths
// count none): the one after the last counted.
__device__ __forceinline__ std::uint64_t pushing_launch(std::uint8_t* mine) {
  return load_volatile(word(mine, kCounterOffset)) + 1;
}

// One block-pair barrier on block 0's counters: the signal between the copy paths' steps.
template <int N>
__global__ void signal_kernel(Peers<N> peers, std::uint8_t* control, int rank, PushSlots push, std::uint64_t call,
                              std::uint64_t timeout_ns) {
  __shared__ int failed;
  std::uint8_t* mine = peers.rank[rank];
  if (threadIdx.x == 0) failed = 0;
  block_pair_barrier(peers, control, rank, timeout_ns, &failed, call, pushing_launch(mine), push);
}

// dma: elements [lo, lo + n) of this rank's segment [own_begin, ...): this rank's values are in
// slot 0, peer p's were pulled into slot 1 at (p < rank ? p : p - 1) * segment. The sum goes to
// slot 0, where peers gather it from, and to the output.
template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads) dma_reduce_kernel(Peers<N> peers, int rank, std::size_t slot_stride,
                                                              std::size_t own_begin, std::size_t lo, std::size_t n,
                                                              std::size_t segment, T* output) {
  std::uint8_t* mine = peers.rank[rank];
  // Checked at the stores, so that the word's load overlaps the sums' loads.
  const bool stopped = gave_up(mine);
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
__global__ void __launch_bounds__(kThreads) copy_out_kernel(Peers<N> peers, std::uint8_t* control, int rank,
                                                            PushSlots push, std::uint64_t call, Pieces pieces,
                                                            std::uint64_t timeout_ns) {
  __shared__ int failed;
  std::uint8_t* mine = peers.rank[rank];
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) failed = 0;
    block_pair_barrier(peers, control, rank, timeout_ns, &failed, call, pushing_launch(mine), push);
    return;
  }
  if (gave_up(mine)) return;
  const std::size_t thread = std::size_t(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  const std::size_t threads = std::size_t(gridDim.x - 1) * blockDim.x;
  for (int p = 0; p < pieces.count; ++p) copy_bytes(pieces.from[p], pieces.to[p], pieces.bytes[p], thread, threads);
}

template <int N>
Peers<N> peers_of(const GroupView& group) {
  Peers<N> peers;
  for (int r = 0; r < N; ++r) peers.rank[r] = reinterpret_cast<std::uint8_t*>(group.buffers[r]);
  return peers;
}

// Bytes of each rank's part of a push slot.
std::size_t push_part_bytes(const GroupView& group) {
  return push_slot_bytes(group.slot_bytes) / std::size_t(group.world_size) / sizeof(PushLine) * sizeof(PushLine);
}

PushSlots push_slots(const GroupView& group) {
  return PushSlots{push_offset(group.slot_bytes), push_slot_bytes(group.slot_bytes), push_part_bytes(group)};
}

// One barrier of `call`.
template <int N>
void signal(const GroupView& group, const Peers<N>& peers, std::uint64_t call, std::uint64_t timeout,
            cudaStream_t stream) {
  signal_kernel<N><<<1, kSignalThreads, 0, stream>>>(peers, reinterpret_cast<std::uint8_t*>(group.control),
                                                     group.rank, push_slots(group), call, timeout);
  NODECOMM_CUDA(cudaGetLastError());
}

// The last barrier of `call`, and the pieces copied out unless this rank gave up.
template <int N>
void copy_out(const GroupView& group, const Peers<N>& peers, std::uint64_t call, const Pieces& pieces,
              std::uint64_t timeout, cudaStream_t stream) {
  std::size_t total = 0;
  for (int p = 0; p < pieces.count; ++p) total += pieces.bytes[p];
  const std::size_t steps = (total + kCopyStepBytes - 1) / kCopyStepBytes;
  // Only block 0 waits, so the grid need not be resident: four blocks per SM keep more loads in flight.
  const int copiers = int(std::clamp<std::size_t>((steps + kThreads - 1) / kThreads, 1, 4 * kReduceMaxBlocks));
  copy_out_kernel<N><<<1 + copiers, kThreads, 0, stream>>>(peers, reinterpret_cast<std::uint8_t*>(group.control),
                                                      group.rank, push_slots(group), call, pieces, timeout);
  NODECOMM_CUDA(cudaGetLastError());
}

void copy(void* to, const void* from, std::size_t nbytes, cudaStream_t stream) {
  if (nbytes != 0) NODECOMM_CUDA(cudaMemcpyAsync(to, from, nbytes, cudaMemcpyDeviceToDevice, stream));
}

// Packed access needs 16-byte aligned caller pointers; the buffers' slots always are.
bool aligned(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

// Oneshot pushes while its lines fit a part and every thread of the grid carries at most one:
// past that the doubled traffic costs more than the round trip it saves (2x H200, world 2,
// 512 KiB: 6.2 us pushed, 5.7 us pulled).
template <typename T>
bool fits_push(const GroupView& group, std::size_t count) {
  const std::size_t lines = (count * sizeof(T) + 7) / 8;
  return lines * sizeof(PushLine) <= push_part_bytes(group) && lines <= std::size_t(group.max_blocks) * kThreads;
}

template <typename T, int N>
void kernel_all_reduce(const GroupView& group, const T* input, T* output, std::size_t count, Algorithm algorithm,
                       std::uint64_t call, std::uint64_t timeout, cudaStream_t stream) {
  auto* control = reinterpret_cast<std::uint8_t*>(group.control);
  // Grids follow from the count alone, so every rank that agrees on the call launches the same one.
  if (algorithm == Algorithm::kOneshot && fits_push<T>(group, count)) {
    const std::size_t lines = (count * sizeof(T) + 7) / 8;
    const int blocks = int(std::clamp<std::size_t>((lines + kThreads - 1) / kThreads, 1, std::size_t(group.max_blocks)));
    oneshot_push_kernel<T, N><<<blocks, kThreads, 0, stream>>>(peers_of<N>(group), control, group.rank,
                                                               push_slots(group), input, output, count, call, timeout);
    NODECOMM_CUDA(cudaGetLastError());
    return;
  }
  const std::size_t wanted = (count + kThreads * 4 - 1) / (kThreads * 4);
  const int blocks = int(std::clamp<std::size_t>(wanted, 1, std::size_t(group.max_blocks)));
  const std::size_t stride = slot_stride(group.slot_bytes);
  const auto kernel = aligned(input) && aligned(output) ? all_reduce_kernel<T, N, true> : all_reduce_kernel<T, N, false>;
  kernel<<<blocks, kThreads, 0, stream>>>(peers_of<N>(group), control, group.rank, stride, push_slots(group), input,
                                          output, count, algorithm, call, timeout);
  NODECOMM_CUDA(cudaGetLastError());
}

template <typename T, int N>
void dma_all_reduce(const GroupView& group, const T* input, T* output, std::size_t count, std::uint64_t call,
                    std::uint64_t timeout, cudaStream_t stream, const CopyPipeline& pipeline) {
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

  // The first signal also compares the ranks' calls, before anything is copied.
  signal<N>(group, peers, call, timeout, stream);  // peers are done with whatever read our slots before
  copy(staged, input, count * sizeof(T), stream);
  signal<N>(group, peers, call, timeout, stream);  // every rank has staged
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
  signal<N>(group, peers, call, timeout, stream);  // every segment is reduced
  // Peers' segments come to slot 1, where the pulled ones were, and go out from there.
  Pieces pieces{};
  for (int p = 0; p < N; ++p) {
    if (p == rank) continue;
    const std::size_t lo = begin_of(p), hi = end_of(p);
    T* gathered = pulled + std::size_t(p < rank ? p : p - 1) * segment;
    copy(gathered, reinterpret_cast<const T*>(peers.rank[p] + kSlotOffset) + lo, (hi - lo) * sizeof(T), stream);
    pieces.from[pieces.count] = reinterpret_cast<const std::uint8_t*>(gathered);
    pieces.to[pieces.count] = reinterpret_cast<std::uint8_t*>(output + lo);
    pieces.bytes[pieces.count++] = (hi - lo) * sizeof(T);
  }
  copy_out<N>(group, peers, call, pieces, timeout, stream);  // nobody reads our slots any more
}

template <typename T, int N>
void all_reduce_typed(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                      Algorithm algorithm, std::uint64_t call, std::uint64_t timeout, cudaStream_t stream,
                      const CopyPipeline& pipeline) {
  const auto* in = reinterpret_cast<const T*>(input);
  auto* out = reinterpret_cast<T*>(output);
  if (algorithm == Algorithm::kDma) return dma_all_reduce<T, N>(group, in, out, count, call, timeout, stream, pipeline);
  kernel_all_reduce<T, N>(group, in, out, count, algorithm, call, timeout, stream);
}

void check_group(const GroupView& group) {
  NODECOMM_CHECK(group.rank >= 0 && group.rank < group.world_size, "rank out of range");
  NODECOMM_CHECK(group.control != 0, "control segment address is null");
}

}  // namespace

void all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                std::size_t call_count, int dtype, Algorithm algorithm, double timeout_s, cudaStream_t stream,
                const CopyPipeline& pipeline) {
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
  NODECOMM_CHECK(count <= call_count, "a piece of " + std::to_string(count) + " elements of a call of " +
                                          std::to_string(call_count));
  const std::uint64_t call = Call{Collective::kAllReduce, call_count, dtype, int(algorithm)}.packed();
  const std::uint64_t timeout = timeout_ns(timeout_s);
  for_world(group.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    if (count == 0) return signal<N>(group, peers_of<N>(group), call, timeout, stream);  // the calls still meet
    switch (dtype) {
      case 1: return all_reduce_typed<float, N>(group, input, output, count, algorithm, call, timeout, stream, pipeline);
      case 2: return all_reduce_typed<__half, N>(group, input, output, count, algorithm, call, timeout, stream, pipeline);
      default:
        return all_reduce_typed<__nv_bfloat16, N>(group, input, output, count, algorithm, call, timeout, stream,
                                                  pipeline);
    }
  });
}

void all_gather(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t nbytes,
                std::size_t output_stride, double timeout_s, cudaStream_t stream) {
  check_group(group);
  NODECOMM_CHECK(nbytes * std::size_t(group.world_size) <= group.slot_bytes,
                 "payload of " + std::to_string(nbytes) + " bytes from each of " + std::to_string(group.world_size) +
                     " ranks exceeds the slot of " + std::to_string(group.slot_bytes));
  NODECOMM_CHECK(nbytes <= output_stride, "a piece of " + std::to_string(nbytes) + " bytes past the output stride of " +
                                              std::to_string(output_stride));
  // The ranks compare the whole call's bytes, which the stride is.
  const std::uint64_t call = Call{Collective::kAllGather, output_stride}.packed();
  const std::uint64_t timeout = timeout_ns(timeout_s);
  for_world(group.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    const Peers<N> peers = peers_of<N>(group);
    signal<N>(group, peers, call, timeout, stream);
    if (nbytes == 0) return;  // the calls met
    std::uint8_t* gathered = peers.rank[group.rank] + kSlotOffset + slot_stride(group.slot_bytes);
    copy(peers.rank[group.rank] + kSlotOffset, reinterpret_cast<const void*>(input), nbytes, stream);
    signal<N>(group, peers, call, timeout, stream);
    Pieces pieces{};
    for (int p = 0; p < N; ++p) {
      copy(gathered + std::size_t(p) * nbytes, peers.rank[p] + kSlotOffset, nbytes, stream);
      pieces.from[p] = gathered + std::size_t(p) * nbytes;
      pieces.to[p] = reinterpret_cast<std::uint8_t*>(output) + std::size_t(p) * output_stride;
      pieces.bytes[p] = nbytes;
    }
    pieces.count = N;
    copy_out<N>(group, peers, call, pieces, timeout, stream);
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
                         blocks_per_sm(all_reduce_kernel<__nv_bfloat16, N, false>, kThreads),
                         blocks_per_sm(oneshot_push_kernel<float, N>, kThreads),
                         blocks_per_sm(oneshot_push_kernel<__half, N>, kThreads),
                         blocks_per_sm(oneshot_push_kernel<__nv_bfloat16, N>, kThreads)});
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
    signal<N>(group, peers_of<N>(group), Call{Collective::kBarrier}.packed(), timeout, stream);
  });
}

}  // namespace nodecomm::cuda
