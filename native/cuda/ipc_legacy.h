// ipc_legacy.h — device memory that crosses processes as cudaIpcMemHandle bytes: the fallback
// where VMM allocations cannot be exported as POSIX descriptors (vmm.h). The daemon allocates and
// keeps each buffer until the group is released: unlike a VMM mapping, an importer's mapping
// does not keep the memory alive.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "driver.h"

namespace nodecomm::cuda {

struct LegacyAllocation {
  std::uintptr_t address = 0;
  std::string handle;  // the 64 bytes of its cudaIpcMemHandle_t
};

// `bytes` of zeroed device memory on `device`, and the handle other processes open it with.
inline LegacyAllocation ipc_allocate(int device, std::size_t bytes) {
  DeviceScope scope(device);
  void* memory = nullptr;
  NODECOMM_CUDA(cudaMalloc(&memory, bytes));
  cudaIpcMemHandle_t handle{};
  cudaError_t status = zero_on_own_stream(memory, bytes);
  if (status == cudaSuccess) status = cudaIpcGetMemHandle(&handle, memory);
  if (status != cudaSuccess) {
    cudaFree(memory);
    NODECOMM_CUDA(status);
  }
  return {reinterpret_cast<std::uintptr_t>(memory), std::string(handle.reserved, sizeof handle.reserved)};
}

inline void ipc_free(int device, std::uintptr_t address) {
  DeviceScope scope(device);
  NODECOMM_CUDA(cudaFree(reinterpret_cast<void*>(address)));
}

// Map another process's allocation on `device`; close it with ipc_close.
inline std::uintptr_t ipc_open(int device, const std::string& handle) {
  const auto imported = ipc_handle_from<cudaIpcMemHandle_t>(handle, "a memory");
  DeviceScope scope(device);
  void* memory = nullptr;
  NODECOMM_CUDA(cudaIpcOpenMemHandle(&memory, imported, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<std::uintptr_t>(memory);
}

inline void ipc_close(int device, std::uintptr_t address) {
  DeviceScope scope(device);
  NODECOMM_CUDA(cudaIpcCloseMemHandle(reinterpret_cast<void*>(address)));
}

}  // namespace nodecomm::cuda
