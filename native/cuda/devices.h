// devices.h — GPUs by UUID: CUDA indices differ between processes and containers, UUIDs do not.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "driver.h"

namespace nodecomm::cuda {

inline std::string format_uuid(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  char text[48];
  std::snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return text;
}

// UUIDs of the devices this process sees, in CUDA index order; empty without a driver or GPU.
inline std::vector<std::string> device_uuids() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: report none, keep no sticky error
    return {};
  }
  std::vector<std::string> uuids;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    NODECOMM_CUDA(cudaGetDeviceProperties(&prop, i));
    uuids.push_back(format_uuid(prop.uuid));
  }
  return uuids;
}

}  // namespace nodecomm::cuda
