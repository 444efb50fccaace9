// module.cpp — the one pybind11 module, nodecomm._native. Functions take addresses, element
// counts, dtype codes and ranks as Python ints (no torch types), so the daemon loads it without
// torch. Native errors become the classes of nodecomm.errors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "control.h"
#include "errors.h"
#include "service.h"
#include "shm.h"

#ifdef NODECOMM_WITH_CUDA
#include "cuda/devices.h"
#include "cuda/group.h"
#include "cuda/ipc_legacy.h"
#include "cuda/layout.h"
#include "cuda/service.h"
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
    case ErrorKind::kGroupMismatch: return "GroupMismatchError";
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

  namespace shm = nodecomm::shm;
  m.attr("MAX_RANKS") = nodecomm::kMaxRanks;
  m.attr("COLLECTIVE_TOPK_STAGE") = int(nodecomm::Collective::kTopkStage);
  m.def("shm_buffer_bytes", &shm::shm_buffer_bytes, py::arg("slot_bytes"),
        "Bytes of one rank's CPU buffer (flags and two staging slots) for a slot capacity.");

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
            self.all_reduce(in, out, count, nodecomm::dtype_of(dtype), nodecomm::algorithm_of(algorithm), timeout_s);
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
          [](shm::ShmGroup& self, double timeout_s, int collective, std::uint64_t count) {
            py::gil_scoped_release release;
            self.barrier(timeout_s, nodecomm::Call{nodecomm::Collective(collective), count});
          },
          py::arg("timeout_s"), py::arg("collective") = int(nodecomm::Collective::kBarrier), py::arg("count") = 0,
          "Every rank arrives with the same (collective, count), or all get GroupMismatchError.")
      .def_property_readonly("rank", &shm::ShmGroup::rank)
      .def_property_readonly("world_size", &shm::ShmGroup::world_size)
      .def_property_readonly("op_epoch", &shm::ShmGroup::op_epoch)
      .def_property_readonly("barrier_epoch", &shm::ShmGroup::barrier_epoch);

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

#ifdef NODECOMM_WITH_CUDA
  namespace cuda = nodecomm::cuda;
  m.attr("WITH_CUDA") = true;
  m.def("cuda_device_uuids", &cuda::device_uuids, "UUIDs of the visible GPUs in CUDA index order.");
  m.def(
      "cuda_devices",
      [] {
        py::list out;
        for (const auto& d : cuda::device_infos()) {
          py::dict info;
          info["uuid"] = d.uuid;
          info["name"] = d.name;
          info["pci_bus_id"] = d.pci_bus_id;
          info["multiprocessors"] = d.multiprocessors;
          info["memory_bytes"] = d.memory_bytes;
          out.append(info);
        }
        return out;
      },
      "The visible GPUs in CUDA index order: uuid, name, pci_bus_id, multiprocessors, memory_bytes.");
  m.def(
      "cuda_peer_links",
      [] {
        py::list rows;
        for (const auto& row : cuda::peer_links()) {
          py::list cells;
          for (const auto& link : row) cells.append(py::make_tuple(link.access, link.native_atomics, link.performance_rank));
          rows.append(cells);
        }
        return rows;
      },
      "links[i][j] = (peer access, native atomics, performance rank) of GPU i to GPU j's memory.");
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
  m.def(
      "cuda_ipc_allocate",
      [](int device, std::size_t bytes) {
        cuda::LegacyAllocation made;
        {
          py::gil_scoped_release release;
          made = cuda::ipc_allocate(device, bytes);
        }
        return py::make_tuple(made.address, py::bytes(made.handle));
      },
      py::arg("device"), py::arg("bytes"),
      "Zeroed device memory and its cudaIpcMemHandle bytes (the fallback to VMM descriptors).");
  m.def("cuda_ipc_free", &cuda::ipc_free, py::call_guard<py::gil_scoped_release>(), py::arg("device"),
        py::arg("address"), "cudaFree: it waits for the whole device, so call it off the event loop.");
  m.def(
      "cuda_ipc_open",
      [](py::bytes handle, int device) {
        const std::string bytes(handle);
        py::gil_scoped_release release;
        return cuda::ipc_open(bytes, device);
      },
      py::arg("handle"), py::arg("device"), "Map another process's cudaIpcMemHandle allocation here.");
  m.def("cuda_ipc_close", &cuda::ipc_close, py::call_guard<py::gil_scoped_release>(), py::arg("address"),
        py::arg("device"));
  m.def("cuda_vmm_grant", &cuda::vmm_grant, py::arg("address"), py::arg("size"), py::arg("device"),
        "Let `device` (a peer) read and write a range mapped here for another device.");
  {
    // The service path's CUDA executor (cuda/service.h): the daemon's stream, events the ranks'
    // streams and its own wait on, and the collectives it enqueues.
    namespace executor = cuda::service;
    using Addresses = std::vector<std::uintptr_t>;
    m.def("cuda_stream_create", &executor::stream_create, py::arg("device"));
    m.def("cuda_stream_destroy", &executor::stream_destroy, py::arg("stream"));
    m.def("cuda_stream_idle", &executor::stream_idle, py::arg("device"), py::arg("stream"));
    m.def(
        "cuda_ipc_event_create",
        [](int device) {
          std::string handle;
          const std::uintptr_t event = executor::ipc_event_create(device, &handle);
          return py::make_tuple(event, py::bytes(handle));
        },
        py::arg("device"), "An interprocess event: (event, its 64-byte IPC handle).");
    m.def(
        "cuda_ipc_event_open",
        [](int device, py::bytes handle) { return executor::ipc_event_open(device, std::string(handle)); },
        py::arg("device"), py::arg("handle"), "Another process's event from its IPC handle.");
    m.def("cuda_event_destroy", &executor::event_destroy, py::arg("event"));
    m.def("cuda_stream_wait_event", &executor::wait_event, py::arg("device"), py::arg("stream"), py::arg("event"));
    m.def("cuda_event_record", &executor::record_event, py::arg("device"), py::arg("event"), py::arg("stream"));
    m.def(
        "cuda_service_all_reduce",
        [](int device, Addresses inputs, Addresses outputs, std::size_t count, int dtype, std::uintptr_t stream) {
          py::gil_scoped_release release;
          executor::all_reduce(device, inputs, outputs, count, nodecomm::dtype_of(dtype), stream);
        },
        py::arg("device"), py::arg("inputs"), py::arg("outputs"), py::arg("count"), py::arg("dtype"),
        py::arg("stream"), "Enqueue the sum of every input into every output (device addresses, rank order).");
    m.def(
        "cuda_service_all_gather",
        [](int device, Addresses inputs, Addresses outputs, std::size_t nbytes, std::uintptr_t stream) {
          py::gil_scoped_release release;
          executor::all_gather(device, inputs, outputs, nbytes, stream);
        },
        py::arg("device"), py::arg("inputs"), py::arg("outputs"), py::arg("nbytes"), py::arg("stream"));
    m.def(
        "cuda_service_topk_stage",
        [](int device, Addresses inputs, Addresses outputs, std::size_t rows, std::size_t topk,
           std::uintptr_t stream) {
          py::gil_scoped_release release;
          executor::topk_stage(device, inputs, outputs, rows, topk, stream);
        },
        py::arg("device"), py::arg("inputs"), py::arg("outputs"), py::arg("rows"), py::arg("topk"),
        py::arg("stream"));
  }
  m.def("cuda_vmm_rounded_size", &cuda::vmm_rounded_size, py::arg("device"), py::arg("bytes"));
  m.attr("CUDA_MAX_BLOCKS") = cuda::kMaxBlocks;
  m.def(
      "cuda_resident_blocks",
      [](int device) {
        cuda::DeviceScope scope(device);
        return cuda::resident_blocks(device);
      },
      py::arg("device"), "How many blocks of any kernel with block-pair waits fit on `device` at once.");
  m.def("cuda_topk_slab_bytes", &cuda::topk_slab_bytes, py::arg("rows_per_owner"), py::arg("world_size"),
        py::arg("topk"), "Bytes of one owner's top-k slab on its GPU: flags, then two slots of planes.");
  m.def("cuda_topk_blocks", &cuda::topk_blocks, py::arg("rows_per_owner"), py::arg("world_size"), py::arg("topk"),
        py::arg("max_blocks"), "The grid every rank of a top-k exchange runs.");
  m.def("cuda_buffer_bytes", &cuda::buffer_bytes, py::arg("slot_bytes"),
        "Bytes of one rank's CUDA buffer (counters, flags, two staging slots, two push slots).");
  py::class_<cuda::CudaGroup>(m, "CudaGroup",
                              "One rank's view of a CUDA group: every rank's buffer mapped on this "
                              "rank's device, the control segment registered with it, the dma copy stream.")
      .def(py::init<int, int, std::vector<std::uintptr_t>, std::uintptr_t, std::size_t, int, int>(),
           py::arg("rank"), py::arg("world_size"), py::arg("buffers"), py::arg("control"), py::arg("slot_bytes"),
           py::arg("device"), py::arg("max_blocks"))
      .def(
          "all_reduce",
          [](cuda::CudaGroup& self, std::uintptr_t input, std::uintptr_t output, std::size_t count,
             std::size_t call_count, int dtype, int algorithm, double timeout_s, std::uintptr_t stream) {
            const nodecomm::DType element = nodecomm::dtype_of(dtype);
            const nodecomm::Algorithm path = nodecomm::algorithm_of(algorithm);
            py::gil_scoped_release release;
            self.all_reduce(input, output, count, call_count, element, path, timeout_s, stream);
          },
          py::arg("input"), py::arg("output"), py::arg("count"), py::arg("call_count"), py::arg("dtype"),
          py::arg("algorithm"), py::arg("timeout_s"), py::arg("stream"),
           "Enqueue a oneshot (1), twoshot (2) or dma (3) all-reduce of `count` elements on `stream`, a piece of a "
           "call of `call_count` elements (what the ranks compare).")
      .def("all_gather", &cuda::CudaGroup::all_gather, py::call_guard<py::gil_scoped_release>(), py::arg("input"),
           py::arg("output"), py::arg("nbytes"), py::arg("output_stride"), py::arg("timeout_s"), py::arg("stream"),
           "Enqueue: rank r's `nbytes` land at output + r * output_stride on every rank.")
      .def("barrier", &cuda::CudaGroup::barrier, py::call_guard<py::gil_scoped_release>(), py::arg("timeout_s"),
           py::arg("stream"), "Enqueue a barrier among the ranks' streams.")
      .def("topk_stage", &cuda::CudaGroup::topk_stage, py::call_guard<py::gil_scoped_release>(), py::arg("slabs"),
           py::arg("rows_per_owner"), py::arg("topk"), py::arg("blocks"), py::arg("idx"), py::arg("scores"),
           py::arg("rows"), py::arg("out_idx"), py::arg("out_scores"), py::arg("timeout_s"), py::arg("stream"),
           "Enqueue one top-k exchange stage: this rank's candidates to their owners, its owner table out.")
      .def("check_peers", &cuda::CudaGroup::check_peers, py::call_guard<py::gil_scoped_release>(), py::arg("nonce"),
           py::arg("timeout_s"),
           "Write a tag into every peer's buffer and wait for every peer's tag in this one: '' or what failed.")
      .def_property_readonly("rank", &cuda::CudaGroup::rank)
      .def_property_readonly("world_size", &cuda::CudaGroup::world_size)
      .def_property_readonly("device", &cuda::CudaGroup::device);
#else
  m.attr("WITH_CUDA") = false;
#endif
}
