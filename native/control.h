// control.h — a group's control segment: one page of host shared memory (a memfd the daemon hands
// out) that every rank maps, and that CUDA ranks also map into their device's address space.
//
//   [0, 8)                         abort word: reason << 32 | detail; 0 while the group is healthy
//   [kErrorOffset + 64 * r, +24)   rank r's error record (CUDA kernels): code, the rank waited
//                                  for, the barrier epoch (the launch number for a pushed
//                                  oneshot); the host reads it without a device sync
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

namespace nodecomm::control {

constexpr std::size_t kControlBytes = 4096;
constexpr std::size_t kErrorOffset = 1024;
constexpr std::size_t kErrorStride = 64;

// Abort reasons; equal to what nodecomm.client expects.
enum AbortReason : std::uint64_t {
  kNotAborted = 0, kPeerLost = 1, kDaemonLost = 2, kShutdown = 3, kStalled = 4, kPeerLeft = 5
};

// Error codes of an error record.
constexpr std::uint64_t kErrorNone = 0;
constexpr std::uint64_t kErrorTimeout = 1;
constexpr std::uint64_t kErrorAborted = 2;

inline constexpr std::uint64_t abort_word(std::uint64_t reason, std::uint64_t detail) {
  return (reason << 32) | (detail & 0xFFFFFFFFu);
}

// One compare-and-swap publishes reason and detail together; the first reason wins, since later
// failures are consequences of it.
inline void abort_group(std::uintptr_t control, std::uint64_t reason, std::uint64_t detail) {
  std::uint64_t expected = 0;
  __atomic_compare_exchange_n(reinterpret_cast<std::uint64_t*>(control), &expected, abort_word(reason, detail), false,
                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

inline std::pair<std::uint64_t, std::uint64_t> abort_state(std::uintptr_t control) {
  const std::uint64_t word = __atomic_load_n(reinterpret_cast<const std::uint64_t*>(control), __ATOMIC_ACQUIRE);
  return {word >> 32, word & 0xFFFFFFFFu};
}

struct ErrorRecord {
  std::uint64_t code, peer, epoch;
};

inline ErrorRecord error_record(std::uintptr_t control, int rank) {
  const auto* record = reinterpret_cast<const std::uint64_t*>(control + kErrorOffset + kErrorStride * rank);
  // The code first: a kernel writes peer and epoch, fences, then the code.
  ErrorRecord out;
  out.code = __atomic_load_n(record, __ATOMIC_ACQUIRE);
  out.peer = __atomic_load_n(record + 1, __ATOMIC_ACQUIRE);
  out.epoch = __atomic_load_n(record + 2, __ATOMIC_ACQUIRE);
  return out;
}

}  // namespace nodecomm::control
