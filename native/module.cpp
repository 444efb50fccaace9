// module.cpp — the one pybind11 module, nodecomm._native. Functions take addresses, element
// counts, dtype codes and ranks as Python ints (no torch types), so the daemon loads it without
// torch. Native errors become the classes of nodecomm.errors.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "errors.h"

namespace py = pybind11;
using nodecomm::Error;
using nodecomm::ErrorKind;

namespace {

const char* python_error_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "InvalidArgumentError";
    case ErrorKind::kDeadlineExceeded: return "DeadlineExceededError";
    case ErrorKind::kPeerLost: return "PeerLostError";
    case ErrorKind::kDaemonUnavailable: return "DaemonUnavailableError";
    case ErrorKind::kResourceExhausted: return "ResourceExhaustedError";
    case ErrorKind::kInternal: return "InternalError";
    case ErrorKind::kGroupMismatch: return "GroupMismatchError";
  }
  return "InternalError";
}

py::object python_error(ErrorKind kind, const std::string& message) {
  return py::module_::import("nodecomm.errors").attr(python_error_name(kind))(message);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "nodecomm native transports (CPU shared memory; CUDA where built with it)";

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const Error& error) {
      py::object instance = python_error(error.kind, error.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(instance.ptr())), instance.ptr());
    }
  });

  m.def(
      "error",
      [](int kind, const std::string& message) {
        NODECOMM_CHECK(kind >= 0 && kind <= int(ErrorKind::kGroupMismatch), "unknown error kind " + std::to_string(kind));
        return python_error(ErrorKind(kind), message);
      },
      py::arg("kind"), py::arg("message"),
      "The nodecomm.errors exception of a native error kind (what the C ABI's callers get back).");

  nodecomm::bindings::bind_control(m);
  nodecomm::bindings::bind_host(m);
  nodecomm::bindings::bind_dispatch(m);
#ifdef NODECOMM_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  nodecomm::bindings::bind_cuda_memory(m);
  nodecomm::bindings::bind_cuda_group(m);
  nodecomm::bindings::bind_cuda_service(m);
#else
  m.attr("WITH_CUDA") = false;
#endif
  nodecomm::bindings::bind_capabilities(m);
}
