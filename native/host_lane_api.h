// host_lane_api.h — the C ABI through which the c10d backend (c10d/backend.cpp, another module)
// calls a CPU rank's HostLane (host_lane.h): plain types only, no pybind11 or torch type crosses.
#pragma once

#include <cstddef>

namespace nodecomm::host_lane {

// What a lane call did. Everything but kDone leaves the call to the caller's Python path, which
// raises the reason (closed, aborted) or submits the call to the daemon (service).
enum Outcome : int {
  kDone = 0,        // ran; the output holds the sum
  kDoneSwitch = 1,  // ran, and the ranks are due to agree on the newest table now
  kUnusable = 2,    // not run: the lane is closed or the group aborted
  kService = 3,     // not run: decided (and counted as decided) for the service path
  kFailed = 4,      // the collective raised: error kind and message filled in
};

constexpr int kHostLaneApiVersion = 1;
// nodecomm._native's HostLane.api() returns a PyCapsule of this name holding a NodecommHostLaneApi.
constexpr const char* kHostLaneCapsule = "nodecomm.HostLaneApi";

}  // namespace nodecomm::host_lane

extern "C" {
struct NodecommHostLaneApi {
  int version;  // kHostLaneApiVersion
  // A table-decided all-reduce of a contiguous buffer (in may equal out); returns an Outcome. On
  // kFailed, error_kind is a nodecomm::ErrorKind and message holds its text (NUL-terminated).
  int (*all_reduce)(void* lane, void* in, void* out, std::size_t count, int dtype, int* error_kind, char* message,
                    std::size_t message_bytes);
};
}
