// shm.h — the CPU transport: all-reduce, all-gather and barrier among processes whose buffers
// live in host shared memory (memfd segments the daemon hands out); their layout, ordering and
// agreement: shm_layout.h.
#pragma once

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "agreement.h"
#include "control.h"
#include "errors.h"
#include "host_pack.h"
#include "numerics.h"
#include "shm_layout.h"
#include "wire.h"


namespace nodecomm::shm {

class ShmGroup {
 public:
  // buffers: each rank's buffer as mapped in this process, in rank order.
  ShmGroup(int rank, int world_size, std::vector<std::uintptr_t> buffers, std::uintptr_t control,
           std::size_t capacity_bytes)
      : rank_(rank), world_size_(world_size), buffers_(std::move(buffers)), control_(control),
        capacity_bytes_(capacity_bytes) {
    NODECOMM_CHECK(world_size >= 1 && world_size <= kMaxRanks,
                   "world_size " + std::to_string(world_size) + " is outside 1.." + std::to_string(kMaxRanks));
    NODECOMM_CHECK(rank >= 0 && rank < world_size,
                   "rank " + std::to_string(rank) + " is outside 0.." + std::to_string(world_size - 1));
    NODECOMM_CHECK(int(buffers_.size()) == world_size,
                   "expected " + std::to_string(world_size) + " buffers, got " + std::to_string(buffers_.size()));
    NODECOMM_CHECK(capacity_bytes >= kLineBytes, "capacity_bytes must be at least 64");
    NODECOMM_CHECK(control != 0, "control segment address is null");
  }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::uint64_t barrier_epoch() const { return barrier_epoch_; }
  std::uint64_t op_epoch() const { return op_epoch_; }

  // out may equal in. count elements of dtype on every rank (GroupMismatchError where they differ),
  // over the lossless wire or a compressed one (wire.h). `compared`: the call the ranks compare
  // instead of the all-reduce's own (all_reduce_rms_norm's, which carries the shape).
  void all_reduce(std::uintptr_t in, std::uintptr_t out, std::size_t count, DType dtype, Path path,
                  double timeout_s, wire::Wire format = wire::Wire::kLossless, const Call* compared = nullptr) {
    for_dtype<HostElements>(dtype, [&](auto element) {
      all_reduce_typed<typename decltype(element)::type>(in, out, count, dtype, path, timeout_s, format, compared);
    });
  }

  // out holds world_size * nbytes: rank r's input lands at out + r * nbytes. Even 0 bytes meet
  // at one barrier, where the ranks' sizes are compared.
  void all_gather(std::uintptr_t in, std::uintptr_t out, std::size_t nbytes, double timeout_s) {
    const std::size_t chunk = capacity_bytes_ / kLineBytes * kLineBytes;
    const Call call{Collective::kAllGather, nbytes};
    for (std::size_t offset = 0; offset < nbytes || offset == 0; offset += chunk) {
      const std::size_t len = std::min(chunk, nbytes - offset);
      std::uint8_t* mine = stage(reinterpret_cast<const std::uint8_t*>(in) + offset, len);
      barrier(timeout_s, call);
      const std::size_t slot = slot_offset();
      for (int r = 0; r < world_size_; ++r) {
        const std::uint8_t* src = r == rank_ ? mine : peer(r) + slot;
        std::memcpy(reinterpret_cast<std::uint8_t*>(out) + std::size_t(r) * nbytes + offset, src, len);
      }
      ++op_epoch_;
    }
  }

  // Every rank arrives, then waits for every other rank (bounded by timeout_s, honours abort),
  // and the ranks' calls are compared.
  void barrier(double timeout_s, const Call& call = Call{Collective::kBarrier}) {
    wait_all(arrive(call), timeout_s);
  }

  // The two halves of a barrier, for work that overlaps the wait: arrive() publishes this rank's
  // next epoch and its call to every peer (release: everything written before it is visible to
  // them); wait_all(epoch) returns once every peer has arrived there (acquire) with the same call.
  std::uint64_t arrive(const Call& call) {
    const std::uint64_t epoch = ++barrier_epoch_;
    const std::uint64_t packed = call.packed();
    for (int r = 0; r < world_size_; ++r) {
      auto* line = reinterpret_cast<std::uint64_t*>(peer(r) + std::size_t(rank_) * kLineBytes);
      __atomic_store_n(line + 1 + epoch % 2, packed, __ATOMIC_RELAXED);
      __atomic_store_n(line, epoch, __ATOMIC_RELEASE);
    }
    return epoch;
  }

  void wait_all(std::uint64_t epoch, double timeout_s) {
    for (int r = 0; r < world_size_; ++r) {
      if (r != rank_) wait_flag(r, epoch, timeout_s);
    }
    check_calls(epoch);
  }

 private:
  std::uint8_t* peer(int r) const { return reinterpret_cast<std::uint8_t*>(buffers_[r]); }
  std::size_t slot_offset() const { return slot_offset(op_epoch_); }
  std::size_t slot_offset(std::uint64_t epoch) const {
    return kHeaderBytes + (epoch % kNumSlots) * slot_stride(capacity_bytes_);
  }

  std::uint8_t* stage(const std::uint8_t* src, std::size_t len) {
    std::uint8_t* mine = peer(rank_) + slot_offset();
    std::memcpy(mine, src, len);
    return mine;
  }

  template <typename T>
  void all_reduce_typed(std::uintptr_t in, std::uintptr_t out, std::size_t count, DType dtype, Path path,
                        double timeout_s, wire::Wire format, const Call* compared) {
    NODECOMM_CHECK(path == Path::kOneshot || path == Path::kTwoshot,
                   "path code " + std::to_string(int(path)) + " on a host group: expected 1 (oneshot) or 2 (twoshot)");
    const T* src = reinterpret_cast<const T*>(in);
    T* dst = reinterpret_cast<T*>(out);
    const Call call = compared ? *compared : Call{Collective::kAllReduce, count, int(dtype), int(path), int(format)};
    if (format != wire::Wire::kLossless) {
      // A chunk's codes and scales, and (twoshot) its reduced segment in T, share a slot.
      const Chunking chunks{count, wire::elements_per_slot(std::min(capacity_bytes_, kPipelineChunkBytes), sizeof(T))};
      NODECOMM_ASSERT(chunks.chunk > 0,
                      "a slot of " + std::to_string(capacity_bytes_) + " bytes holds no encoded chunk");
      return reduce_over_wire(src, dst, chunks, path, format, call, timeout_s);
    }
    const Chunking chunks{count, std::min(capacity_bytes_, kPipelineChunkBytes) / sizeof(T) / 16 * 16};
    if (path == Path::kOneshot) {
      oneshot(src, dst, chunks, call, timeout_s);
    } else {
      twoshot(src, dst, chunks, call, timeout_s);
    }
  }

  struct Chunking {
    std::size_t count, chunk;
    std::size_t size() const { return (count + chunk - 1) / chunk; }
    std::size_t begin(std::size_t k) const { return k * chunk; }
    std::size_t len(std::size_t k) const { return std::min(chunk, count - k * chunk); }
  };

  // Per chunk: stage it whole, barrier, sum every rank's slot.
  template <typename T>
  void oneshot(const T* src, T* dst, const Chunking& chunks, const Call& call, double timeout_s) {
    const bool stream = chunks.count * sizeof(T) >= kStreamOutputBytes;
    if (chunks.size() == 0) return barrier(timeout_s, call);  // nothing to move, but the calls meet
    for (std::size_t k = 0; k < chunks.size(); ++k, ++op_epoch_) {
      const std::size_t begin = chunks.begin(k), len = chunks.len(k);
      stage(reinterpret_cast<const std::uint8_t*>(src + begin), len * sizeof(T));
      barrier(timeout_s, call);
      const std::uint8_t* slots[kMaxRanks];
      for (int r = 0; r < world_size_; ++r) slots[r] = peer(r) + slot_offset();
      reduce_range<T>(slots, world_size_, dst + begin, 0, len, nullptr, stream);
    }
    if (stream) store_fence();
  }

  // Reduce-scatter then all-gather, per chunk. Rank r owns segment r of each chunk: it reduces
  // it from its own input and the peers' staged copies, writes the result to dst and to its slot,
  // and after a second barrier copies the other segments' results from their owners' slots. Only
  // the segments that peers read are staged. Chunk k+1 is staged while waiting at chunk k's
  // second barrier: its slot was last read in chunk k-1's gather (or the previous operation's),
  // which every peer finished before arriving at chunk k's first barrier.
  template <typename T>
  void twoshot(const T* src, T* dst, const Chunking& chunks, const Call& call, double timeout_s) {
    if (chunks.size() == 0) return barrier(timeout_s, call);  // nothing to move, but the calls meet
    const bool stream = chunks.count * sizeof(T) >= kStreamOutputBytes;
    stage_peer_segments(src, chunks, 0);
    for (std::size_t k = 0; k < chunks.size(); ++k, ++op_epoch_) {
      const std::size_t begin = chunks.begin(k), len = chunks.len(k);
      const Segments seg{len, world_size_};
      const std::size_t slot = slot_offset();
      barrier(timeout_s, call);
      const std::uint8_t* sources[kMaxRanks];
      for (int r = 0; r < world_size_; ++r) {
        sources[r] = r == rank_ ? reinterpret_cast<const std::uint8_t*>(src + begin) : peer(r) + slot;
      }
      T* mine = reinterpret_cast<T*>(peer(rank_) + slot);
      reduce_range<T>(sources, world_size_, dst + begin, seg.lo(rank_), seg.hi(rank_), mine, stream);
      const std::uint64_t reduced = arrive(call);
      if (k + 1 < chunks.size()) stage_peer_segments(src, chunks, k + 1);
      wait_all(reduced, timeout_s);
      for (int r = 0; r < world_size_; ++r) {
        if (r == rank_) continue;
        copy_out(dst + begin + seg.lo(r), reinterpret_cast<const T*>(peer(r) + slot) + seg.lo(r),
                 (seg.hi(r) - seg.lo(r)) * sizeof(T), stream);
      }
    }
    if (stream) store_fence();
  }

  // Over a compressed wire, per chunk: this rank encodes it whole into its slot, barrier; oneshot
  // sums every rank's decoded chunk; twoshot sums segment r on rank r, which writes it in T after
  // the codes in its slot, barrier, and every rank copies the others' segments. Both sum every
  // element the same way, so they give the same bits; the gather moves T, not codes.
  template <typename T>
  void reduce_over_wire(const T* src, T* dst, const Chunking& chunks, Path path, wire::Wire format,
                        const Call& call, double timeout_s) {
    if (chunks.size() == 0) return barrier(timeout_s, call);  // nothing to move, but the calls meet
    for (std::size_t k = 0; k < chunks.size(); ++k, ++op_epoch_) {
      const std::size_t begin = chunks.begin(k), len = chunks.len(k), slot = slot_offset();
      encode_range(src + begin, len, format, peer(rank_) + slot);
      barrier(timeout_s, call);
      const std::uint8_t* encoded[kMaxRanks];
      for (int r = 0; r < world_size_; ++r) encoded[r] = peer(r) + slot;
      if (path == Path::kOneshot) {
        reduce_encoded(encoded, world_size_, len, format, dst + begin, 0, len);
        continue;
      }
      const Segments seg{len, world_size_, wire::kWireBlock};
      const auto reduced = [&](int r) { return reinterpret_cast<T*>(peer(r) + slot + wire::reduced_offset(len)); };
      reduce_encoded(encoded, world_size_, len, format, dst + begin, seg.lo(rank_), seg.hi(rank_), reduced(rank_));
      barrier(timeout_s, call);
      for (int r = 0; r < world_size_; ++r) {
        if (r != rank_) std::memcpy(dst + begin + seg.lo(r), reduced(r) + seg.lo(r), (seg.hi(r) - seg.lo(r)) * sizeof(T));
      }
    }
  }

  // A chunk of len elements split into world_size segments of `align`-element multiples.
  struct Segments {
    std::size_t len, per;
    Segments(std::size_t n, int world_size, std::size_t align = 16)
        : len(n), per(round_up((n + world_size - 1) / world_size, align)) {}
    std::size_t lo(int r) const { return std::min(len, std::size_t(r) * per); }
    std::size_t hi(int r) const { return std::min(len, std::size_t(r + 1) * per); }
  };

  // Copy chunk k's segments that peers reduce into this rank's slot for chunk k.
  template <typename T>
  void stage_peer_segments(const T* src, const Chunking& chunks, std::size_t k) {
    const Segments seg{chunks.len(k), world_size_};
    T* slot = reinterpret_cast<T*>(peer(rank_) + slot_offset(op_epoch_ + (k == 0 ? 0 : 1)));
    const T* from = src + chunks.begin(k);
    for (int r = 0; r < world_size_; ++r) {
      if (r != rank_) std::memcpy(slot + seg.lo(r), from + seg.lo(r), (seg.hi(r) - seg.lo(r)) * sizeof(T));
    }
  }

  // Every rank's call at `epoch`, read from the arrival lines in this rank's buffer (each peer's
  // was acquired with its flag); GroupMismatchError, the same on every rank, where they differ.
  void check_calls(std::uint64_t epoch) const {
    std::uint64_t words[kMaxRanks];
    bool agree = true;
    for (int r = 0; r < world_size_; ++r) {
      const auto* line = reinterpret_cast<const std::uint64_t*>(peer(rank_) + std::size_t(r) * kLineBytes);
      words[r] = __atomic_load_n(line + 1 + epoch % 2, __ATOMIC_RELAXED);
      agree = agree && words[r] == words[0];
    }
    if (agree) return;
    Call calls[kMaxRanks];
    for (int r = 0; r < world_size_; ++r) calls[r] = Call::unpack(words[r]);
    raise_mismatch(calls);
  }

  [[noreturn]] void raise_mismatch(const Call* calls) const {
    bool known[kMaxRanks];
    std::fill(known, known + kMaxRanks, true);
    // The caller's error names this rank already ("[group 'g', rank 0] ...").
    NODECOMM_RAISE(kGroupMismatch,
                   describe_disagreement(calls, known, world_size_) + "; nothing was written to the output");
  }

  // Spin briefly, then yield, then sleep: ranks may outnumber cores.
  void wait_flag(int r, std::uint64_t epoch, double timeout_s) {
    const auto* flag = reinterpret_cast<const std::uint64_t*>(peer(rank_) + std::size_t(r) * kLineBytes);
    using Clock = std::chrono::steady_clock;
    Clock::time_point start{};
    for (std::uint64_t spins = 0;; ++spins) {
      if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= epoch) return;
      const auto [reason, detail] = abort_state(control_);
      // A peer that arrived and then left (or died) aborts the group after its arrival: look at
      // the flag once more, so that a barrier the peer did reach is not failed for its departure.
      if (reason != kNotAborted && __atomic_load_n(flag, __ATOMIC_ACQUIRE) < epoch) raise_aborted(reason, detail);
      if (spins < 4096) {
        cpu_relax();
        continue;
      }
      if (spins == 4096) start = Clock::now();
      if ((spins & 63) == 0) {
        const double waited = std::chrono::duration<double>(Clock::now() - start).count();
        if (waited > timeout_s) raise_stalled(r, epoch, waited);
        if (waited > 0.002) {
          const timespec nap{0, 50000};
          nanosleep(&nap, nullptr);
          continue;
        }
      }
      sched_yield();
    }
  }

  [[noreturn]] void raise_aborted(std::uint64_t reason, std::uint64_t detail) const {
    // No "rank N": the caller's error names this rank already ("[group 'g', rank 0] ...").
    const auto [kind, message] = abort_error(control_, reason, detail);
    throw Error(kind, message);
  }

  [[noreturn]] void raise_stalled(int r, std::uint64_t epoch, double waited) {
    const auto* flag = reinterpret_cast<const std::uint64_t*>(peer(rank_) + std::size_t(r) * kLineBytes);
    const std::uint64_t seen = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    abort_group(control_, kStalled, std::uint64_t(rank_));
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%.1f", waited);
    NODECOMM_RAISE(kDeadlineExceeded, std::string("waited ") + seconds + " s for rank " + std::to_string(r) +
                                          " at barrier epoch " + std::to_string(epoch) + " (its flag reads " +
                                          std::to_string(seen) + ")");
  }

  int rank_;
  int world_size_;
  std::vector<std::uintptr_t> buffers_;
  std::uintptr_t control_;
  std::size_t capacity_bytes_;
  std::uint64_t barrier_epoch_ = 0;
  std::uint64_t op_epoch_ = 0;
};

}  // namespace nodecomm::shm
