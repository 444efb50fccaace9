// vmm.h — device memory that crosses processes as a POSIX file descriptor (CUDA VMM).
//
// The daemon allocates with vmm_allocate (cuMemCreate with a POSIX-fd handle type), maps the
// allocation itself, and hands the exported descriptor to each rank over the descriptor socket;
// a rank maps it with vmm_import. Every mapping grants read-write access to one device. Sizes are
// rounded up to the allocation granularity, which both sides compute the same way.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "driver.h"

namespace nodecomm::cuda {

struct VmmMapping {
  std::uintptr_t address = 0;
  std::size_t size = 0;  // rounded to the granularity
  int fd = -1;           // exported handle (allocations only; -1 for imports)
};

inline CUmemAllocationProp allocation_properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

inline std::size_t vmm_granularity(int device) {
  const CUmemAllocationProp prop = allocation_properties(device);
  std::size_t granularity = 0;
  NODECOMM_CU(driver().granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return granularity;
}

inline std::size_t vmm_rounded_size(int device, std::size_t bytes) {
  const std::size_t g = vmm_granularity(device);
  return (bytes + g - 1) / g * g;
}

// Reserve a range, map `handle` into it and grant `device` read-write access.
inline std::uintptr_t map_handle(CUmemGenericAllocationHandle handle, std::size_t size, int device) {
  CUdeviceptr address = 0;
  NODECOMM_CU(driver().address_reserve(&address, size, vmm_granularity(device), 0, 0));
  CUresult status = driver().mem_map(address, size, 0, handle, 0);
  if (status == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    status = driver().mem_set_access(address, size, &access, 1);
    if (status != CUDA_SUCCESS) driver().mem_unmap(address, size);
  }
  if (status != CUDA_SUCCESS) {
    driver().address_free(address, size);
    NODECOMM_CU(status);
  }
  return std::uintptr_t(address);
}

// Allocate `bytes` on `device`, map it here, zero it, and export a descriptor for the ranks.
inline VmmMapping vmm_allocate(int device, std::size_t bytes) {
  NODECOMM_CUDA(cudaSetDevice(device));
  NODECOMM_CUDA(cudaFree(nullptr));  // the primary context, which the driver calls need
  VmmMapping mapping;
  mapping.size = vmm_rounded_size(device, bytes);
  const CUmemAllocationProp prop = allocation_properties(device);
  CUmemGenericAllocationHandle handle = 0;
  NODECOMM_CU(driver().mem_create(&handle, mapping.size, &prop, 0));
  CUresult status = driver().mem_export(&mapping.fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (status != CUDA_SUCCESS) {
    driver().mem_release(handle);
    NODECOMM_CU(status);
  }
  try {
    mapping.address = map_handle(handle, mapping.size, device);
  } catch (...) {
    driver().mem_release(handle);
    ::close(mapping.fd);
    throw;
  }
  driver().mem_release(handle);  // the mapping and the exported descriptor keep the memory
  NODECOMM_CUDA(zero_on_own_stream(reinterpret_cast<void*>(mapping.address), mapping.size));
  return mapping;
}

// Map an allocation exported by another process. The descriptor stays the caller's to close.
inline std::uintptr_t vmm_import(int device, int fd, std::size_t size) {
  NODECOMM_CUDA(cudaSetDevice(device));
  NODECOMM_CUDA(cudaFree(nullptr));
  CUmemGenericAllocationHandle handle = 0;
  NODECOMM_CU(driver().mem_import(&handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  std::uintptr_t address = 0;
  try {
    address = map_handle(handle, size, device);
  } catch (...) {
    driver().mem_release(handle);
    throw;
  }
  driver().mem_release(handle);
  return address;
}

// Let `device` read and write a range this process mapped for another device (peer access).
inline void vmm_grant(int device, std::uintptr_t address, std::size_t size) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  NODECOMM_CU(driver().mem_set_access(CUdeviceptr(address), size, &access, 1));
}

inline void vmm_unmap(std::uintptr_t address, std::size_t size) {
  NODECOMM_CU(driver().mem_unmap(CUdeviceptr(address), size));
  NODECOMM_CU(driver().address_free(CUdeviceptr(address), size));
}

}  // namespace nodecomm::cuda
