// host.cpp — the CPU transport (../shm.h) and the service path's host executor (../service.h).
#include <pybind11/native_enum.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>

#include "codes.h"
#include "dispatch.h"
#include "host_lane.h"
#include "rms_norm.h"
#include "service.h"
#include "shm.h"
#include "wire.h"

#include "bindings.h"
#include "lane.h"

namespace py = pybind11;

namespace nodecomm::bindings {

void bind_host(py::module_& m) {
  namespace shm = nodecomm::shm;
  m.attr("MAX_RANKS") = nodecomm::kMaxRanks;
  // The codes functions take as ints (nodecomm.v1's values), by name.
  py::native_enum<nodecomm::DType>(m, "DType", "enum.IntEnum", "Element types (nodecomm.v1.DType).")
      .value("FLOAT32", nodecomm::DType::kFloat32)
      .value("FLOAT16", nodecomm::DType::kFloat16)
      .value("BFLOAT16", nodecomm::DType::kBFloat16)
      .finalize();
  py::native_enum<nodecomm::Path>(m, "Path", "enum.IntEnum", "All-reduce paths (nodecomm.v1.Path).")
      .value("ONESHOT", nodecomm::Path::kOneshot)
      .value("TWOSHOT", nodecomm::Path::kTwoshot)
      .value("DMA", nodecomm::Path::kDma)
      .value("NCCL", nodecomm::Path::kNccl)
      .value("SERVICE", nodecomm::Path::kService)
      .finalize();
  py::native_enum<wire::Wire>(m, "Wire", "enum.IntEnum", "Wire formats of an all-reduce (nodecomm.v1.Wire).")
      .value("LOSSLESS", wire::Wire::kLossless)
      .value("INT8", wire::Wire::kInt8)
      .value("FP8", wire::Wire::kFp8)
      .finalize();
  py::native_enum<nodecomm::Collective>(m, "Collective", "enum.IntEnum",
                                        "What a rank's call is, as the ranks compare it.")
      .value("ALL_REDUCE", nodecomm::Collective::kAllReduce)
      .value("ALL_GATHER", nodecomm::Collective::kAllGather)
      .value("BARRIER", nodecomm::Collective::kBarrier)
      .value("TOPK_STAGE", nodecomm::Collective::kTopkStage)
      .value("ALL_REDUCE_RMS_NORM", nodecomm::Collective::kAllReduceRmsNorm)
      .finalize();
  m.def(
      "add_rms_norm",
      [](std::uintptr_t summed, std::uintptr_t residual, std::uintptr_t weight, std::uintptr_t out,
         std::uintptr_t residual_out, std::size_t rows, std::size_t hidden, float eps, int dtype) {
        const nodecomm::DType type = nodecomm::dtype_of(dtype);
        py::gil_scoped_release release;
        nodecomm::norm::add_rms_norm({summed, residual, weight, out, residual_out, rows, hidden, eps}, type);
      },
      py::arg("summed"), py::arg("residual"), py::arg("weight"), py::arg("output"), py::arg("residual_out"),
      py::arg("rows"), py::arg("hidden"), py::arg("eps"), py::arg("dtype"),
      "On host memory: residual_out = summed + residual, output = rms_norm(residual_out) * weight, in the order of "
      "nodecomm.rms_norm (output may be summed, residual_out may be residual).");
  m.def("shm_buffer_bytes", &shm::shm_buffer_bytes, py::arg("capacity_bytes"),
        "Bytes of one rank's CPU buffer (flags and two staging slots) for a slot capacity.");

  py::class_<shm::ShmGroup>(m, "ShmGroup",
                            "One rank's view of a CPU group: every rank's buffer mapped here, and the "
                            "epochs that order this rank's operations.")
      .def(py::init<int, int, std::vector<std::uintptr_t>, std::uintptr_t, std::size_t>(), py::arg("rank"),
           py::arg("world_size"), py::arg("buffers"), py::arg("control"), py::arg("capacity_bytes"))
      .def(
          "all_reduce",
          [](shm::ShmGroup& self, std::uintptr_t in, std::uintptr_t out, std::size_t count, int dtype,
             int path, double timeout_s, int wire) {
            const wire::Wire format = wire::wire_of(wire);
            py::gil_scoped_release release;
            self.all_reduce(in, out, count, nodecomm::dtype_of(dtype), nodecomm::kernel_path_of(path), timeout_s,
                            format);
          },
          py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("path"),
          py::arg("timeout_s"), py::arg("wire") = 0,
          "Sum `count` elements across ranks over a Wire format; output may equal input.")
      .def(
          "all_gather",
          [](shm::ShmGroup& self, std::uintptr_t in, std::uintptr_t out, std::size_t nbytes, double timeout_s) {
            py::gil_scoped_release release;
            self.all_gather(in, out, nbytes, timeout_s);
          },
          py::arg("input"), py::arg("output"), py::arg("nbytes"), py::arg("timeout_s"),
          "Rank r's `nbytes` land at output + r * nbytes on every rank.")
      .def(
          "barrier",
          [](shm::ShmGroup& self, double timeout_s, int collective, std::uint64_t count) {
            NODECOMM_CHECK(collective >= 1 && collective <= 5,
                           "unknown collective code " + std::to_string(collective) + ": expected a Collective");
            py::gil_scoped_release release;
            self.barrier(timeout_s, nodecomm::Call{nodecomm::Collective(collective), count});
          },
          py::arg("timeout_s"), py::arg("collective") = int(nodecomm::Collective::kBarrier), py::arg("count") = 0,
          "Every rank arrives with the same (collective, count), or all get GroupMismatchError.")
      .def_property_readonly("rank", &shm::ShmGroup::rank)
      .def_property_readonly("world_size", &shm::ShmGroup::world_size)
      .def_property_readonly("op_epoch", &shm::ShmGroup::op_epoch)
      .def_property_readonly("barrier_epoch", &shm::ShmGroup::barrier_epoch);

  py::class_<std::mutex>(m, "CallLock",
                         "The lock every collective of one communicator runs under, and close() takes "
                         "before the buffers go; `with lock:` waits with the GIL released.")
      .def(py::init<>())
      .def("__enter__",
           [](std::mutex& self) {
             py::gil_scoped_release release;
             self.lock();
           })
      .def("__exit__", [](std::mutex& self, const py::args&) { self.unlock(); });

  bind_lane<nodecomm::lane::HostLane, shm::ShmGroup>(
      m, "HostLane",
      "A CPU rank's all-reduce as one call: checks, decision, collective, sample, count (../host_lane.h). It holds "
      "the dispatch and lock it was made with; the group must outlive it until close().");

  namespace service = nodecomm::service;
  m.def(
      "service_all_reduce",
      [](std::vector<std::uintptr_t> inputs, std::vector<std::uintptr_t> outputs, std::size_t count, int dtype) {
        py::gil_scoped_release release;
        service::all_reduce(inputs, outputs, count, nodecomm::dtype_of(dtype));
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"),
      "The service path: every rank's output gets the sum of every rank's input (host addresses, rank order).");
  m.def(
      "service_all_gather",
      [](std::vector<std::uintptr_t> inputs, std::vector<std::uintptr_t> outputs, std::size_t nbytes) {
        py::gil_scoped_release release;
        service::all_gather(inputs, outputs, nbytes);
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("nbytes"),
      "The service path: rank r's nbytes land at outputs[q] + r * nbytes for every rank q.");
  m.def(
      "service_topk_stage",
      [](std::vector<std::uintptr_t> inputs, std::vector<std::uintptr_t> outputs, std::size_t rows,
         std::size_t topk) {
        py::gil_scoped_release release;
        service::topk_stage(inputs, outputs, rows, topk);
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("rows"), py::arg("topk"),
      "The service path's top-k owner exchange: each source's candidates into each owner's table.");
}

}  // namespace nodecomm::bindings
