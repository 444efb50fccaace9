// codes.h — the values the native ABI shares with nodecomm.v1 (proto/): element types, paths, and
// the most ranks a group has. Python passes them as ints; the bindings check them (module.cpp).
#pragma once

#include <cstddef>
#include <string>

#include "errors.h"

namespace nodecomm {

// Equal to nodecomm.v1.DType values.
enum class DType : int { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Equal to nodecomm.v1.Path values: an all-reduce's path. A transport runs oneshot, twoshot and
// (CUDA) dma itself; NCCL and the service path are run outside it (the engine's NCCL, the daemon).
enum class Path : int { kNone = 0, kOneshot = 1, kTwoshot = 2, kDma = 3, kNccl = 4, kService = 5 };
constexpr int kPaths = 6;

// Ranks in one group, on every transport (the daemon's MAX_WORLD_SIZE reads it).
constexpr int kMaxRanks = 16;

inline std::size_t dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

inline DType dtype_of(int code) {
  NODECOMM_CHECK(code >= 1 && code <= 3, "unknown dtype code " + std::to_string(code) +
                                             ": expected 1 (float32), 2 (float16) or 3 (bfloat16)");
  return DType(code);
}

inline const char* path_name(Path path) {
  static const char* names[kPaths] = {"none", "oneshot", "twoshot", "dma", "nccl", "service"};
  return names[int(path)];
}

inline Path path_of(int code) {
  NODECOMM_CHECK(code >= 1 && code < kPaths, "unknown path code " + std::to_string(code) + ": expected 1-5");
  return Path(code);
}

// A path a transport runs itself.
inline Path kernel_path_of(int code) {
  NODECOMM_CHECK(code >= 1 && code <= 3, "unknown path code " + std::to_string(code) +
                                             ": expected 1 (oneshot), 2 (twoshot) or 3 (dma)");
  return Path(code);
}

}  // namespace nodecomm
