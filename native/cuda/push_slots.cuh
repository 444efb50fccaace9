// push_slots.cuh — the lines the push variant of oneshot writes into its peers' push slots
// (layout.h), which the barriers also look at: a line where a barrier was expected is a sign that
// the peer pushes in this launch, that is, makes another call.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives.h"
#include "layout.h"

namespace nodecomm::cuda {

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

// Where the push variant of oneshot puts its lines: `stride` bytes per slot from `at`, two slots by
// launch parity, `part` bytes of each for every source rank.
struct PushSlots {
  std::size_t at, stride, part;
};

__device__ __forceinline__ PushLine* pushed_lines(std::uint8_t* buffer, const PushSlots& push, std::uint64_t launch,
                                                  int source) {
  return reinterpret_cast<PushLine*>(buffer + push.at + (launch & 1) * push.stride + std::size_t(source) * push.part);
}

// Bytes of each rank's part of a push slot.
inline std::size_t push_part_bytes(const GroupView& group) {
  return push_slot_bytes(group.capacity_bytes) / std::size_t(group.world_size) / sizeof(PushLine) * sizeof(PushLine);
}

inline PushSlots push_slots(const GroupView& group) {
  return PushSlots{push_offset(group.capacity_bytes), push_slot_bytes(group.capacity_bytes), push_part_bytes(group)};
}

}  // namespace nodecomm::cuda
