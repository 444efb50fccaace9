// layout.h — one rank's device buffer, as every CUDA path sees it (host and device code).
//
//   [0, 64)                       abort word (written by the daemon; 0 while the group is healthy)
//   [64, 128)                     error record: code, the rank waited for, the epoch (first error wins)
//   [128, +kMaxBlocks*16)         per block: launches (picks the slot) and barriers passed, both
//                                 advanced only by this rank's block
//   flags                         kMaxBlocks x kMaxRanks barrier epochs: block b of rank p stores
//                                 its epoch into flags[b][p] of every rank's buffer
//   slots                         two staging slots of slot_bytes each (rounded to 256)
#pragma once

#include <cstddef>
#include <cstdint>

namespace nodecomm::cuda {

constexpr int kMaxRanks = 16;
constexpr int kMaxBlocks = 64;
constexpr std::size_t kAbortOffset = 0;
constexpr std::size_t kErrorOffset = 64;
constexpr std::size_t kCounterOffset = 128;
constexpr std::size_t kFlagOffset = kCounterOffset + kMaxBlocks * 16;
constexpr std::size_t kSlotOffset = kFlagOffset + std::size_t(kMaxBlocks) * kMaxRanks * 8;

// Error codes in the error record.
constexpr std::uint64_t kErrorNone = 0;
constexpr std::uint64_t kErrorTimeout = 1;
constexpr std::uint64_t kErrorAborted = 2;

inline constexpr std::size_t slot_stride(std::size_t slot_bytes) { return (slot_bytes + 255) / 256 * 256; }
inline constexpr std::size_t buffer_bytes(std::size_t slot_bytes) { return kSlotOffset + 2 * slot_stride(slot_bytes); }

}  // namespace nodecomm::cuda
