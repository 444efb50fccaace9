// layout.h — one rank's device buffer, as every CUDA path sees it (host and device code).
//
//   [0, kMaxBlocks*16)            per block index: launches (picks the slot; every launch advances
//                                 all of them) and barriers passed (advanced by that block)
//   flags                         kMaxBlocks x kMaxRanks arrival words: block b of rank p stores
//                                 its barrier's epoch and a digest of its call (sync.cuh) into
//                                 flags[b][p] of every rank's buffer
//   stop                          two words, 0 while the group runs and never cleared after:
//                                 gave up (+0), kGaveUp once a wait of this rank failed (a barrier
//                                 or a pushed line: a timeout, an abort, a mismatch), written by
//                                 this rank only; the copy paths, whose copies run whatever came
//                                 before them on the stream, write outputs only while it is 0.
//                                 Asked to stop (+8), 1 + r once rank r's kernel gave up (it
//                                 writes every rank's), 1 + kMaxRanks once the rank's abort watch
//                                 saw the group abort (abort_watch.h). Both are local memory, so
//                                 waits read the second at every clock check: a running wait ends
//                                 once the word lands, and every kernel queued after returns at
//                                 its start or first barrier, writing nothing. A kernel past its
//                                 last wait finishes: its peers' data is all there. The two share
//                                 16 bytes so that a kernel reads both with one load.
//   probe                         kMaxRanks tags: rank p writes probe[p] of every rank's buffer
//                                 once, when the group's peer memory is checked at connect
//   service words                 the service path's counters (stream_words.h), 128 bytes apart:
//                                 "input ready", which this rank's stream raises to its submit's
//                                 sequence + 1 once the input is written and the daemon's stream
//                                 waits on; "done", which the daemon's stream raises after the
//                                 collective and this rank's stream waits on
//   slots                         two staging slots of slot_stride bytes each (the group's
//                                 capacity_bytes usable); the copy paths stage
//                                 in slot 0 and pull peers' data into slot 1, from where a kernel
//                                 copies it to the output unless this rank gave up
//   push slots                    two of push_slot_bytes each, written only by the push variant of
//                                 oneshot: rank p's lines for this rank go to part p of the slot
// The group's abort word and the ranks' error records live in its control segment (../control.h),
// host memory mapped into the device, so the daemon and the host read and write them directly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../codes.h"

namespace nodecomm::cuda {

constexpr int kMaxBlocks = 64;
constexpr std::size_t kCounterOffset = 0;
constexpr std::size_t kFlagOffset = kCounterOffset + kMaxBlocks * 16;
constexpr std::size_t kGaveUpOffset = kFlagOffset + std::size_t(kMaxBlocks) * kMaxRanks * 8;
constexpr std::size_t kStopAskedOffset = kGaveUpOffset + 8;
static_assert(kGaveUpOffset % 16 == 0, "the stop words are read with one 16-byte load");
constexpr std::uint64_t kGaveUp = 1;  // this rank's wait failed; it recorded why
// The asked word holds 1 + the rank whose kernel asked, or 1 + kAskedByHost (the rank's abort
// watch, for whoever aborted the group).
constexpr int kAskedByHost = kMaxRanks;
constexpr std::size_t kProbeOffset = kGaveUpOffset + 256;
constexpr std::size_t kServiceReadyOffset = kProbeOffset + 256;
constexpr std::size_t kServiceDoneOffset = kServiceReadyOffset + 128;
constexpr std::size_t kSlotOffset = kServiceReadyOffset + 256;
// What an abort raises service words to: past any sequence, yet within half the word's range of
// every value a stream waits for, since a stream's wait compares cyclically ((int64_t)(word -
// value) >= 0): the word's largest value would read as behind every sequence, not past it.
constexpr std::uint64_t kServiceReleased = std::uint64_t(1) << 62;
// dma segments are rounded up to this many bytes; the slack lets slot 1 hold world_size - 1 of them.
constexpr std::size_t kSegmentAlign = 256;
constexpr std::size_t kSlotSlack = kMaxRanks * kSegmentAlign;

inline constexpr std::size_t slot_stride(std::size_t capacity_bytes) {
  return (capacity_bytes + kSlotSlack + 255) / 256 * 256;
}
// The push slots hold every rank's payload twice over (a flag beside every 4 bytes), so they are
// capped: small payloads, where a round trip is most of the cost, are what the push variant is for.
constexpr std::size_t kPushSlotMax = std::size_t(2) << 20;
inline constexpr std::size_t push_slot_bytes(std::size_t capacity_bytes) {
  return slot_stride(capacity_bytes) < kPushSlotMax ? slot_stride(capacity_bytes) : kPushSlotMax;
}
inline constexpr std::size_t push_offset(std::size_t capacity_bytes) {
  return kSlotOffset + 2 * slot_stride(capacity_bytes);
}
inline constexpr std::size_t buffer_bytes(std::size_t capacity_bytes) {
  return push_offset(capacity_bytes) + 2 * push_slot_bytes(capacity_bytes);
}

}  // namespace nodecomm::cuda
