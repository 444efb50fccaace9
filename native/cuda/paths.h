// paths.h — what each path's file gives collectives.cu, which checks a call and picks among them:
// the launches of one call, enqueued on `stream` (its arguments already checked), and the
// occupancy of kernels whose grids must be resident.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../codes.h"
#include "../errors.h"
#include "../rms_norm.h"
#include "../wire.h"
#include "collectives.h"
#include "sync.cuh"

namespace nodecomm::cuda {

// Each path's all-reduce runs over the lossless wire or a compressed one (../wire.h).
// oneshot.cu: pushed while the payload fits the push slots (oneshot_pushes), pulled past that.
void oneshot_all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                        DType dtype, wire::Wire format, TaggedCall call, std::uint64_t timeout_ns,
                        cudaStream_t stream);
// all_reduce_rms_norm in one kernel, pulled: every rank sums, adds and normalizes every row.
void oneshot_all_reduce_rms_norm(const GroupView& group, const norm::Rows& rows, DType dtype, TaggedCall call,
                                 std::uint64_t timeout_ns, cudaStream_t stream);
int oneshot_blocks_per_sm();

// twoshot.cu
void twoshot_all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                        DType dtype, wire::Wire format, TaggedCall call, std::uint64_t timeout_ns,
                        cudaStream_t stream);
// all_reduce_rms_norm in one kernel: each rank sums, adds and normalizes its share of the rows.
void twoshot_all_reduce_rms_norm(const GroupView& group, const norm::Rows& rows, DType dtype, TaggedCall call,
                                 std::uint64_t timeout_ns, cudaStream_t stream);
bool twoshot_fuses(const GroupView& group, const norm::Rows& rows, DType dtype);
int twoshot_blocks_per_sm();

// dma.cu: the copy paths (dma all-reduce, all_gather) and the signal between their steps, which
// is also the group's barrier and what a call of nothing meets at.
void dma_all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                    DType dtype, wire::Wire format, TaggedCall call, std::uint64_t timeout_ns, cudaStream_t stream,
                    const CopyPipeline& pipeline);
void meet_peers(const GroupView& group, TaggedCall call, std::uint64_t timeout_ns, cudaStream_t stream);

inline void check_group(const GroupView& group) {
  NODECOMM_CHECK(group.rank >= 0 && group.rank < group.world_size, "rank out of range");
  NODECOMM_CHECK(group.control != 0, "control segment address is null");
}

}  // namespace nodecomm::cuda
