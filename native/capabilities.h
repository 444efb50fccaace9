// capabilities.h — what each transport runs, as one record: its all-reduce paths, those of them
// that carry compressed wires, and the world sizes of its groups and of its top-k exchanges. The
// bindings export the record of every kind the build has (nodecomm._native.CAPABILITIES, read by
// nodecomm.capabilities); the daemon checks a Join against it before anything is allocated, and a
// rank's dispatch picks only among its paths.
#pragma once

#include <iterator>
#include <vector>

#include "codes.h"
#include "cuda/world.h"

namespace nodecomm {

struct Capabilities {
  std::vector<Path> paths;
  std::vector<Path> wire_paths;  // the paths that carry int8 and fp8 (wire.h)
  std::vector<int> world_sizes;
  std::vector<int> topk_world_sizes;
};

// Top-k exchanges share one slab layout on both kinds; the CUDA stage kernel is built for 1-8 ranks.
constexpr int kTopkMaxRanks = 8;

inline std::vector<int> world_sizes_up_to(int most) {
  std::vector<int> sizes;
  for (int n = 1; n <= most; ++n) sizes.push_back(n);
  return sizes;
}

// The shared-memory transport (shm.h): both paths at any world size, over every wire.
inline Capabilities host_capabilities() {
  const std::vector<Path> paths{Path::kOneshot, Path::kTwoshot};
  return {paths, paths, world_sizes_up_to(kMaxRanks), world_sizes_up_to(kTopkMaxRanks)};
}

// The CUDA transport: three paths, every one over every wire (cuda/wire_codec.cuh), at the world
// sizes its kernels are instantiated for (cuda/world.h).
inline Capabilities cuda_capabilities() {
  const std::vector<Path> paths{Path::kOneshot, Path::kTwoshot, Path::kDma};
  std::vector<int> topk;
  for (const int n : cuda::kWorldSizes) {
    if (n <= kTopkMaxRanks) topk.push_back(n);
  }
  return {paths, paths, std::vector<int>(std::begin(cuda::kWorldSizes), std::end(cuda::kWorldSizes)), topk};
}

}  // namespace nodecomm
