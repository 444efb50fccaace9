// agreement.h — what every rank of a group must arrive with at a collective (a Call, packed in one
// word so that carrying it costs one store beside a barrier's epoch), and the one message that
// names the field the ranks disagree on and each rank's value. The CPU transport compares calls at
// every barrier and raises at once; CUDA kernels record them (control.h) and the host raises.
#pragma once

#include <cstdint>
#include <string>

#include "codes.h"
#include "numerics.h"
#include "wire.h"

namespace nodecomm {

// What a rank arrives at a barrier for.
enum class Collective : std::uint64_t {
  kAllReduce = 1,
  kAllGather = 2,
  kBarrier = 3,
  kTopkStage = 4,
  kAllReduceRmsNorm = 5,  // all_reduce_rms_norm: the count is the shape, rows << 16 | hidden (rms_norm.h)
};

struct Call {
  Collective collective;
  std::uint64_t count = 0;  // elements (all_reduce), bytes (all_gather), rows (top-k stage), shape
  int dtype = 0;            // DType, all_reduce only
  int path = 0;             // path code (nodecomm.v1.Path), all_reduce only
  int wire = 0;             // wire format (nodecomm.v1.Wire), all_reduce only

  // The count in 40 bits (a TiB of bytes; larger counts compare modulo 2^40), 8 bits for the
  // collective and the dtype, 4 for the path and the wire. Never 0: the collective is at least 1.
  static constexpr int kCountBits = 40;
  constexpr std::uint64_t packed() const {
    return (count & ((std::uint64_t(1) << kCountBits) - 1)) | std::uint64_t(collective) << 56 |
           std::uint64_t(dtype & 0xFF) << 48 | std::uint64_t(wire & 0xF) << 44 | std::uint64_t(path & 0xF) << 40;
  }
  static constexpr Call unpack(std::uint64_t word) {
    return Call{Collective(word >> 56), word & ((std::uint64_t(1) << kCountBits) - 1), int((word >> 48) & 0xFF),
                int((word >> 40) & 0xF), int((word >> 44) & 0xF)};
  }
};

inline const char* collective_name(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kBarrier: return "barrier";
    case Collective::kTopkStage: return "top-k stage";
    case Collective::kAllReduceRmsNorm: return "all_reduce_rms_norm";
  }
  return "an unknown collective";
}

inline std::string dtype_name(int dtype) {
  switch (DType(dtype)) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "dtype " + std::to_string(dtype);
}

inline std::string path_shown(int code) {
  return code >= 1 && code < kPaths ? path_name(Path(code)) : "path " + std::to_string(code);
}

// "the ranks disagree on <field>: rank 0 has <value>, rank 1 has <value>, ..." for the first field
// the known calls differ on, in the order a reader can act on; ranks whose call is not known (a
// CUDA rank that stopped before it recorded its own) are named as such.
inline std::string describe_disagreement(const Call* calls, const bool* known, int world_size) {
  int first = 0;
  while (first < world_size && !known[first]) ++first;
  auto differ = [&](auto field) {
    for (int r = first + 1; r < world_size; ++r) {
      if (known[r] && field(calls[r]) != field(calls[first])) return true;
    }
    return false;
  };
  auto each = [&](auto shown) {
    std::string text;
    for (int r = 0; r < world_size; ++r) {
      text += (r ? ", rank " : "rank ") + std::to_string(r) + " " + (known[r] ? shown(calls[r]) : "was not recorded");
    }
    return text;
  };
  if (first == world_size) return "the ranks disagree on their calls, which no rank recorded";
  const Call& call = calls[first];
  std::string what;
  if (differ([](const Call& c) { return int(c.collective); })) {
    what = "the collective: " + each([](const Call& c) { return std::string("calls ") + collective_name(c.collective); });
  } else if (differ([](const Call& c) { return c.dtype; })) {
    what = collective_name(call.collective) + std::string("'s dtype: ") +
           each([](const Call& c) { return "has " + dtype_name(c.dtype); });
  } else if (differ([](const Call& c) { return c.count; }) && call.collective == Collective::kAllReduceRmsNorm) {
    what = "all_reduce_rms_norm's shape (rows x hidden): " + each([](const Call& c) {
             return "has " + std::to_string(c.count >> 16) + " x " + std::to_string(c.count & 0xFFFF);
           });
  } else if (differ([](const Call& c) { return c.count; })) {
    // Before the path: where the table chose the paths, different sizes chose different ones.
    const char* unit = call.collective == Collective::kAllReduce    ? "element count"
                       : call.collective == Collective::kTopkStage ? "row count"
                                                                   : "byte count";
    what = collective_name(call.collective) + std::string("'s ") + unit + ": " +
           each([](const Call& c) { return "has " + std::to_string(c.count); });
  } else if (differ([](const Call& c) { return c.path; })) {
    what = collective_name(call.collective) + std::string("'s path: ") +
           each([](const Call& c) { return "has " + path_shown(c.path); });
  } else if (differ([](const Call& c) { return c.wire; })) {
    what = collective_name(call.collective) + std::string("'s wire format: ") +
           each([](const Call& c) { return std::string("has ") + wire::wire_name(c.wire); });
  } else {
    // Only a CUDA rank that saw a peer's digest differ, with the peer's own call not recorded.
    what = "their calls: " + each([](const Call& c) {
             return "calls " + std::string(collective_name(c.collective)) + " of " + std::to_string(c.count);
           });
  }
  return "the ranks disagree on " + what;
}

}  // namespace nodecomm
