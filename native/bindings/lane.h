// lane.h — the binding of a lane (../host_lane.h, ../cuda/lane.h): one template for both, whose
// all_reduce takes the same arguments and whose api() hands the c10d backend ../lane_api.h's ABI.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "codes.h"
#include "dispatch.h"
#include "lane_api.h"
#include "lane_call.h"
#include "rms_norm.h"

namespace nodecomm::bindings {

template <typename Lane, typename Group>
pybind11::class_<Lane> bind_lane(pybind11::module_& m, const char* name, const char* doc) {
  namespace py = pybind11;
  namespace lane = nodecomm::lane;
  return py::class_<Lane>(m, name, doc)
      .def(py::init<Group&, nodecomm::dispatch::Dispatch&, std::uintptr_t, double, std::mutex&>(), py::arg("group"),
           py::arg("dispatch"), py::arg("control"), py::arg("timeout_s"), py::arg("lock"), py::keep_alive<1, 3>(),
           py::keep_alive<1, 6>())
      .def(
          "all_reduce",
          [](Lane& self, std::uintptr_t in, std::uintptr_t out, std::size_t count, int dtype, int forced, int wire,
             std::uintptr_t stream) {
            const nodecomm::DType type = nodecomm::dtype_of(dtype);
            lane::Taken taken;
            lane::Outcome outcome;
            {
              py::gil_scoped_release release;
              outcome = self.all_reduce(in, out, count, type, forced, wire, stream, &taken);
            }
            return py::make_tuple(int(outcome), taken.path, taken.wire);
          },
          py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("forced") = 0,
          py::arg("wire") = -1, py::arg("stream") = 0,
          "(outcome, path, wire) of an all-reduce on the path and wire the dispatch decides (forced: a path "
          "code, 0: the table's; wire: a wire code, -1: the table's), on `stream` (a CUDA lane's; 0 on the CPU). "
          "Outcomes (../lane_api.h): 0 done, 1 done and a table switch is due, 2 not run (closed or aborted), 3 not "
          "run (decided for the service path), 6 not run (a size "
          "to probe in graphs before it is captured: Communicator.capture()).")
      .def(
          "all_reduce_rms_norm",
          [](Lane& self, std::uintptr_t in, std::uintptr_t residual, std::uintptr_t weight, std::uintptr_t out,
             std::uintptr_t residual_out, std::size_t rows, std::size_t hidden, float eps, int dtype, int forced,
             std::uintptr_t stream) {
            const nodecomm::DType type = nodecomm::dtype_of(dtype);
            const nodecomm::norm::Rows norm_rows{in, residual, weight, out, residual_out, rows, hidden, eps};
            lane::Taken taken;
            lane::Outcome outcome;
            {
              py::gil_scoped_release release;
              outcome = self.all_reduce_rms_norm(norm_rows, type, forced, stream, &taken);
            }
            return py::make_tuple(int(outcome), taken.path);
          },
          py::arg("input"), py::arg("residual"), py::arg("weight"), py::arg("output"), py::arg("residual_out"),
          py::arg("rows"), py::arg("hidden"), py::arg("eps"), py::arg("dtype"), py::arg("forced") = 0,
          py::arg("stream") = 0,
          "(outcome, path) of an all-reduce of input into output followed by residual_out = output + residual and "
          "output = rms_norm(residual_out) * weight (../rms_norm.h), on the forced path (a code, 0: the table's), "
          "untimed; outcomes as all_reduce's, and 5: not run (decided for the engine's NCCL group: the caller "
          "runs the all-reduce, then the norm).")
      .def("close", &Lane::close, "No call runs after this one (call it holding the lock).")
      .def(
          "api",
          [](Lane& self) {
            return py::make_tuple(py::capsule(static_cast<const void*>(&lane::kLaneApi<Lane>), lane::kLaneCapsule),
                                  reinterpret_cast<std::uintptr_t>(&self));
          },
          "(capsule of the C ABI, this lane's address) for the c10d backend, which keeps this object alive.");
}

}  // namespace nodecomm::bindings
