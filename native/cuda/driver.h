// driver.h — the CUDA driver-API calls nodecomm needs, resolved at run time through
// cudaGetDriverEntryPointByVersion so that the module links only the CUDA runtime (the toolkits
// that build it may carry no libcuda stub, and a CPU-only host has no driver at all); and the
// few runtime helpers every CUDA file shares (error checks, occupancy, zeroing, device scope).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstddef>
#include <cstring>
#include <string>

#include "../errors.h"

namespace nodecomm::cuda {

struct DriverApi {
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  PFN_cuStreamWriteValue64_v11070 stream_write_value = nullptr;
  PFN_cuStreamWaitValue64_v11070 stream_wait_value = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
};

[[noreturn]] inline void raise_runtime(cudaError_t status, const char* what, const char* file, int line) {
  raise(ErrorKind::kInternal, file, line, std::string(what) + ": " + cudaGetErrorString(status));
}

#define NODECOMM_CUDA(call)                                                               \
  do {                                                                                    \
    const cudaError_t status_ = (call);                                                   \
    if (status_ != cudaSuccess) ::nodecomm::cuda::raise_runtime(status_, #call, __FILE__, __LINE__); \
  } while (0)

template <typename Fn>
void resolve(const char* symbol, int version, Fn& out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  NODECOMM_CUDA(cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    NODECOMM_RAISE(kInternal, std::string("the CUDA driver lacks ") + symbol + " (version " +
                                  std::to_string(version) + ")");
  }
  out = reinterpret_cast<Fn>(fn);
}

// The process-wide table, resolved on first use.
inline const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi d;
    resolve("cuMemCreate", 10020, d.mem_create);
    resolve("cuMemRelease", 10020, d.mem_release);
    resolve("cuMemExportToShareableHandle", 10020, d.mem_export);
    resolve("cuMemImportFromShareableHandle", 10020, d.mem_import);
    resolve("cuMemAddressReserve", 10020, d.address_reserve);
    resolve("cuMemAddressFree", 10020, d.address_free);
    resolve("cuMemMap", 10020, d.mem_map);
    resolve("cuMemUnmap", 10020, d.mem_unmap);
    resolve("cuMemSetAccess", 10020, d.mem_set_access);
    resolve("cuMemGetAllocationGranularity", 10020, d.granularity);
    resolve("cuGetErrorString", 6000, d.error_string);
    resolve("cuStreamWriteValue64", 11070, d.stream_write_value);
    resolve("cuStreamWaitValue64", 11070, d.stream_wait_value);
    resolve("cuDeviceGet", 2000, d.device_get);
    resolve("cuDeviceGetAttribute", 2000, d.device_attribute);
    return d;
  }();
  return api;
}

inline void check_driver(CUresult status, const char* what, const char* file, int line) {
  if (status == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver().error_string(status, &text) != CUDA_SUCCESS || text == nullptr) text = "unknown CUresult";
  const ErrorKind kind = status == CUDA_ERROR_OUT_OF_MEMORY ? ErrorKind::kResourceExhausted : ErrorKind::kInternal;
  raise(kind, file, line, std::string(what) + ": " + text + " (CUresult " + std::to_string(int(status)) + ")");
}

#define NODECOMM_CU(call) ::nodecomm::cuda::check_driver((call), #call, __FILE__, __LINE__)

// Blocks of `kernel`, launched with `threads` threads, that fit on one SM of the current device.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int blocks = 0;
  NODECOMM_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  return blocks;
}

// Zero `bytes` at `memory` on a stream of its own and wait for it: a device-wide synchronisation
// would also wait for the daemon's service streams, which may wait on ranks.
inline cudaError_t zero_on_own_stream(void* memory, std::size_t bytes) {
  cudaStream_t stream = nullptr;
  cudaError_t status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (status != cudaSuccess) return status;
  status = cudaMemsetAsync(memory, 0, bytes, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  return status;
}

// A cudaIpc*Handle_t from the bytes another process sent (its `reserved` field, 64 bytes).
template <typename Handle>
Handle ipc_handle_from(const std::string& bytes, const char* what) {
  Handle handle{};
  NODECOMM_CHECK(bytes.size() == sizeof handle.reserved, std::string(what) + " handle is " +
                                                              std::to_string(sizeof handle.reserved) + " bytes, got " +
                                                              std::to_string(bytes.size()));
  std::memcpy(handle.reserved, bytes.data(), bytes.size());
  return handle;
}

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    NODECOMM_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) NODECOMM_CUDA(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace nodecomm::cuda
