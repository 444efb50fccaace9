// host_lane.h — one CPU rank's all-reduce as one native call: the usability checks, the path
// decision (dispatch.h), the shared-memory collective (shm.h), the timing sample and the count.
// The Python Communicator and the C++ torch.distributed backend (c10d/) both call it; the backend
// reaches it through the C ABI of lane_api.h (lane_call.h), so that it needs no pybind11 type of
// this module.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "codes.h"
#include "control.h"
#include "dispatch.h"
#include "errors.h"
#include "lane_api.h"
#include "rms_norm.h"
#include "shm.h"
#include "wire.h"

namespace nodecomm::lane {

// Every collective of one communicator runs under its CallLock, and close() takes it before the
// buffers are unmapped: a call runs with the GIL released, from any thread.
class HostLane {
 public:
  HostLane(shm::ShmGroup& group, dispatch::Dispatch& dispatch, std::uintptr_t control, double timeout_s,
           std::mutex& lock)
      : group_(group), dispatch_(dispatch), control_(control), timeout_s_(timeout_s), lock_(lock) {}

  // Called with the lock held, before the mappings go.
  void close() { closed_ = true; }

  // Whether the table gives an all-reduce of `nbytes` a path this lane runs, while it is open.
  // Without the call lock: callers hold the GIL, which a holder of the call lock may wait for.
  bool accepts(std::uint64_t nbytes) const {
    return !closed_.load(std::memory_order_acquire) && dispatch_.accepts(nbytes);
  }

  // Sum `count` elements of `dtype` from in into out (which may equal in) on the path and wire the
  // dispatch decides (forced: a path code or 0; forced_wire: a wire code or -1); `taken` says which.
  // No stream: the call runs on this thread (the argument matches CudaLane's, for lane_call.h).
  Outcome all_reduce(std::uintptr_t in, std::uintptr_t out, std::size_t count, DType dtype, int forced,
                     int forced_wire, std::uintptr_t /*stream*/, Taken* taken) {
    std::lock_guard<std::mutex> hold(lock_);
    if (closed_ || control::abort_state(control_).first != 0) return kUnusable;
    const std::uint64_t nbytes = count * dtype_bytes(dtype);
    const dispatch::Decision decision = dispatch_.decide(nbytes, forced, forced_wire, false);
    *taken = {int(decision.path), int(decision.wire)};
    if (decision.path == Path::kService) return kService;
    const auto start = std::chrono::steady_clock::now();
    try {
      group_.all_reduce(in, out, count, dtype, kernel_path_of(int(decision.path)), timeout_s_, decision.wire);
    } catch (...) {
      dispatch_.undo();
      throw;
    }
    if (decision.sampled)
      dispatch_.record(decision.path, decision.wire, nbytes,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    dispatch_.count(dispatch::kAllReduce, decision.path, decision.wire, nbytes,
                    wire::payload_bytes(decision.wire, count, dtype_bytes(dtype)));
    return dispatch_.switch_due(false) ? kDoneSwitch : kDone;
  }

  // all_reduce_rms_norm of `rows` on the forced path (a code, 0: the table's), neither explored nor
  // timed (dispatch.h's fixed_path): the all-reduce into out, the ranks comparing the shape, then
  // the add and norm (rms_norm.h). The service path is left to the caller, as for all_reduce.
  Outcome all_reduce_rms_norm(const norm::Rows& rows, DType dtype, int forced, std::uintptr_t /*stream*/,
                              Taken* taken) {
    rows.check();
    std::lock_guard<std::mutex> hold(lock_);
    if (closed_ || control::abort_state(control_).first != 0) return kUnusable;
    const std::uint64_t nbytes = rows.count() * dtype_bytes(dtype);
    const Path path = dispatch_.fixed_path(nbytes, forced, false);
    *taken = {int(path), int(wire::Wire::kLossless)};
    if (path == Path::kService) return kService;
    const Call call = rows.call(dtype, path);
    group_.all_reduce(rows.input, rows.out, rows.count(), dtype, kernel_path_of(int(path)), timeout_s_,
                      wire::Wire::kLossless, &call);
    norm::add_rms_norm(rows.summed(), dtype);
    dispatch_.count(dispatch::kAllReduce, path, wire::Wire::kLossless, nbytes, nbytes);
    return kDone;
  }

 private:
  shm::ShmGroup& group_;
  dispatch::Dispatch& dispatch_;
  std::uintptr_t control_;
  double timeout_s_;
  std::mutex& lock_;
  std::atomic<bool> closed_{false};
};

}  // namespace nodecomm::lane
