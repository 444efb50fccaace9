// lane_api.h — the C ABI through which the c10d backend (c10d/backend.cpp, another module) calls a
// rank's all-reduce lane: HostLane (host_lane.h) or CudaLane (cuda/lane.h). Plain types only: no
// pybind11 or torch type crosses.
#pragma once

#include <cstddef>

namespace nodecomm::lane {

// What a lane call did. Everything but kDone leaves the rest to the caller's Python: a table
// switch, raising the reason (closed, aborted, an error), or running the call (service, NCCL).
enum Outcome : int {
  kDone = 0,        // ran; the output holds the sum
  kDoneSwitch = 1,  // ran, and the ranks are due to agree on the newest table now
  kUnusable = 2,    // not run: the lane is closed or the group aborted
  kService = 3,     // not run: decided (and counted as decided) for the service path
  kFailed = 4,      // the collective raised: error kind and message filled in
  kNccl = 5,        // not run: decided for the engine's NCCL group (all_reduce_rms_norm's norm runs apart)
  kProbe = 6,       // not run nor counted: a size to time in graphs before it is captured; call again
};

// What a lane decided for a call (nodecomm.v1 codes).
struct Taken {
  int path = 0, wire = 0;
};

constexpr int kLaneApiVersion = 7;
// nodecomm._native's HostLane.api() and CudaLane.api() return a PyCapsule of this name holding a
// NodecommLaneApi.
constexpr const char* kLaneCapsule = "nodecomm.LaneApi";

constexpr int kNcclApiVersion = 1;
// nodecomm._c10d's NcclRunner.api() returns a PyCapsule of this name holding a NodecommNccl.
constexpr const char* kNcclCapsule = "nodecomm.Nccl";

}  // namespace nodecomm::lane

extern "C" {
struct NodecommLaneApi {
  int version;  // kLaneApiVersion
  // An all-reduce of a contiguous buffer (in may equal out; forced: a path code, 0 for the table's;
  // wire: a wire code, -1 for the table's; stream: a cudaStream_t, or null on the CPU); returns an
  // Outcome. On kFailed, error_kind is a nodecomm::ErrorKind and message holds its text
  // (NUL-terminated).
  int (*all_reduce)(void* lane, void* in, void* out, std::size_t count, int dtype, int forced, int wire, void* stream,
                    int* error_kind, char* message, std::size_t message_bytes);
  // Nonzero where the table gives an all-reduce of `nbytes` a path this rank runs (the service
  // path, and NCCL where the rank runs it, included) and the lane is open: what an engine's custom
  // all-reduce slot asks first. Takes no lock: callers may hold the GIL.
  int (*accepts)(void* lane, std::size_t nbytes);
};

// The engine's NCCL group as a CUDA lane's NCCL path (nodecomm._c10d's NcclRunner): the lane
// decides, times and counts a call there as on its own paths, and this runs it: an all-reduce SUM
// in place on out, after copying in where they differ, on the caller's current stream (`stream`).
// Returns 0, or nonzero with error_kind (a nodecomm::ErrorKind) and message (NUL-terminated).
struct NodecommNccl {
  int version;  // kNcclApiVersion
  int (*all_reduce)(void* context, void* in, void* out, std::size_t count, int dtype, void* stream, int* error_kind,
                    char* message, std::size_t message_bytes);
  void* context;
};
}
