// collectives.cu — the CUDA all-reduce of collectives.h: its checks, the call the ranks compare,
// and the path's file (paths.h) that enqueues it; and the occupancy every resident grid is sized by.
//
// Agreement (../agreement.h): every barrier's arrival word carries a digest of the call the rank
// is in beside its epoch (signal.cuh), and every pushed line a digest of the call and the launch
// in its flags (oneshot.cu), so ranks compare calls with what they exchange anyway, at no store
// more. Ranks in different kernels for one launch (one pushes, another meets at barriers) never
// see each other's arrivals; their waits look, from a millisecond in (sync.cuh), for the other
// kind's: a pushed line where a barrier was expected, a barrier where lines were. A rank that finds a
// mismatch, or that a peer's mismatch stops, records its own call and the group is aborted before
// anything is written to an output (a kernel cannot raise; the host's next call does).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "../agreement.h"
#include "../errors.h"
#include "collectives.h"
#include "driver.h"
#include "paths.h"
#include "rms_norm.cuh"
#include "topk.h"

namespace nodecomm::cuda {

void all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                std::size_t call_count, DType dtype, Path path, int wire, double timeout_s,
                cudaStream_t stream, const CopyPipeline& pipeline) {
  check_group(group);
  const wire::Wire format = wire::wire_of(wire);
  NODECOMM_CHECK(group.max_blocks >= 1 && group.max_blocks <= kMaxBlocks,
                 "max_blocks " + std::to_string(group.max_blocks) + ": expected 1.." + std::to_string(kMaxBlocks));
  NODECOMM_CHECK(count * dtype_bytes(dtype) <= group.capacity_bytes,
                 "payload of " + std::to_string(count * dtype_bytes(dtype)) + " bytes exceeds the slot of " +
                     std::to_string(group.capacity_bytes));
  NODECOMM_CHECK(format == wire::Wire::kLossless ||
                     count <= wire::elements_per_slot(group.capacity_bytes, dtype_bytes(dtype)),
                 "a piece of " + std::to_string(count) + " elements over a compressed wire exceeds the slot of " +
                     std::to_string(group.capacity_bytes) + " bytes");
  NODECOMM_CHECK(count <= call_count, "a piece of " + std::to_string(count) + " elements of a call of " +
                                          std::to_string(call_count));
  const TaggedCall call = tagged(Call{Collective::kAllReduce, call_count, int(dtype), int(path), wire}.packed());
  const std::uint64_t timeout = timeout_ns(timeout_s);
  if (count == 0) return meet_peers(group, call, timeout, stream);  // the calls still meet
  switch (path) {
    case Path::kOneshot:
      return oneshot_all_reduce(group, input, output, count, dtype, format, call, timeout, stream);
    case Path::kTwoshot:
      return twoshot_all_reduce(group, input, output, count, dtype, format, call, timeout, stream);
    case Path::kDma:
      return dma_all_reduce(group, input, output, count, dtype, format, call, timeout, stream, pipeline);
  }
  NODECOMM_RAISE(kInvalidArgument, "unknown path code " + std::to_string(int(path)));
}

bool fused_norm(const GroupView& group, const norm::Rows& rows, DType dtype, Path path) {
  if (!chunks_pack(rows)) return false;
  if (path == Path::kOneshot) return rows.count() * dtype_bytes(dtype) <= group.capacity_bytes;
  return path == Path::kTwoshot && twoshot_fuses(group, rows, dtype);
}

void all_reduce_rms_norm(const GroupView& group, const norm::Rows& rows, DType dtype, Path path, double timeout_s,
                         cudaStream_t stream) {
  check_group(group);
  rows.check();
  NODECOMM_CHECK(fused_norm(group, rows, dtype, path),
                 std::string("all_reduce_rms_norm of ") + std::to_string(rows.rows) + " x " +
                     std::to_string(rows.hidden) + " on " + path_name(path) + " has no fused kernel");
  const TaggedCall call = tagged(rows.call(dtype, path).packed());
  const std::uint64_t timeout = timeout_ns(timeout_s);
  if (rows.rows == 0) return meet_peers(group, call, timeout, stream);  // the calls still meet
  if (path == Path::kOneshot) return oneshot_all_reduce_rms_norm(group, rows, dtype, call, timeout, stream);
  twoshot_all_reduce_rms_norm(group, rows, dtype, call, timeout, stream);
}

int resident_blocks(int device) {
  // Every kernel whose blocks wait on peers' blocks needs its whole grid resident at once, so the
  // one with the fewest blocks per SM bounds them all; register use does not follow the element
  // size or the world size, so each instantiation is asked.
  const int per_sm = std::min({topk_blocks_per_sm(), oneshot_blocks_per_sm(), twoshot_blocks_per_sm()});
  int sms = 0;
  NODECOMM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return per_sm * sms;
}

}  // namespace nodecomm::cuda
