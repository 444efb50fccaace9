// sync.cuh — what every CUDA kernel of nodecomm synchronises with: release/acquire stores and
// loads at system scope (peers' memory may sit across PCIe), the global timer, the group's abort
// word and error records (../control.h), and one bounded wait that honours both and notices a
// peer that arrived with another call (../agreement.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../control.h"

namespace nodecomm::cuda {

// Nanoseconds for the kernels' waits: an infinite or huge timeout waits as long as a uint64
// counts, a NaN or non-positive one not at all (converting either to an integer is undefined).
inline std::uint64_t timeout_ns(double seconds) {
  if (!(seconds > 0)) return 0;
  return seconds < 1.8e10 ? std::uint64_t(seconds * 1e9) : UINT64_MAX;
}

__device__ __forceinline__ void store_release(std::uint64_t* address, std::uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ std::uint64_t load_acquire(const std::uint64_t* address) {
  std::uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ std::uint64_t load_volatile(const std::uint64_t* address) {
  return *reinterpret_cast<const volatile std::uint64_t*>(address);
}

__device__ __forceinline__ void store_volatile(std::uint64_t* address, std::uint64_t value) {
  *reinterpret_cast<volatile std::uint64_t*>(address) = value;
}

__device__ __forceinline__ std::uint64_t now_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ std::uint64_t* word(std::uint8_t* base, std::size_t offset) {
  return reinterpret_cast<std::uint64_t*>(base + offset);
}

// Record why this rank stopped (the first record stays) in the control segment, where the host
// reads it; a timeout also aborts the group. Host memory takes no device atomics on PCIe hosts,
// so "first" is best effort: every record and reason written is a true one. The stop paths are
// out of line: inlined into every wait they doubled the kernels' code, and the cold start of a
// larger kernel showed in every small call.
__device__ inline __noinline__ void fail(std::uint8_t* control, int rank, std::uint64_t code, int peer, std::uint64_t epoch) {
  std::uint64_t* record = word(control, control::kErrorOffset + control::kErrorStride * rank);
  if (load_volatile(record) == control::kErrorNone) {
    store_volatile(record + 1, std::uint64_t(peer));
    store_volatile(record + 2, epoch);
    __threadfence_system();
    store_volatile(record, code);
  }
  __threadfence_system();  // the record before the abort word: a peer that sees the abort reads it
  if (code == control::kErrorTimeout && load_volatile(word(control, 0)) == 0) {
    store_volatile(word(control, 0), (std::uint64_t(control::kStalled) << 32) | std::uint64_t(rank));
  }
  __threadfence_system();
}

// Record this rank's `call`, which `peer` did not arrive with (or which a peer's mismatch stopped),
// then abort the group, so that every rank's waits end and its next call raises
// GroupMismatchError with every rank's record. It replaces a record of an abort, which the
// mismatch (this rank's or a peer's) caused.
__device__ inline __noinline__ void disagree(std::uint8_t* control, int rank, int peer, std::uint64_t epoch,
                                             std::uint64_t call) {
  std::uint64_t* record = word(control, control::kErrorOffset + control::kErrorStride * rank);
  const std::uint64_t code = load_volatile(record);
  if (code == control::kErrorNone || code == control::kErrorAborted) {
    store_volatile(record + 1, std::uint64_t(peer));
    store_volatile(record + 2, epoch);
    store_volatile(record + 3, call);
    __threadfence_system();
    store_volatile(record, control::kErrorMismatch);
  }
  __threadfence_system();
  if (load_volatile(word(control, 0)) == 0) {
    store_volatile(word(control, 0), (std::uint64_t(control::kMismatch) << 32) | std::uint64_t(rank));
  }
  __threadfence_system();
}

// A wait's look for a peer that runs another kernel for this launch than this rank does (its
// arrivals never come): true once there is a sign of it.
struct NoEvidence {
  __device__ bool operator()() const { return false; }
};

// How often a wait looks at the abort word (host memory: every read crosses PCIe), besides at once
// when its stop word is set (layout.h; read at every clock check at no cost). Frequent reads slow
// healthy barriers: a read delays this rank's next arrival, its peers then wait long enough to read
// in turn, and the ranks settle into paying a read per barrier. At this interval a healthy barrier
// is over before it reads, and one read's delay cannot push a peer's wait past the interval. It
// also bounds how late an abort is noticed when the stop word's write is late. The measurements
// behind it: docs/bench-gpu.md, "The constants in the kernels".
constexpr std::uint64_t kAbortPollNs = 100000;

// How long a wait lasts before it looks for a sign that a peer runs another kernel: a peer that
// finished this launch has long made its arrivals visible by then, so the sign is of another kernel.
constexpr std::uint64_t kEvidenceAfterNs = 1000000;

// What a wait's look found that ends it, unless what it waits for came meanwhile.
enum class Stop { kNone, kElsewhere, kAbortedByMismatch, kAborted, kTimedOut };

// The look: `elsewhere` when `with_evidence` (see kEvidenceAfterNs), then the abort word, then
// the clock.
template <typename Elsewhere>
__device__ __noinline__ Stop look_for_stop(std::uint8_t* control, Elsewhere elsewhere, bool with_evidence,
                                           bool timed_out) {
  if (with_evidence && elsewhere()) return Stop::kElsewhere;
  if (const std::uint64_t abort = load_acquire(word(control, 0)); abort != 0) {
    return abort >> 32 == control::kMismatch ? Stop::kAbortedByMismatch : Stop::kAborted;
  }
  return timed_out ? Stop::kTimedOut : Stop::kNone;
}

// Record why a wait ended without what it waited for. A peer's mismatch puts this rank's call on
// record too, for the message.
__device__ inline __noinline__ void record_stop(Stop stop, std::uint8_t* control, int rank, int peer,
                                                std::uint64_t epoch, std::uint64_t call) {
  if (stop == Stop::kElsewhere || (stop == Stop::kAbortedByMismatch && call != 0)) {
    disagree(control, rank, peer, epoch, call);
  } else {
    fail(control, rank, stop == Stop::kTimedOut ? control::kErrorTimeout : control::kErrorAborted, peer, epoch);
  }
}

// Wait until ready() holds. The clock and `stop_word` (this rank's stop word, in its own device
// memory: layout.h; null for none) are read every 32 spins; the abort word every kAbortPollNs, and
// `elsewhere` (the peer runs another kernel: see NoEvidence) with it once kEvidenceAfterNs have
// passed; both at once when the stop word is set, and once more before a timeout is declared, so
// that an abort or a mismatch is reported as one. False (after recording why, against `peer`) on
// an abort, a mismatch (this rank's call is `call`), or once timeout_ns have passed; true if
// ready() holds at the look that found any of them (a peer that arrived and then left aborts the
// group after its arrival).
template <typename Ready, typename Elsewhere = NoEvidence>
__device__ __forceinline__ bool wait_until(Ready ready, std::uint64_t epoch, std::uint8_t* control, int rank, int peer,
                                           std::uint64_t timeout_ns, std::uint64_t call = 0,
                                           Elsewhere elsewhere = {}, const std::uint64_t* stop_word = nullptr) {
  std::uint64_t started = 0, polled = 0;
  for (unsigned spins = 1; !ready(); ++spins) {
    if (spins % 32 != 0) continue;
    const std::uint64_t now = now_ns();
    if (started == 0) started = polled = now;
    const bool timed_out = now - started > timeout_ns;
    const bool asked = stop_word != nullptr && load_volatile(stop_word) != 0;
    if (!timed_out && !asked && now - polled < kAbortPollNs) continue;
    polled = now;
    Stop stop = look_for_stop(control, elsewhere, timed_out || asked || now - started >= kEvidenceAfterNs, timed_out);
    if (stop == Stop::kNone && asked) stop = Stop::kAborted;  // the word is only set after the abort
    if (stop != Stop::kNone) {
      if (ready()) return true;
      record_stop(stop, control, rank, peer, epoch, call);
      return false;
    }
  }
  return true;
}

// A call as a kernel carries it: whole, for this rank's record if the ranks disagree, and as the
// 32-bit digest that arrival words and pushed lines carry, taken once on the host (mixing 64 bits
// on the device sat on every barrier's path).
struct TaggedCall {
  std::uint64_t call;
  std::uint32_t digest;
};

inline TaggedCall tagged(std::uint64_t call) {
  std::uint64_t x = call;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return TaggedCall{call, std::uint32_t(x ^ (x >> 31))};
}

// An arrival word, what a barrier stores into its peers' flags: the low 32 bits of the arrival's
// epoch (compared modulo 2^32: peers are never more than a barrier apart), above the digest of the
// call it arrived with, so that one store carries both.
__device__ __forceinline__ std::uint64_t arrival(std::uint64_t epoch, TaggedCall call) {
  return (epoch << 32) | call.digest;
}

// How many epochs past `epoch` the arrival word `word` is (negative: not there yet).
__device__ __forceinline__ std::int32_t epochs_past(std::uint64_t word, std::uint64_t epoch) {
  return std::int32_t(std::uint32_t(word >> 32) - std::uint32_t(epoch));
}

// Wait until *flag holds the peer's arrival at `epoch` (or later), then compare its call's digest
// with this rank's: a peer already past `epoch` compared ours there and agreed. False (after
// recording why) on a timeout, an abort, or another call.
template <typename Elsewhere = NoEvidence>
__device__ inline bool wait_arrival(const std::uint64_t* flag, std::uint64_t epoch, TaggedCall call,
                                    std::uint8_t* control, int rank, int peer, std::uint64_t timeout_ns,
                                    Elsewhere elsewhere = {}, const std::uint64_t* stop_word = nullptr) {
  std::uint64_t seen = 0;
  const auto arrived = [&] {
    seen = load_acquire(flag);
    return epochs_past(seen, epoch) >= 0;
  };
  if (!wait_until(arrived, epoch, control, rank, peer, timeout_ns, call.call, elsewhere, stop_word)) return false;
  if (epochs_past(seen, epoch) == 0 && std::uint32_t(seen) != call.digest) {
    disagree(control, rank, peer, epoch, call.call);
    return false;
  }
  return true;
}

// Wait until *flag reaches epoch (see wait_until).
template <typename Elsewhere = NoEvidence>
__device__ inline bool wait_at_least(const std::uint64_t* flag, std::uint64_t epoch, std::uint8_t* control, int rank,
                                     int peer, std::uint64_t timeout_ns, std::uint64_t call = 0,
                                     Elsewhere elsewhere = {}) {
  return wait_until([=] { return load_acquire(flag) >= epoch; }, epoch, control, rank, peer, timeout_ns, call,
                    elsewhere);
}

}  // namespace nodecomm::cuda
