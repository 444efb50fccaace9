// cuda_service.cpp — the service path's CUDA executor (../cuda/service.h): the daemon's stream,
// events the ranks' streams and its own wait on, and the collectives it enqueues.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "codes.h"
#include "cuda/service.h"

#include "bindings.h"

namespace py = pybind11;

namespace nodecomm::bindings {

void bind_cuda_service(py::module_& m) {
  namespace executor = nodecomm::cuda::service;
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

}  // namespace nodecomm::bindings
