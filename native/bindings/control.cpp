// control.cpp — the group's control segment (../control.h): the abort word, its reasons, the
// error records CUDA kernels leave, the captured-call counts, and the watch on them
// (../capture_watch.h).
#include <pybind11/native_enum.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <ctime>
#include <memory>
#include <string>

#include "capture_watch.h"
#include "control.h"

#include "bindings.h"

namespace py = pybind11;

namespace nodecomm::bindings {

namespace {

// The watch, stoppable before the Python object goes (close() stops it before Leave).
class CaptureWatchHandle {
 public:
  CaptureWatchHandle(std::uintptr_t control, int rank, std::string where, control::CapturedAbortPolicy policy)
      : watch_(std::make_unique<control::CaptureWatch>(control, rank, std::move(where), policy)) {}
  void stop() { watch_.reset(); }

 private:
  std::unique_ptr<control::CaptureWatch> watch_;
};

}  // namespace

void bind_control(py::module_& m) {
  namespace control = nodecomm::control;
  m.attr("CONTROL_BYTES") = control::kControlBytes;
  py::native_enum<control::AbortReason>(m, "AbortReason", "enum.IntEnum", "Why a group's abort word is set.")
      .value("NOT_ABORTED", control::kNotAborted)
      .value("PEER_LOST", control::kPeerLost)
      .value("DAEMON_LOST", control::kDaemonLost)
      .value("SHUTDOWN", control::kShutdown)
      .value("STALLED", control::kStalled)
      .value("PEER_LEFT", control::kPeerLeft)
      .value("MISMATCH", control::kMismatch)
      .finalize();
  py::native_enum<control::KernelError>(m, "KernelError", "enum.IntEnum", "The code of a rank's error record.")
      .value("NONE", control::kErrorNone)
      .value("TIMEOUT", control::kErrorTimeout)
      .value("ABORTED", control::kErrorAborted)
      .value("MISMATCH", control::kErrorMismatch)
      .finalize();
  m.def("abort_group", &control::abort_group, py::arg("control"), py::arg("reason"), py::arg("detail"),
        "Set the group's abort word at `control` unless it is already set (the first reason wins).");
  m.def(
      "wait_for_abort",
      [](std::uintptr_t address, double timeout_s) {
        py::gil_scoped_release release;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
        while (true) {
          const auto left = deadline - std::chrono::steady_clock::now();
          if (left <= std::chrono::nanoseconds(0)) return std::uint64_t(0);  // not woken in time
          const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
          const timespec wait{time_t(ns / 1000000000), long(ns % 1000000000)};
          if (control::wait_for_abort(address, &wait) != 0) return std::uint64_t(control::abort_state(address).first);
        }
      },
      py::arg("control"), py::arg("timeout_s"),
      "Sleep until the group at `control` aborts (a futex on its abort word, woken by whoever aborts it, "
      "in any process) or `timeout_s` passes; returns the abort reason, or 0 if not woken by then.");
  m.def("abort_state", &control::abort_state, py::arg("control"), "(reason, detail) of the abort word.");
  m.def(
      "abort_error",
      [](std::uintptr_t address, std::uint64_t reason, std::uint64_t detail) {
        const auto [kind, message] = control::abort_error(address, reason, detail);
        return py::make_tuple(int(kind), message);
      },
      py::arg("control"), py::arg("reason"), py::arg("detail"),
      "(error kind, message) a rank raises for this abort (pass them to error()): the one mapping, also "
      "the CPU transport's.");
  m.def(
      "error_record",
      [](std::uintptr_t address, int rank) {
        const control::ErrorRecord record = control::error_record(address, rank);
        return py::make_tuple(record.code, record.peer, record.epoch);
      },
      py::arg("control"), py::arg("rank"),
      "(code, rank waited for, barrier epoch) a CUDA kernel of `rank` recorded; code 0: none.");
  m.def("publish_offer", &control::publish_offer, py::arg("control"), py::arg("rank"), py::arg("point"),
        py::arg("epoch"), "Offer `epoch`, the newest table `rank` holds, at its `point`-th table switch point.");
  m.def(
      "lowest_offer",
      [](std::uintptr_t address, int world_size, std::uint64_t point, double timeout_s) {
        control::Offers offers;
        {
          py::gil_scoped_release release;
          const double ns = timeout_s > 0 ? timeout_s * 1e9 : 0;
          offers = control::lowest_offer(address, world_size, point, ns < 1.8e19 ? std::uint64_t(ns) : UINT64_MAX);
        }
        return py::make_tuple(int(offers.outcome), offers.lowest, offers.missing);
      },
      py::arg("control"), py::arg("world_size"), py::arg("point"), py::arg("timeout_s"),
      "(outcome, lowest epoch, a missing rank) of the ranks' offers at `point`: outcome 0 once every rank "
      "offered, 1 if the group aborted first, 2 past `timeout_s`.");
  m.def("record_captured", &control::record_captured, py::arg("control"), py::arg("rank"),
        "Count one call of `rank` that a CUDA graph holds (enqueued under capture).");
  m.def("captured_calls", &control::captured_calls, py::arg("control"), py::arg("rank"),
        "How many calls of `rank` CUDA graphs hold.");
  m.attr("CAPTURED_ABORT_EXIT_STATUS") = control::kCapturedAbortExit;
  py::native_enum<control::CapturedAbortPolicy>(m, "CapturedAbortPolicy", "enum.IntEnum",
                                                "What a rank does when its group aborts while graphs hold its calls.")
      .value("EXIT", control::CapturedAbortPolicy::kExit)
      .value("LOG", control::CapturedAbortPolicy::kLog)
      .finalize();
  py::class_<CaptureWatchHandle>(m, "CaptureWatch",
                                 "A thread that writes one line on stderr, and under EXIT ends the process, once the "
                                 "group at `control` aborts while `rank` has captured calls (native/capture_watch.h).")
      .def(py::init<std::uintptr_t, int, std::string, control::CapturedAbortPolicy>(), py::arg("control"),
           py::arg("rank"), py::arg("where"), py::arg("policy"))
      .def("stop", &CaptureWatchHandle::stop, py::call_guard<py::gil_scoped_release>(),
           "Stop watching (before this rank leaves); calling it again does nothing.");
  m.def("recorded_disagreement", &control::recorded_disagreement, py::arg("control"), py::arg("world_size"),
        "(message, complete): what the ranks' error records of a group aborted on a mismatch say (the "
        "field the ranks disagree on and each rank's value), and whether every rank's call is on record.");
}

}  // namespace nodecomm::bindings
