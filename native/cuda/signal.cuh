// signal.cuh — the device signal every transport kernel meets its peers with (layout.h's counters
// and flags), over sync.cuh's waits.
//
// Barriers are block pairs: block b of rank p stores ++barriers[b] (its own counter, in device
// memory) with the digest of its call into flags[b][p] of every rank's buffer (release, system
// scope) and waits until flags[b][q] holds that epoch for every q (acquire), then compares the
// digests. Block b only reads what block b of each peer wrote, so block pairs suffice. Waits are
// bounded by the timeout and the group's abort word; a rank that gives up records why, aborts the
// group, arrives nowhere any more and sets every rank's stop word (layout.h), so every peer stops
// too, at once, and none takes a later arrival for an agreeing one.
//
// The kernel paths pick their slot from ++launches[b], so consecutive launches and graph replays
// alternate slots without host patching; every launch advances all kMaxBlocks counters, so all
// blocks agree on the slot. Only the kernel paths count launches (the copy paths address fixed
// slots), so the ranks' launch numbers stay equal as long as their calls do.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives.h"
#include "layout.h"
#include "push_slots.cuh"
#include "sync.cuh"

namespace nodecomm::cuda {

// Every rank's buffer, as mapped in this process.
template <int N>
struct Peers {
  std::uint8_t* rank[N];

  // Rank r's buffer, selected in registers: indexing a kernel parameter's array at run time would
  // copy the whole parameter to local memory and every access after would go through it
  // (docs/bench-gpu.md, "The constants in the kernels").
  __device__ __forceinline__ std::uint8_t* at(int r) const {
    std::uint8_t* buffer = rank[0];
#pragma unroll
    for (int p = 1; p < N; ++p) {
      if (p == r) buffer = rank[p];
    }
    return buffer;
  }
};

template <int N>
Peers<N> peers_of(const std::uintptr_t* buffers) {
  Peers<N> peers;
  for (int r = 0; r < N; ++r) peers.rank[r] = reinterpret_cast<std::uint8_t*>(buffers[r]);
  return peers;
}

__device__ __forceinline__ std::size_t flag_offset(int block, int rank) {
  return kFlagOffset + (std::size_t(block) * kMaxRanks + rank) * 8;
}

// A barrier's evidence that `peer` pushes in this launch instead: its first line is there. The
// pushing peer's launch is this block's count, one more where this rank's call counts none (the
// copy paths); it is read at the look, off the barrier's path. (Lines are cleared as they are
// read, so one at the launch's parity is that launch's.)
struct PeerPushes {
  std::uint8_t* mine;
  PushSlots push;
  bool counted;
  int peer;
  __device__ bool operator()() const {
    const std::uint64_t launch =
        load_volatile(word(mine, kCounterOffset + std::size_t(blockIdx.x) * 16)) + (counted ? 0 : 1);
    const PushLine line = load_line(pushed_lines(mine, push, launch, peer));
    return (line.low_flag | line.high_flag) != 0;
  }
};

// One rank's signal in a group of N: what a kernel needs to meet its peers and to stop with them.
template <int N>
struct Signal {
  Peers<N> peers;
  std::uint8_t* control;  // the group's control segment (../control.h), as the device addresses it
  int rank;
  std::uint64_t timeout_ns;
  PushSlots push;

  __device__ __forceinline__ std::uint8_t* mine() const { return peers.at(rank); }

  __device__ __forceinline__ const std::uint64_t* stop_word() const {
    return reinterpret_cast<const std::uint64_t*>(mine() + kStopAskedOffset);
  }
  // Whether a wait of this rank failed (layout.h): the copy paths then write no output.
  __device__ __forceinline__ bool gave_up() const { return load_volatile(word(mine(), kGaveUpOffset)) != 0; }
  // Whether this rank must not start anything more: it gave up, or was asked to stop. Both words
  // in one load: read one after the other, the second waited for the first, and every kernel start
  // and barrier paid one more round trip to memory (docs/bench-gpu.md, "The constants in the kernels").
  __device__ __forceinline__ bool stopped() const {
    std::uint64_t gave, asked;
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
                 : "=l"(gave), "=l"(asked)
                 : "l"(word(mine(), kGaveUpOffset))
                 : "memory");
    return (gave | asked) != 0;
  }
  // Sticky: every kernel of this rank queued after a failed wait returns at its start or first
  // barrier, writing nothing, and every rank's running waits (this one's other blocks too) end at
  // their next clock check instead of at their next abort poll. Called after the failure is on
  // record; out of line like the other stop paths (sync.cuh's fail).
  __device__ __noinline__ void give_up() const {
    store_volatile(word(mine(), kGaveUpOffset), kGaveUp);
#pragma unroll
    for (int p = 0; p < N; ++p) store_volatile(word(peers.at(p), kStopAskedOffset), 1 + std::uint64_t(rank));
    __threadfence_system();
  }
  // A kernel that finds this rank asked to stop but not yet given up puts the reason on record,
  // as a wait that saw the abort would (a mismatch needs every rank's call), and gives up.
  __device__ __noinline__ void note_asked(std::uint64_t epoch, std::uint64_t call) const {
    if (gave_up()) return;
    const std::uint64_t asker = load_volatile(stop_word()) - 1;
    const Stop found = look_for_stop(control, NoEvidence{}, false, false);
    record_stop(found == Stop::kNone ? Stop::kAborted : found, control, rank, asker < N ? int(asker) : rank, epoch,
                call);
    store_volatile(word(mine(), kGaveUpOffset), kGaveUp);
  }

  // This launch's number, the same in every block: each block advances its own counter and block 0
  // those of the blocks this grid lacks, so every block of every launch picks the same slot
  // whatever the grids before it were (with per-block parities a block could overwrite a region
  // that another block index of the previous launch still has peers reading). The block's own
  // counter is the last thread's, a warp that advances no other: the first warp did both, one
  // round trip to memory after the other. Every thread calls it; it syncs.
  __device__ __forceinline__ std::uint64_t next_launch() const {
    __shared__ std::uint64_t launch;
    if (threadIdx.x == blockDim.x - 1) {
      std::uint64_t* launches = word(mine(), kCounterOffset + std::size_t(blockIdx.x) * 16);
      launch = *launches + 1;
      *launches = launch;
    }
    if (blockIdx.x == 0) {
      for (unsigned b = gridDim.x + threadIdx.x; b < kMaxBlocks; b += blockDim.x) {
        ++*word(mine(), kCounterOffset + b * 16);
      }
    }
    __syncthreads();
    return launch;
  }

  // Block-pair barrier among block b of every rank, for `call`; `counted`: whether this rank's
  // call counted its launch (a kernel path). False (after recording why) on a timeout, an abort
  // or a peer that arrived with another call; every thread of the block gets the same answer.
  // `failed` is the block's shared flag, 0 before the kernel's first barrier.
  __device__ __forceinline__ bool barrier(int* failed, TaggedCall call, bool counted) const {
    const int block = blockIdx.x;
    __shared__ std::uint64_t epoch_shared;
    // One release per signalling thread covers the whole block's writes: bar.sync orders them
    // before it and release is cumulative. A system fence in every thread costs more with each block.
    __syncthreads();
    if (threadIdx.x == 0) {
      // Loaded before the counter, so that the two loads overlap.
      const bool stop = stopped();
      std::uint64_t* barriers = word(mine(), kCounterOffset + std::size_t(block) * 16 + 8);
      epoch_shared = *barriers + 1;
      *barriers = epoch_shared;
      if (stop) {
        note_asked(epoch_shared, call.call);
        *failed = 1;
      }
    }
    __syncthreads();
    if (*failed) return false;
    const std::uint64_t epoch = epoch_shared;
    if (threadIdx.x < N) {
      const int peer = threadIdx.x;
      store_release(word(peers.at(peer), flag_offset(block, rank)), arrival(epoch, call));
      const std::uint64_t* flag = word(mine(), flag_offset(block, peer));
      if (!wait_arrival(flag, epoch, call, control, rank, peer, timeout_ns, PeerPushes{mine(), push, counted, peer},
                        stop_word())) {
        *failed = 1;
        give_up();
      }
    }
    __syncthreads();
    return *failed == 0;
  }
};

template <int N>
Signal<N> signal_of(const GroupView& group, std::uint64_t timeout_ns) {
  return Signal<N>{peers_of<N>(group.buffers), reinterpret_cast<std::uint8_t*>(group.control), group.rank, timeout_ns,
                   push_slots(group)};
}

}  // namespace nodecomm::cuda
