// tensor_call.h — Communicator.all_reduce's one native call (module nodecomm._c10d): an
// all-reduce of torch tensors through the rank's lane (../lane_api.h) on the path and wire the
// dispatch decides or the caller forced, the checks its Python made on every call done here, on the
// tensor's current stream. A call it does not take (another dtype, a tensor subclass, anything to
// complain about) is left to the Communicator's Python, which says what is wrong.
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../lane_api.h"

namespace nodecomm::c10d_backend {

namespace py = pybind11;

// nodecomm.v1.DType codes; 0: a dtype nodecomm does not reduce natively.
inline int dtype_code(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    default: return 0;
  }
}

// The lane's C ABI out of a Lane.api() capsule, checked to come from this build.
inline const NodecommLaneApi* lane_api_of(const py::capsule& capsule) {
  TORCH_CHECK(std::string(capsule.name()) == lane::kLaneCapsule, "nodecomm: not a lane capsule");
  const auto* api = capsule.get_pointer<const NodecommLaneApi>();
  TORCH_CHECK(api->version == lane::kLaneApiVersion, "nodecomm._native's lane ABI is version ", api->version,
              ", nodecomm._c10d expects ", lane::kLaneApiVersion,
              ": the two modules come from different builds; reinstall nodecomm");
  return api;
}

class TensorCall {
 public:
  // `api`, `address`: the lane's Lane.api(), kept alive by `lane`; `device`: the CUDA index of its
  // group, -1 for a CPU group; `dtypes`: the codes the group was formed for.
  TensorCall(const py::capsule& api, std::uintptr_t address, py::object lane, int device,
             const std::vector<int>& dtypes)
      : api_(lane_api_of(api)), address_(reinterpret_cast<void*>(address)), lane_(std::move(lane)), device_(device) {
    for (const int code : dtypes) {
      if (code > 0 && code < 32) dtypes_ |= 1u << code;
    }
  }

  // None: not taken. The output (`out`, or a new tensor where it is None): done. Otherwise
  // (outcome, output, error kind, message) for the Communicator to finish.
  py::object operator()(py::handle tensor, py::handle out, int forced, int wire) const {
    return call(tensor, out, forced, wire, -1, false);
  }

  // Communicator.accepts' answer for an exact tensor: one this group reduces, at most `max_bytes`
  // (-1: any size), of a size the table gives a path the lane runs. None for what Python answers
  // (a tensor subclass, or no tensor).
  py::object accepts(py::handle tensor, std::int64_t max_bytes) const {
    if (!THPVariable_CheckExact(tensor.ptr())) return py::none();
    return py::bool_(admits(THPVariable_Unpack(tensor.ptr()), max_bytes));
  }

  // An engine slot's call: as operator() with no `out`, and None (nothing run) for what accepts()
  // declines, so that a slot that answered "yes" first always runs the call.
  py::object slot(py::handle tensor, std::int64_t max_bytes) const {
    return call(tensor, py::none(), 0, -1, max_bytes, true);
  }

 private:
  py::object call(py::handle tensor, py::handle out, int forced, int wire, std::int64_t max_bytes, bool decline) const {
    if (!THPVariable_CheckExact(tensor.ptr()) || !(out.is_none() || THPVariable_CheckExact(out.ptr()))) {
      return py::none();
    }
    const at::Tensor& in = THPVariable_Unpack(tensor.ptr());
    if (decline ? !admits(in, max_bytes) : !takes(in)) return py::none();
    at::Tensor output;
    if (out.is_none()) {
      output = at::empty(in.sizes(), in.options());
    } else if (out.ptr() == tensor.ptr()) {
      output = in;
    } else {
      output = THPVariable_Unpack(out.ptr());
      if (!takes(output) || output.sizes() != in.sizes() || output.scalar_type() != in.scalar_type()) {
        return py::none();
      }
    }
    void* stream =
        device_ >= 0 ? c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(in.device()).native_handle() : nullptr;
    int kind = 0;
    char message[1024];
    message[0] = '\0';
    int outcome;
    {
      py::gil_scoped_release release;
      outcome = api_->all_reduce(address_, in.data_ptr(), output.data_ptr(), in.numel(), dtype_code(in), forced, wire,
                                 stream, &kind, message, sizeof message);
    }
    py::object result = out.is_none() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(output)))
                                      : py::reinterpret_borrow<py::object>(out);
    if (outcome == lane::kDone) return result;
    return py::make_tuple(outcome, result, kind, std::string(message));
  }

  // accepts()' answer: a tensor this group reduces, of at most `max_bytes` (-1: any), of a size the
  // table gives a path the lane runs.
  bool admits(const at::Tensor& tensor, std::int64_t max_bytes) const {
    const std::size_t nbytes = tensor.numel() * tensor.element_size();
    return takes(tensor) && (max_bytes < 0 || nbytes <= std::size_t(max_bytes)) && api_->accepts(address_, nbytes);
  }

  bool takes(const at::Tensor& tensor) const {
    const int code = dtype_code(tensor);
    if (code == 0 || !(dtypes_ & (1u << code)) || tensor.layout() != at::kStrided || !tensor.is_contiguous() ||
        tensor.numel() == 0) {
      return false;
    }
    return device_ < 0 ? tensor.is_cpu() : tensor.is_cuda() && tensor.device().index() == device_;
  }

  const NodecommLaneApi* api_;
  void* address_;
  py::object lane_;
  int device_;
  std::uint32_t dtypes_ = 0;
};

// An engine's custom all-reduce slot as two native calls, which NodecommAllreduce binds on its
// instance (the engines call them per all-reduce): should_custom_ar is TensorCall::accepts and
// custom_all_reduce TensorCall::slot, at the slot's max_bytes. What those leave to Python (a
// tensor subclass; a call that ran and is due a table switch, or that the lane decided for NCCL or
// the service path, or that failed) goes to the Communicator: accepts() and _slot_finish().
class EngineSlot {
 public:
  EngineSlot(py::object call, py::object communicator, std::int64_t max_bytes)
      : call_(call.cast<const TensorCall*>()), owner_(std::move(call)), communicator_(std::move(communicator)),
        max_bytes_(max_bytes) {}

  py::object should_custom_ar(py::handle tensor) const {
    py::object answer = call_->accepts(tensor, max_bytes_);
    if (!answer.is_none()) return answer;
    return communicator_.attr("accepts")(tensor, py::arg("max_bytes") = max_bytes_or_none());
  }

  py::object custom_all_reduce(py::handle tensor) const {
    py::object done = call_->slot(tensor, max_bytes_);
    if (!done.is_none() && THPVariable_CheckExact(done.ptr())) return done;
    return communicator_.attr("_slot_finish")(tensor, done, max_bytes_or_none());
  }

 private:
  py::object max_bytes_or_none() const {
    if (max_bytes_ < 0) return py::none();
    return py::int_(max_bytes_);
  }

  const TensorCall* call_;
  py::object owner_;  // keeps call_ alive
  py::object communicator_;
  std::int64_t max_bytes_;
};

}  // namespace nodecomm::c10d_backend
