// control.cpp — the group's control segment (../control.h): the abort word, its reasons, and the
// error records CUDA kernels leave.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "control.h"

#include "bindings.h"

namespace py = pybind11;

namespace nodecomm::bindings {

void bind_control(py::module_& m) {
  namespace control = nodecomm::control;
  m.attr("CONTROL_BYTES") = control::kControlBytes;
  m.attr("ABORT_PEER_LOST") = std::uint64_t(control::kPeerLost);
  m.attr("ABORT_DAEMON_LOST") = std::uint64_t(control::kDaemonLost);
  m.attr("ABORT_SHUTDOWN") = std::uint64_t(control::kShutdown);
  m.attr("ABORT_STALLED") = std::uint64_t(control::kStalled);
  m.attr("ABORT_PEER_LEFT") = std::uint64_t(control::kPeerLeft);
  m.attr("ERROR_TIMEOUT") = control::kErrorTimeout;
  m.attr("ERROR_ABORTED") = control::kErrorAborted;
  m.attr("ERROR_MISMATCH") = control::kErrorMismatch;
  m.attr("ABORT_MISMATCH") = std::uint64_t(control::kMismatch);
  m.def("abort_group", &control::abort_group, py::arg("control"), py::arg("reason"), py::arg("detail"),
        "Set the group's abort word at `control` unless it is already set (the first reason wins).");
  m.def("abort_state", &control::abort_state, py::arg("control"), "(reason, detail) of the abort word.");
  m.def(
      "error_record",
      [](std::uintptr_t address, int rank) {
        const control::ErrorRecord record = control::error_record(address, rank);
        return py::make_tuple(record.code, record.peer, record.epoch);
      },
      py::arg("control"), py::arg("rank"),
      "(code, rank waited for, barrier epoch) a CUDA kernel of `rank` recorded; code 0: none.");
  m.def("recorded_disagreement", &control::recorded_disagreement, py::arg("control"), py::arg("world_size"),
        "(message, complete): what the ranks' error records of a group aborted on a mismatch say (the "
        "field the ranks disagree on and each rank's value), and whether every rank's call is on record.");
}

}  // namespace nodecomm::bindings
