// shm_layout.h — the CPU transport's buffers (shm.h runs its collectives on them).
//
// Layout of each rank's buffer (shm_buffer_bytes):
//   [0, kHeaderBytes)       arrival lines, one of 64 bytes per peer: peer p stores its barrier
//                           epoch into line p of every rank's buffer (no atomics across peers),
//                           after the call it is in (Call: collective, count, dtype, path,
//                           packed in one word) at [8 + 8 * (epoch % 2), +8) of the line
//   then kNumSlots slots    staging slots of round_up(capacity_bytes, 64) bytes each
// The group's abort word lives in its control segment (control.h), written by the daemon or by a
// rank that gives up on the group.
//
// Ordering: a rank copies its input into its slot, then stores its epoch into every peer's flag
// line with release semantics; a reader acquires the flag before reading the slot.
//
// Agreement: every barrier compares the calls the ranks arrived with, before anything is written
// to an output; ranks that disagree (count, dtype, collective, path) all raise
// GroupMismatchError at the same barrier, with every rank's value, and the group stays usable.
// Two call slots per line: a peer can be one barrier ahead of a reader (it passed the barrier
// once the reader arrived) but not two, so the slot of the reader's epoch is still its. Payloads move
// in chunks and chunk k (counted across operations) uses slot k % 2. A rank reuses a slot two
// chunks later only after passing a barrier of the chunk in between, which no peer reaches before
// it has finished reading that slot, so no extra pre-write barrier is needed.
#pragma once

#include <cstddef>

#include "codes.h"
#include "control.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace nodecomm::shm {


constexpr std::size_t kLineBytes = 64;
constexpr int kNumSlots = 2;
constexpr std::size_t kHeaderBytes = kMaxRanks * kLineBytes;
// Large payloads move in chunks of at most this many bytes, so each chunk's staging stays in cache
// between the copy in and the peers' reads (measured on the CPU bench; see docs/bench-cpu.md).
constexpr std::size_t kPipelineChunkBytes = 1 << 20;
// Outputs at least this large are written with non-temporal stores: they cannot stay in a core's
// cache anyway, and skipping the read-for-ownership pays only at such sizes (docs/bench-cpu.md).
constexpr std::size_t kStreamOutputBytes = 8 << 20;

using namespace nodecomm::control;  // the abort word and its reasons

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Orders non-temporal stores before what follows (a no-op where none are used).
inline void store_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
inline std::size_t slot_stride(std::size_t capacity_bytes) { return round_up(capacity_bytes, kLineBytes); }
inline std::size_t shm_buffer_bytes(std::size_t capacity_bytes) {
  return kHeaderBytes + kNumSlots * slot_stride(capacity_bytes);
}

}  // namespace nodecomm::shm
