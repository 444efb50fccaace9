// lane.h — one CUDA rank's all-reduce as one native call on the caller's stream: the usability
// checks, the capture check, the path decision (../dispatch.h), the enqueue (group.h), the timing
// sample (CUDA events, read back on a later call) and the count, for the engine's NCCL group
// (../lane_api.h's NodecommNccl) as for nodecomm's own paths. The Python Communicator and the C++
// torch.distributed backend both call it (the backend through ../lane_api.h).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>

#include "../codes.h"
#include "../control.h"
#include "../dispatch.h"
#include "../errors.h"
#include "../lane_api.h"
#include "../rms_norm.h"
#include "../wire.h"
#include "driver.h"
#include "group.h"

namespace nodecomm::lane {

class CudaLane {
 public:
  CudaLane(cuda::CudaGroup& group, dispatch::Dispatch& dispatch, std::uintptr_t control, double timeout_s,
           std::mutex& lock)
      : group_(group), dispatch_(dispatch), control_(control), timeout_s_(timeout_s), lock_(lock) {
    cuda::DeviceScope scope(group_.device());
    for (Timing& timing : timings_) {
      NODECOMM_CUDA(cudaEventCreate(&timing.start));
      NODECOMM_CUDA(cudaEventCreate(&timing.end));
    }
  }
  ~CudaLane() { release(); }
  CudaLane(const CudaLane&) = delete;
  CudaLane& operator=(const CudaLane&) = delete;

  // Called with the lock held, before the mappings go.
  void close() {
    closed_ = true;
    release();
  }

  // The engine's NCCL group, which runs the calls decided for NCCL; set once, before any call, by a
  // group connected with one (its owner outlives this lane).
  void set_nccl(const NodecommNccl& nccl) {
    NODECOMM_CHECK(nccl.version == kNcclApiVersion && nccl.all_reduce != nullptr,
                   "an NCCL runner of NCCL ABI version " + std::to_string(nccl.version) + ", expected " +
                       std::to_string(kNcclApiVersion) + ": nodecomm._native and nodecomm._c10d come from different "
                       "builds; reinstall nodecomm");
    std::lock_guard<std::mutex> hold(lock_);
    nccl_ = nccl;
  }

  // Whether the table gives an all-reduce of `nbytes` a path this lane runs, while it is open.
  // Without the call lock: callers hold the GIL, which a holder of the call lock may wait for.
  bool accepts(std::uint64_t nbytes) const {
    return !closed_.load(std::memory_order_acquire) && dispatch_.accepts(nbytes);
  }

  // Enqueue on `stream` an all-reduce of `count` elements from in into out (which may equal in) on
  // the path and wire the dispatch decides (forced: a path code or 0; forced_wire: a wire code or
  // -1); `taken` says which. A group a mismatch stopped is left to the group, which records this
  // call before it raises GroupMismatchError.
  Outcome all_reduce(std::uintptr_t in, std::uintptr_t out, std::size_t count, DType dtype, int forced,
                     int forced_wire, std::uintptr_t stream, Taken* taken) {
    std::lock_guard<std::mutex> hold(lock_);
    if (closed_) return kUnusable;  // before the control page is read: a closed lane's is unmapped
    const std::uint64_t reason = control::abort_state(control_).first;
    if (reason != 0 && reason != control::kMismatch) return kUnusable;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    NODECOMM_CUDA(cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    const std::uint64_t nbytes = count * dtype_bytes(dtype);
    if (dispatch_.probe_due(nbytes, forced, forced_wire, capturing)) {
      *taken = {int(dispatch_.table().path_for(nbytes)), int(wire::Wire::kLossless)};
      return kProbe;
    }
    const dispatch::Decision decision = dispatch_.decide(nbytes, forced, forced_wire, capturing);
    *taken = {int(decision.path), int(decision.wire)};
    if (decision.path == Path::kService) return kService;
    NODECOMM_ASSERT(decision.path != Path::kNccl || nccl_.all_reduce != nullptr,
                    "an all-reduce was decided for NCCL on a lane with no NCCL group");
    if (!capturing) read_timings();  // nothing is queried while a graph is being captured
    Timing* timing = decision.sampled && !capturing && pending_.size() < kTimings ? &timings_[next_] : nullptr;
    const auto on = reinterpret_cast<cudaStream_t>(stream);
    if (timing) NODECOMM_CUDA(cudaEventRecord(timing->start, on));
    if (decision.path == Path::kNccl) {
      run_nccl(in, out, count, dtype, stream);
    } else {
      group_.all_reduce(in, out, count, dtype, kernel_path_of(int(decision.path)), int(decision.wire), timeout_s_,
                        stream);
    }
    if (capturing) control::record_captured(control_, group_.rank());
    if (timing) {
      NODECOMM_CUDA(cudaEventRecord(timing->end, on));
      timing->path = decision.path;
      timing->wire = decision.wire;
      timing->nbytes = nbytes;
      pending_.push_back(next_);
      next_ = (next_ + 1) % kTimings;
    }
    dispatch_.count(dispatch::kAllReduce, decision.path, decision.wire, nbytes,
                    wire::payload_bytes(decision.wire, count, dtype_bytes(dtype)));
    return dispatch_.switch_due(capturing) ? kDoneSwitch : kDone;
  }

  // Enqueue on `stream` an all_reduce_rms_norm of `rows` on the forced path (a code, 0: the
  // table's), neither explored nor timed (../dispatch.h's fixed_path); `taken` says the path. The
  // service path and NCCL (kService, kNccl: the caller runs the all-reduce, then the norm) and a
  // probe before capture are left to the caller.
  Outcome all_reduce_rms_norm(const norm::Rows& rows, DType dtype, int forced, std::uintptr_t stream, Taken* taken) {
    std::lock_guard<std::mutex> hold(lock_);
    if (closed_) return kUnusable;  // before the control page is read: a closed lane's is unmapped
    const std::uint64_t reason = control::abort_state(control_).first;
    if (reason != 0 && reason != control::kMismatch) return kUnusable;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    NODECOMM_CUDA(cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &capture));
    const std::uint64_t nbytes = rows.count() * dtype_bytes(dtype);
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    if (dispatch_.probe_due(nbytes, forced, -1, capturing)) {  // probed as an all-reduce of its size
      *taken = {int(dispatch_.table().path_for(nbytes)), int(wire::Wire::kLossless)};
      return kProbe;
    }
    const Path path = dispatch_.fixed_path(nbytes, forced, capturing);
    *taken = {int(path), int(wire::Wire::kLossless)};
    if (path == Path::kService) return kService;
    if (path == Path::kNccl) return kNccl;
    group_.all_reduce_rms_norm(rows, dtype, path, timeout_s_, stream);
    if (capturing) control::record_captured(control_, group_.rank());
    dispatch_.count(dispatch::kAllReduce, path, wire::Wire::kLossless, nbytes, nbytes);
    return kDone;
  }

 private:
  // Sampled calls in flight, more are not timed: room for a bucket's first calls under a new
  // table, which are all timed (dispatch.h), when the host runs far ahead of the GPU.
  static constexpr std::size_t kTimings = 64;

  struct Timing {
    cudaEvent_t start = nullptr, end = nullptr;
    Path path = Path::kOneshot;
    wire::Wire wire = wire::Wire::kLossless;
    std::uint64_t nbytes = 0;
  };

  // The calling thread's stream capture mode relaxed for a scope: while another thread captures a
  // graph in global mode (torch's default), an eager call's event queries are refused otherwise,
  // and the refused query breaks that capture.
  class RelaxedCapture {
   public:
    RelaxedCapture() { NODECOMM_CUDA(cudaThreadExchangeStreamCaptureMode(&mode_)); }
    ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }  // back to the thread's own
    RelaxedCapture(const RelaxedCapture&) = delete;
    RelaxedCapture& operator=(const RelaxedCapture&) = delete;

   private:
    cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  };

  void run_nccl(std::uintptr_t in, std::uintptr_t out, std::size_t count, DType dtype, std::uintptr_t stream) {
    int kind = 0;
    char message[1024];
    message[0] = '\0';
    if (nccl_.all_reduce(nccl_.context, reinterpret_cast<void*>(in), reinterpret_cast<void*>(out), count, int(dtype),
                         reinterpret_cast<void*>(stream), &kind, message, sizeof message) != 0) {
      throw Error(ErrorKind(kind), message);
    }
  }

  // The sampled calls that have finished, oldest first, to the dispatch's samples.
  void read_timings() {
    if (pending_.empty()) return;
    const RelaxedCapture relaxed;
    while (!pending_.empty()) {
      Timing& timing = timings_[pending_.front()];
      const cudaError_t done = cudaEventQuery(timing.end);
      if (done == cudaErrorNotReady) {
        (void)cudaGetLastError();  // not an error: not left for torch's next launch check to raise
        return;
      }
      NODECOMM_CUDA(done);
      float ms = 0;
      NODECOMM_CUDA(cudaEventElapsedTime(&ms, timing.start, timing.end));
      dispatch_.record(timing.path, timing.wire, timing.nbytes, ms / 1e3);
      pending_.pop_front();
    }
  }

  void release() {
    for (Timing& timing : timings_) {
      if (timing.start) cudaEventDestroy(timing.start);
      if (timing.end) cudaEventDestroy(timing.end);
      timing.start = timing.end = nullptr;
    }
    pending_.clear();
  }

  cuda::CudaGroup& group_;
  dispatch::Dispatch& dispatch_;
  std::uintptr_t control_;
  double timeout_s_;
  std::mutex& lock_;
  std::atomic<bool> closed_{false};
  std::array<Timing, kTimings> timings_{};
  std::deque<std::size_t> pending_;  // indices into timings_, oldest first
  std::size_t next_ = 0;
  NodecommNccl nccl_{};  // all_reduce null: no NCCL group
};

}  // namespace nodecomm::lane
