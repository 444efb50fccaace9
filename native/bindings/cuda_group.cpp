// cuda_group.cpp — a rank's CUDA group (../cuda/group.h), its buffers' and top-k slabs' sizes,
// and the occupancy its grids are sized by.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <string>
#include <vector>

#include "codes.h"
#include "wire.h"
#include "cuda/group.h"
#include "cuda/lane.h"
#include "cuda/collectives.h"
#include "cuda/layout.h"
#include "cuda/topk.h"

#include "bindings.h"
#include "lane.h"

namespace py = pybind11;

namespace nodecomm::bindings {

void bind_cuda_group(py::module_& m) {
  namespace cuda = nodecomm::cuda;
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
  m.def(
      "cuda_add_rms_norm",
      [](std::uintptr_t summed, std::uintptr_t residual, std::uintptr_t weight, std::uintptr_t out,
         std::uintptr_t residual_out, std::size_t rows, std::size_t hidden, float eps, int dtype, int device,
         std::uintptr_t stream) {
        const nodecomm::DType type = nodecomm::dtype_of(dtype);
        cuda::DeviceScope scope(device);
        cuda::add_rms_norm({summed, residual, weight, out, residual_out, rows, hidden, eps}, type,
                           reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("summed"), py::arg("residual"), py::arg("weight"), py::arg("output"), py::arg("residual_out"),
      py::arg("rows"), py::arg("hidden"), py::arg("eps"), py::arg("dtype"), py::arg("device"), py::arg("stream"),
      "Enqueued on `stream` (device memory): residual_out = summed + residual, output = rms_norm(residual_out) * "
      "weight, in the order of nodecomm.rms_norm (output may be summed, residual_out may be residual).");
  m.attr("CUDA_CAPTURE_RELAXED") = int(cudaStreamCaptureModeRelaxed);
  m.def(
      "cuda_exchange_capture_mode",
      [](int mode) {
        auto exchanged = static_cast<cudaStreamCaptureMode>(mode);
        NODECOMM_CUDA(cudaThreadExchangeStreamCaptureMode(&exchanged));
        return int(exchanged);
      },
      py::arg("mode"),
      "Sets the calling thread's stream capture mode (cudaStreamCaptureMode: 0 global, 1 thread-local, 2 "
      "relaxed) and returns the one it had (cudaThreadExchangeStreamCaptureMode).");
  m.def("cuda_buffer_bytes", &cuda::buffer_bytes, py::arg("capacity_bytes"),
        "Bytes of one rank's CUDA buffer (counters, flags, two staging slots, two push slots).");
  py::class_<cuda::CudaGroup>(m, "CudaGroup",
                              "One rank's view of a CUDA group: every rank's buffer mapped on this "
                              "rank's device, the control segment registered with it, the dma copy stream.")
      .def(py::init<int, int, std::vector<std::uintptr_t>, std::uintptr_t, std::size_t, int, int>(),
           py::arg("rank"), py::arg("world_size"), py::arg("buffers"), py::arg("control"), py::arg("capacity_bytes"),
           py::arg("device"), py::arg("max_blocks"))
      .def(
          "all_reduce",
          [](cuda::CudaGroup& self, std::uintptr_t input, std::uintptr_t output, std::size_t count, int dtype,
             int path_code, double timeout_s, std::uintptr_t stream, int wire) {
            const nodecomm::DType element = nodecomm::dtype_of(dtype);
            const nodecomm::Path path = nodecomm::kernel_path_of(path_code);
            py::gil_scoped_release release;
            self.all_reduce(input, output, count, element, path, wire, timeout_s, stream);
          },
          py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("path"),
          py::arg("timeout_s"), py::arg("stream"), py::arg("wire") = 0,
          "Enqueue an all-reduce (Path) of `count` elements (DType) on `stream`, over a Wire format.")
      .def("all_gather", &cuda::CudaGroup::all_gather, py::call_guard<py::gil_scoped_release>(), py::arg("input"),
           py::arg("output"), py::arg("nbytes"), py::arg("timeout_s"), py::arg("stream"),
           "Enqueue: rank r's `nbytes` land at output + r * nbytes on every rank.")
      .def("barrier", &cuda::CudaGroup::barrier, py::call_guard<py::gil_scoped_release>(), py::arg("timeout_s"),
           py::arg("stream"), "Enqueue a barrier among the ranks' streams.")
      .def("topk_stage", &cuda::CudaGroup::topk_stage, py::call_guard<py::gil_scoped_release>(), py::arg("slabs"),
           py::arg("rows_per_owner"), py::arg("topk"), py::arg("blocks"), py::arg("idx"), py::arg("scores"),
           py::arg("rows"), py::arg("out_idx"), py::arg("out_scores"), py::arg("timeout_s"), py::arg("stream"),
           "Enqueue one top-k exchange stage: this rank's candidates to their owners, its owner table out.")
      .def("check_peers", &cuda::CudaGroup::check_peers, py::call_guard<py::gil_scoped_release>(), py::arg("nonce"),
           py::arg("timeout_s"),
           "Write a tag into every peer's buffer and wait for every peer's tag in this one: '' or what failed.")
      .def("oneshot_pushes", &cuda::CudaGroup::oneshot_pushes, py::arg("nbytes"),
           "Whether oneshot pushes an all-reduce of `nbytes` into peers' push slots (else it pulls).")
      .def_property_readonly("rank", &cuda::CudaGroup::rank)
      .def_property_readonly("world_size", &cuda::CudaGroup::world_size)
      .def_property_readonly("device", &cuda::CudaGroup::device);

  bind_lane<nodecomm::lane::CudaLane, cuda::CudaGroup>(
      m, "CudaLane",
      "A CUDA rank's all-reduce as one call on the caller's stream: checks, capture check, decision, enqueue, timing "
      "sample, count (../cuda/lane.h). It holds the dispatch and lock it was made with; the group must outlive it "
      "until close().")
      .def(
          "set_nccl",
          [](nodecomm::lane::CudaLane& self, const py::capsule& api, const py::object& /*owner*/) {
            const std::string name = api.name() ? api.name() : "";
            NODECOMM_CHECK(name == nodecomm::lane::kNcclCapsule,
                           "set_nccl takes NcclRunner.api(), not a capsule named '" + name + "'");
            const NodecommNccl nccl = *api.get_pointer<const NodecommNccl>();
            py::gil_scoped_release release;  // the call lock is never waited for holding the GIL
            self.set_nccl(nccl);
          },
          py::arg("api"), py::arg("owner"), py::keep_alive<1, 3>(),
          "Run the calls decided for NCCL through `owner` (nodecomm._c10d.NcclRunner: the engine's NCCL group), "
          "whose api() `api` is; before any call.");
}

}  // namespace nodecomm::bindings
