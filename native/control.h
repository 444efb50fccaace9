// control.h — a group's control segment: one page of host shared memory (a memfd the daemon hands
// out) that every rank maps, and that CUDA ranks also map into their device's address space.
//
//   [0, 8)                         abort word: reason << 32 | detail; 0 while the group is healthy
//   [kOfferOffset + 32 * r, +32)   rank r's table offers: two slots, by the parity of the table
//                                  switch point, each (point, the newest epoch it held there)
//   [kCapturedOffset + 8 * r, +8)  rank r's captured calls: how many of its calls CUDA graphs hold
//                                  (its host counts them as it enqueues them under capture); a
//                                  group with any is watched for an abort (capture_watch.h)
//   [kErrorOffset + 64 * r, +32)   rank r's error record (CUDA kernels): code, the rank waited
//                                  for (or disagreed with), the barrier epoch (the launch number
//                                  for a pushed oneshot), and on a mismatch this rank's call
//                                  (agreement.h; peers' calls arrive as digests only, so each rank
//                                  records its own); the host reads it without a device sync
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "agreement.h"
#include "codes.h"
#include "errors.h"

namespace nodecomm::control {

constexpr std::size_t kControlBytes = 4096;
constexpr std::size_t kErrorOffset = 1024;
constexpr std::size_t kErrorStride = 64;
constexpr int kMaxRecords = int((kControlBytes - kErrorOffset) / kErrorStride);
constexpr std::size_t kOfferOffset = 128;
constexpr std::size_t kOfferStride = 32;
constexpr std::size_t kCapturedOffset = 768;
static_assert(kOfferOffset + kOfferStride * kMaxRanks <= kCapturedOffset, "table offers overlap the captured counts");
static_assert(kCapturedOffset + 8 * kMaxRanks <= kErrorOffset, "captured counts overlap the error records");
static_assert(kMaxRanks <= kMaxRecords, "a rank without an error record");

// Abort reasons; equal to what nodecomm.client expects.
enum AbortReason : std::uint64_t {
  kNotAborted = 0, kPeerLost = 1, kDaemonLost = 2, kShutdown = 3, kStalled = 4, kPeerLeft = 5,
  kMismatch = 6  // a CUDA rank found that a peer arrived with another call; detail: that rank
};

// Error codes of an error record.
enum KernelError : std::uint64_t { kErrorNone = 0, kErrorTimeout = 1, kErrorAborted = 2, kErrorMismatch = 3 };

inline constexpr std::uint64_t abort_word(std::uint64_t reason, std::uint64_t detail) {
  return (reason << 32) | (detail & 0xFFFFFFFFu);
}

// The abort word's upper half, the reason: what threads waiting for an abort sleep on (a futex on
// the shared page, so a waiter in any process that maps it is woken).
inline std::uint32_t* abort_reason_word(std::uintptr_t control) {
  return reinterpret_cast<std::uint32_t*>(control) + 1;  // little-endian: the upper 32 bits
}

// One compare-and-swap publishes reason and detail together; the first reason wins, since later
// failures are consequences of it. Then every thread sleeping in wait_for_abort wakes.
inline void abort_group(std::uintptr_t control, std::uint64_t reason, std::uint64_t detail) {
  std::uint64_t expected = 0;
  __atomic_compare_exchange_n(reinterpret_cast<std::uint64_t*>(control), &expected, abort_word(reason, detail), false,
                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  syscall(SYS_futex, abort_reason_word(control), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleep until the group aborts, wake_abort_waiters is called, a signal interrupts or `timeout`
// passes (null: no limit); returns the abort reason, 0 if none yet. Callers loop.
inline std::uint32_t wait_for_abort(std::uintptr_t control, const timespec* timeout = nullptr) {
  std::uint32_t* reason = abort_reason_word(control);
  if (const std::uint32_t now = __atomic_load_n(reason, __ATOMIC_ACQUIRE); now != 0) return now;
  syscall(SYS_futex, reason, FUTEX_WAIT, 0, timeout, nullptr, 0);  // returns at once if no longer 0
  return __atomic_load_n(reason, __ATOMIC_ACQUIRE);
}

inline void wake_abort_waiters(std::uintptr_t control) {
  syscall(SYS_futex, abort_reason_word(control), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline std::pair<std::uint64_t, std::uint64_t> abort_state(std::uintptr_t control) {
  const std::uint64_t word = __atomic_load_n(reinterpret_cast<const std::uint64_t*>(control), __ATOMIC_ACQUIRE);
  return {word >> 32, word & 0xFFFFFFFFu};
}

// Counted by the rank's host under its call lock, read by its capture watch and by the daemon.
inline void record_captured(std::uintptr_t control, int rank) {
  if (rank < 0 || rank >= kMaxRanks) return;
  __atomic_fetch_add(reinterpret_cast<std::uint64_t*>(control + kCapturedOffset + 8 * rank), 1, __ATOMIC_RELEASE);
}

inline std::uint64_t captured_calls(std::uintptr_t control, int rank) {
  if (rank < 0 || rank >= kMaxRanks) return 0;
  return __atomic_load_n(reinterpret_cast<const std::uint64_t*>(control + kCapturedOffset + 8 * rank),
                         __ATOMIC_ACQUIRE);
}

// Table switches are agreed through the control page, with no collective and so no wait for a
// GPU: at its q-th switch point every rank reads the epochs all ranks offered at point q - 1 (each
// has by then, unless its host is a whole period behind) and switches to the lowest, then offers
// the newest it holds for point q. A slot is rewritten at point q + 2 only after its writer read
// every rank's point-q + 1 offer, which each rank writes after reading its point-q slots.
inline std::uint64_t* offer_slot(std::uintptr_t control, int rank, std::uint64_t point) {
  return reinterpret_cast<std::uint64_t*>(control + kOfferOffset + kOfferStride * rank + 16 * (point % 2));
}

inline void publish_offer(std::uintptr_t control, int rank, std::uint64_t point, std::uint64_t epoch) {
  std::uint64_t* slot = offer_slot(control, rank, point);
  __atomic_store_n(slot + 1, epoch, __ATOMIC_RELAXED);
  __atomic_store_n(slot, point, __ATOMIC_RELEASE);  // the point last: a reader that sees it sees the epoch
}

enum class OfferWait { kComplete, kAborted, kTimedOut };

struct Offers {
  OfferWait outcome;
  std::uint64_t lowest;  // kComplete: the lowest epoch offered at the point
  int missing;           // kTimedOut: a rank that had not offered
};

// The lowest epoch the ranks offered at `point`, once every rank has; looks 20 us apart at first,
// then further, up to 1 ms apart (a peer's host that is behind is behind by at least a call, and
// a long wait should not keep a core busy), up to `timeout_ns` or the group's abort.
inline Offers lowest_offer(std::uintptr_t control, int world_size, std::uint64_t point, std::uint64_t timeout_ns) {
  timespec started{};
  clock_gettime(CLOCK_MONOTONIC, &started);
  long pause_ns = 20000;
  for (;;) {
    Offers offers{OfferWait::kComplete, UINT64_MAX, -1};
    for (int r = 0; r < world_size && offers.missing < 0; ++r) {
      const std::uint64_t* slot = offer_slot(control, r, point);
      if (__atomic_load_n(slot, __ATOMIC_ACQUIRE) != point) {
        offers.missing = r;
      } else {
        const std::uint64_t epoch = __atomic_load_n(slot + 1, __ATOMIC_RELAXED);
        offers.lowest = epoch < offers.lowest ? epoch : offers.lowest;
      }
    }
    if (offers.missing < 0) return offers;
    if (abort_state(control).first != 0) return {OfferWait::kAborted, 0, offers.missing};
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    const std::uint64_t waited = std::uint64_t(now.tv_sec - started.tv_sec) * 1000000000ull + now.tv_nsec -
                                 started.tv_nsec;
    if (waited > timeout_ns) return {OfferWait::kTimedOut, 0, offers.missing};
    const timespec pause{0, pause_ns};
    nanosleep(&pause, nullptr);
    pause_ns = pause_ns < 1000000 ? pause_ns * 2 : 1000000;
  }
}

struct ErrorRecord {
  std::uint64_t code, peer, epoch, call;
};

inline ErrorRecord error_record(std::uintptr_t control, int rank) {
  const auto* record = reinterpret_cast<const std::uint64_t*>(control + kErrorOffset + kErrorStride * rank);
  // The code first: a kernel writes the rest, fences, then the code.
  ErrorRecord out;
  out.code = __atomic_load_n(record, __ATOMIC_ACQUIRE);
  out.peer = __atomic_load_n(record + 1, __ATOMIC_ACQUIRE);
  out.epoch = __atomic_load_n(record + 2, __ATOMIC_ACQUIRE);
  out.call = __atomic_load_n(record + 3, __ATOMIC_ACQUIRE);
  return out;
}

// What a rank raises once its group's abort word is set: the one mapping from an abort to an error.
// shm.h raises it; the Python Communicator asks for it (_native.abort_error) and adds only what it
// alone knows: the daemon's own words for a lost peer, and on a mismatch every rank's record.
inline std::pair<ErrorKind, std::string> abort_error(std::uintptr_t control, std::uint64_t reason,
                                                     std::uint64_t detail) {
  const std::string rank = std::to_string(detail);
  switch (reason) {
    case kPeerLost: return {ErrorKind::kPeerLost, "group aborted: peer rank " + rank + " was lost"};
    case kDaemonLost: return {ErrorKind::kDaemonUnavailable, "group aborted: the daemon connection was lost"};
    case kShutdown: return {ErrorKind::kDaemonUnavailable, "group aborted: the daemon is shutting down"};
    case kPeerLeft: return {ErrorKind::kPeerLost, "group closed: peer rank " + rank + " left"};
    case kStalled: {
      // A CUDA rank's kernel records whom it waited for; a CPU rank that gave up records nothing.
      const ErrorRecord record = detail < std::uint64_t(kMaxRecords) ? error_record(control, int(detail))
                                                                     : ErrorRecord{};
      const std::string whom = record.code == kErrorTimeout ? "rank " + std::to_string(record.peer) : "a peer";
      return {ErrorKind::kPeerLost, "group aborted: rank " + rank + " timed out waiting for " + whom};
    }
    case kMismatch: return {ErrorKind::kGroupMismatch, "group stopped: rank " + rank + " found a peer with another call"};
    default: return {ErrorKind::kInternal, "group aborted with unknown reason " + std::to_string(reason)};
  }
}

// The host's record of `call`, which `rank` did not enqueue because a mismatch had stopped the
// group: a rank whose kernels never reached the call its peers disagreed on records the call it
// was about to make, which is that one. A kernel's record, written first, stays.
inline void record_refused_call(std::uintptr_t control, int rank, std::uint64_t call) {
  auto* record = reinterpret_cast<std::uint64_t*>(control + kErrorOffset + kErrorStride * rank);
  const std::uint64_t code = __atomic_load_n(record, __ATOMIC_ACQUIRE);
  if (code != kErrorNone && code != kErrorAborted) return;
  __atomic_store_n(record + 1, std::uint64_t(rank), __ATOMIC_RELAXED);
  __atomic_store_n(record + 2, std::uint64_t(0), __ATOMIC_RELAXED);
  __atomic_store_n(record + 3, call, __ATOMIC_RELAXED);
  __atomic_store_n(record, kErrorMismatch, __ATOMIC_RELEASE);  // the code last, as a kernel writes it
}

// What the ranks' records of a group aborted with kMismatch say: each recording rank's own call
// (describe_disagreement in agreement.h); and whether every rank's call is known (ranks record
// theirs as their kernels notice the abort).
inline std::pair<std::string, bool> recorded_disagreement(std::uintptr_t control, int world_size) {
  Call calls[kMaxRecords];
  bool known[kMaxRecords] = {};
  world_size = world_size < kMaxRecords ? world_size : kMaxRecords;
  for (int r = 0; r < world_size; ++r) {
    const ErrorRecord record = error_record(control, r);
    if (record.code != kErrorMismatch) continue;
    calls[r] = Call::unpack(record.call);
    known[r] = true;
  }
  bool complete = true;
  for (int r = 0; r < world_size; ++r) complete = complete && known[r];
  return {describe_disagreement(calls, known, world_size), complete};
}

}  // namespace nodecomm::control
