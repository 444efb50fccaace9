// lane_call.h — a lane's all-reduce as the C ABI of lane_api.h calls it: for HostLane and CudaLane
// alike, whose all_reduce takes the same arguments (a CPU lane ignores the stream).
#pragma once

#include <cstddef>
#include <cstdint>

#include "codes.h"
#include "errors.h"
#include "lane_api.h"

namespace nodecomm::lane {

template <typename Lane>
int c_all_reduce(void* lane, void* in, void* out, std::size_t count, int dtype, int forced, int wire, void* stream,
                 int* error_kind, char* message, std::size_t message_bytes) {
  return run_reporting(
      [&] {
        Taken taken;
        return static_cast<Lane*>(lane)->all_reduce(reinterpret_cast<std::uintptr_t>(in),
                                                    reinterpret_cast<std::uintptr_t>(out), count, dtype_of(dtype),
                                                    forced, wire, reinterpret_cast<std::uintptr_t>(stream), &taken);
      },
      kFailed, error_kind, message, message_bytes);
}

template <typename Lane>
int c_accepts(void* lane, std::size_t nbytes) {
  return static_cast<Lane*>(lane)->accepts(nbytes) ? 1 : 0;
}

template <typename Lane>
inline const NodecommLaneApi kLaneApi{kLaneApiVersion, &c_all_reduce<Lane>, &c_accepts<Lane>};

}  // namespace nodecomm::lane
