// module.cpp — the one pybind11 module, nodecomm._native. Functions take addresses, element
// counts, dtype codes and ranks as Python ints (no torch types), so the daemon loads it without
// torch. Native errors become the classes of nodecomm.errors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "errors.h"
#include "shm.h"

#ifdef NODECOMM_WITH_CUDA
#include "cuda/all_reduce.h"
#include "cuda/devices.h"
#include "cuda/layout.h"
#include "cuda/vmm.h"
#endif

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
  }
  return "InternalError";
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "nodecomm native transports (CPU shared memory; CUDA where built with it)";

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const Error& error) {
      py::object cls = py::module_::import("nodecomm.errors").attr(python_error_name(error.kind));
      py::object instance = cls(error.what());
      PyErr_SetObject(cls.ptr(), instance.ptr());
    }
  });

  namespace shm = nodecomm::shm;
  m.attr("SHM_MAX_RANKS") = shm::kMaxRanks;
  m.attr("SHM_CONTROL_BYTES") = shm::kControlBytes;
  m.attr("ABORT_PEER_LOST") = std::uint64_t(shm::kPeerLost);
  m.attr("ABORT_DAEMON_LOST") = std::uint64_t(shm::kDaemonLost);
  m.attr("ABORT_SHUTDOWN") = std::uint64_t(shm::kShutdown);
  m.attr("ABORT_STALLED") = std::uint64_t(shm::kStalled);
  m.attr("ABORT_PEER_LEFT") = std::uint64_t(shm::kPeerLeft);
  m.def("shm_buffer_bytes", &shm::shm_buffer_bytes, py::arg("slot_bytes"),
        "Bytes of one rank's CPU buffer (flags and two staging slots) for a slot capacity.");
  m.def("abort_group", &shm::abort_group, py::arg("control"), py::arg("reason"), py::arg("detail"),
        "Set the group's abort word at `control` unless it is already set (the first reason wins).");
  m.def("abort_state", &shm::abort_state, py::arg("control"), "(reason, detail) of the abort word.");

  py::class_<shm::ShmGroup>(m, "ShmGroup",
                            "One rank's view of a CPU group: every rank's buffer mapped here, and the "
                            "epochs that order this rank's operations.")
      .def(py::init<int, int, std::vector<std::uintptr_t>, std::uintptr_t, std::size_t>(), py::arg("rank"),
           py::arg("world_size"), py::arg("buffers"), py::arg("control"), py::arg("slot_bytes"))
      .def(
          "all_reduce",
          [](shm::ShmGroup& self, std::uintptr_t in, std::uintptr_t out, std::size_t count, int dtype,
             int algorithm, double timeout_s) {
            py::gil_scoped_release release;
            self.all_reduce(in, out, count, nodecomm::DType(dtype), shm::Algorithm(algorithm), timeout_s);
          },
          py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("algorithm"),
          py::arg("timeout_s"), "Sum `count` elements across ranks; output may equal input.")
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
          [](shm::ShmGroup& self, double timeout_s) {
            py::gil_scoped_release release;
            self.barrier(timeout_s);
          },
          py::arg("timeout_s"))
      .def_property_readonly("rank", &shm::ShmGroup::rank)
      .def_property_readonly("world_size", &shm::ShmGroup::world_size)
      .def_property_readonly("op_epoch", &shm::ShmGroup::op_epoch)
      .def_property_readonly("barrier_epoch", &shm::ShmGroup::barrier_epoch);

#ifdef NODECOMM_WITH_CUDA
  namespace cuda = nodecomm::cuda;
  m.attr("WITH_CUDA") = true;
  m.def("cuda_device_uuids", &cuda::device_uuids, "UUIDs of the visible GPUs in CUDA index order.");
  m.def(
      "cuda_vmm_allocate",
      [](int device, std::size_t bytes) {
        cuda::VmmMapping mapping;
        {
          py::gil_scoped_release release;
          mapping = cuda::vmm_allocate(device, bytes);
        }
        return py::make_tuple(mapping.fd, mapping.address, mapping.size);
      },
      py::arg("device"), py::arg("bytes"),
      "Allocate zeroed device memory exportable as a descriptor: (fd, address, size rounded up).");
  m.def(
      "cuda_vmm_import",
      [](int fd, std::size_t size, int device) {
        py::gil_scoped_release release;
        return cuda::vmm_import(fd, size, device);
      },
      py::arg("fd"), py::arg("size"), py::arg("device"), "Map another process's exported allocation here.");
  m.def("cuda_vmm_unmap", &cuda::vmm_unmap, py::arg("address"), py::arg("size"));
  m.def("cuda_vmm_rounded_size", &cuda::vmm_rounded_size, py::arg("device"), py::arg("bytes"));
  m.def("cuda_buffer_bytes", &cuda::buffer_bytes, py::arg("slot_bytes"),
        "Bytes of one rank's CUDA buffer (abort word, error record, epochs, flags, two slots).");
  m.def(
      "cuda_all_reduce",
      [](const std::vector<std::uintptr_t>& buffers, int rank, std::size_t slot_bytes, std::uintptr_t input,
         std::uintptr_t output, std::size_t count, int dtype, int algorithm, double timeout_s, std::uintptr_t stream) {
        py::gil_scoped_release release;
        cuda::all_reduce(buffers.data(), int(buffers.size()), rank, slot_bytes, input, output, count, dtype,
                         cuda::Algorithm(algorithm), timeout_s, stream);
      },
      py::arg("buffers"), py::arg("rank"), py::arg("slot_bytes"), py::arg("input"), py::arg("output"),
      py::arg("count"), py::arg("dtype"), py::arg("algorithm"), py::arg("timeout_s"), py::arg("stream"),
      "Enqueue a oneshot (1) or twoshot (2) all-reduce on `stream` (graph-capturable).");
  m.def(
      "cuda_read_error",
      [](std::uintptr_t buffer) {
        std::uint64_t record[3];
        {
          py::gil_scoped_release release;
          cuda::read_error(buffer, record);
        }
        return py::make_tuple(record[0], record[1], record[2]);
      },
      py::arg("buffer"), "(code, rank waited for, epoch) of this rank's error record; synchronises the device.");
#else
  m.attr("WITH_CUDA") = false;
#endif
}
