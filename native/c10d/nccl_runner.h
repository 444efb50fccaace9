// nccl_runner.h — the engine's NCCL group as a CUDA lane's NCCL path (../lane_api.h's
// NodecommNccl): what the table gives NCCL, the lane decides, times with its events and counts
// as it does its own paths, and this runs through the torch.distributed group the rank connected
// with (connect(nccl_group=...)), torch's own backend for it enqueuing behind the caller's
// current stream and making that stream wait. No Python on the way.
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "../errors.h"
#include "../lane_api.h"

namespace nodecomm::c10d_backend {

class NcclRunner {
 public:
  // `group`: the engine's group over the same ranks; `device`: the CUDA index of the lane's group.
  NcclRunner(c10::intrusive_ptr<::c10d::ProcessGroup> group, int device)
      : group_(std::move(group)), device_(device), api_{lane::kNcclApiVersion, &NcclRunner::all_reduce, this} {}
  NcclRunner(const NcclRunner&) = delete;
  NcclRunner& operator=(const NcclRunner&) = delete;
  // The group may go with the last reference (gloo joins its threads): never under the GIL, as
  // torch's own holders of process groups make sure.
  ~NcclRunner() {
    if (PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      group_.reset();
    }
  }

  const NodecommNccl* api() const { return &api_; }

 private:
  static int all_reduce(void* context, void* in, void* out, std::size_t count, int dtype, void* stream, int* error_kind,
                        char* message, std::size_t message_bytes) {
    auto* self = static_cast<NcclRunner*>(context);
    const auto failed = [&](ErrorKind kind, const char* what) {
      *error_kind = int(kind);
      std::snprintf(message, message_bytes, "the NCCL group's all-reduce failed: %s", what);
      return 1;
    };
    try {
      self->run(in, out, count, dtype, stream);
      return 0;
    } catch (const Error& error) {
      return failed(error.kind, error.what());
    } catch (const c10::DistBackendError& error) {  // a peer's NCCL failed or timed out
      return failed(ErrorKind::kPeerLost, error.what_without_backtrace());
    } catch (const c10::Error& error) {
      return failed(ErrorKind::kInternal, error.what_without_backtrace());
    } catch (const std::exception& error) {
      return failed(ErrorKind::kInternal, error.what());
    } catch (...) {
      return failed(ErrorKind::kInternal, "an unknown exception");
    }
  }

  void run(void* in, void* out, std::size_t count, int dtype, void* stream) const {
    // torch's backend orders the call after the current stream's work and makes it wait, so the
    // lane's stream must be the current one (every caller passes it: TensorCall, the backend,
    // Transport.stream()).
    const c10::Device device(c10::kCUDA, c10::DeviceIndex(device_));
    NODECOMM_ASSERT(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle() == stream,
                    "an NCCL all-reduce was asked for on a stream other than the current one");
    const auto options = at::TensorOptions().dtype(scalar_type(dtype)).device(device);
    const std::vector<std::int64_t> shape{std::int64_t(count)};
    // target_device: no pointer query per call to find the device.
    const auto wrap = [&](void* data) {
      return at::for_blob(data, shape).options(options).target_device(device).make_tensor();
    };
    std::vector<at::Tensor> tensors{wrap(out)};
    if (in != out) tensors[0].copy_(wrap(in));
    ::c10d::AllreduceOptions synchronous;  // as dist.all_reduce(async_op=False): ordered on the stream
    synchronous.asyncOp = false;
    group_->allreduce(tensors, synchronous)->wait();
  }

  static at::ScalarType scalar_type(int dtype) {  // nodecomm.v1.DType codes
    switch (dtype) {
      case 1: return at::kFloat;
      case 2: return at::kHalf;
      case 3: return at::kBFloat16;
      default: NODECOMM_RAISE(kInvalidArgument, "dtype code " + std::to_string(dtype) + " on the NCCL path");
    }
  }

  c10::intrusive_ptr<::c10d::ProcessGroup> group_;
  int device_;
  NodecommNccl api_;
};

}  // namespace nodecomm::c10d_backend
