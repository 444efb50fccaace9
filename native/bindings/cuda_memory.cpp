// cuda_memory.cpp — the GPUs this process sees and the memory nodecomm shares between processes:
// VMM allocations exported as descriptors, legacy IPC handles. Every binding takes the device first.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cuda/devices.h"
#include "cuda/ipc_legacy.h"
#include "cuda/vmm.h"

#include "bindings.h"

namespace py = pybind11;

namespace nodecomm::bindings {

void bind_cuda_memory(py::module_& m) {
  namespace cuda = nodecomm::cuda;
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
      [](int device, int fd, std::size_t size) {
        py::gil_scoped_release release;
        return cuda::vmm_import(device, fd, size);
      },
      py::arg("device"), py::arg("fd"), py::arg("size"), "Map another process's exported allocation on `device`.");
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
      [](int device, py::bytes handle) {
        const std::string bytes(handle);
        py::gil_scoped_release release;
        return cuda::ipc_open(device, bytes);
      },
      py::arg("device"), py::arg("handle"), "Map another process's cudaIpcMemHandle allocation on `device`.");
  m.def("cuda_ipc_close", &cuda::ipc_close, py::call_guard<py::gil_scoped_release>(), py::arg("device"),
        py::arg("address"));
  m.def("cuda_vmm_grant", &cuda::vmm_grant, py::arg("device"), py::arg("address"), py::arg("size"),
        "Let `device` (a peer) read and write a range mapped here for another device.");
  m.def("cuda_vmm_rounded_size", &cuda::vmm_rounded_size, py::arg("device"), py::arg("bytes"));
}

}  // namespace nodecomm::bindings
