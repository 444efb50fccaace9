// cuda_service.cpp — the service path's CUDA executor (../cuda/service.h): the daemon's stream,
// the events or stream words (../cuda/stream_words.h) the ranks' streams and its own wait on, and
// the collectives it enqueues.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "codes.h"
#include "cuda/layout.h"
#include "cuda/service.h"
#include "cuda/stream_words.h"

#include "bindings.h"

namespace py = pybind11;

namespace nodecomm::bindings {

void bind_cuda_service(py::module_& m) {
  namespace cuda = nodecomm::cuda;
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
  m.attr("CUDA_SERVICE_READY_OFFSET") = cuda::kServiceReadyOffset;
  m.attr("CUDA_SERVICE_DONE_OFFSET") = cuda::kServiceDoneOffset;
  m.attr("CUDA_SERVICE_RELEASED") = cuda::kServiceReleased;
  m.def("cuda_stream_words_supported", &cuda::stream_words_supported, py::arg("device"),
        "Whether `device` runs 64-bit stream memory operations (the service path's stream words).");
  m.def("cuda_write_word", &cuda::write_word, py::arg("stream"), py::arg("address"), py::arg("value"),
        "Enqueue on `stream`: write `value` to the 64-bit word at `address` once the work before it ran.");
  m.def("cuda_wait_word", &cuda::wait_word, py::arg("stream"), py::arg("address"), py::arg("value"),
        "Enqueue on `stream`: what follows starts once the word at `address` is at least `value`.");
  m.def("cuda_write_word_now", &cuda::write_word_now, py::arg("device"), py::arg("address"), py::arg("value"),
        "Write `value` to the word at `address` on `device` from a stream of its own, ordered after nothing.");
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
