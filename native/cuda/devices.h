// devices.h — GPUs by UUID: CUDA indices differ between processes and containers, UUIDs do not.
#pragma once

#include <cuda_runtime.h>

#include <cctype>
#include <cstddef>
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

struct DeviceInfo {
  std::string uuid;
  std::string name;
  std::string pci_bus_id;  // "0000:41:00.0", as sysfs spells it
  int multiprocessors;
  std::size_t memory_bytes;
};

inline std::vector<DeviceInfo> device_infos() {
  std::vector<DeviceInfo> infos;
  for (int i = 0, n = int(device_uuids().size()); i < n; ++i) {
    cudaDeviceProp prop{};
    NODECOMM_CUDA(cudaGetDeviceProperties(&prop, i));
    char bus_id[32] = {};
    NODECOMM_CUDA(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, i));
    std::string pci(bus_id);
    for (auto& c : pci) c = char(std::tolower(static_cast<unsigned char>(c)));
    infos.push_back({format_uuid(prop.uuid), prop.name, pci, prop.multiProcessorCount, prop.totalGlobalMem});
  }
  return infos;
}

struct PeerLink {
  bool access;           // cudaDevP2PAttrAccessSupported: the peer paths can map the other's memory
  bool native_atomics;   // cudaDevP2PAttrNativeAtomicSupported
  int performance_rank;  // cudaDevP2PAttrPerformanceRank: lower is faster
};

// links[i][j]: what device i can do with device j's memory (i == j: itself).
inline std::vector<std::vector<PeerLink>> peer_links() {
  const int n = int(device_uuids().size());
  std::vector<std::vector<PeerLink>> links(n, std::vector<PeerLink>(n, PeerLink{true, true, 0}));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int access = 0, atomics = 0, rank = 0;
      NODECOMM_CUDA(cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, i, j));
      NODECOMM_CUDA(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, i, j));
      NODECOMM_CUDA(cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, i, j));
      links[i][j] = PeerLink{access != 0, atomics != 0, rank};
    }
  }
  return links;
}

}  // namespace nodecomm::cuda
