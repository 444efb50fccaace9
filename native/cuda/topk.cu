// topk.cu — the top-k owner exchange of topk.h: one kernel launch per stage.
//
// Block b of every rank: (1) waits until every owner retired its block-b rows of the slot two
// stages back, (2) writes its candidates for every owner's block-b rows into that owner's slab,
// (3) signals every owner and waits for every source's signal in its own slab, (4) copies its own
// block-b rows out and (5) tells every source they are retired. Signals are 64-bit stage numbers
// from per-block counters in device memory, so graph replays need no host patching; the slot is
// the stage's parity. Waits are bounded by the timeout and the group's abort word (sync.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "../agreement.h"
#include "../capabilities.h"
#include "../errors.h"
#include "driver.h"
#include "layout.h"
#include "signal.cuh"
#include "sync.cuh"
#include "topk.h"
#include "world.h"

namespace nodecomm::cuda {
namespace {

constexpr int kThreads = 256;
// Plane bytes one block aims to move per stage: enough to amortise its flag round trips.
constexpr std::size_t kBytesPerBlock = 64 << 10;

// Copies `rows` rows of `row_elements` 4-byte elements (row strides in elements) with every thread
// of the block, 16 bytes at a time when kVector (row_elements and every row start 16-byte aligned).
template <bool kVector>
__device__ __forceinline__ void copy_rows(std::int32_t* dst, std::size_t dst_stride, const std::int32_t* src,
                                          std::size_t src_stride, std::size_t rows, std::size_t row_elements) {
  if constexpr (kVector) {
    const std::size_t packs = row_elements / 4;
    for (std::size_t e = threadIdx.x; e < rows * packs; e += blockDim.x) {
      const std::size_t r = e / packs, p = e % packs;
      reinterpret_cast<int4*>(dst + r * dst_stride)[p] = reinterpret_cast<const int4*>(src + r * src_stride)[p];
    }
  } else {
    for (std::size_t e = threadIdx.x; e < rows * row_elements; e += blockDim.x) {
      const std::size_t r = e / row_elements, k = e % row_elements;
      dst[r * dst_stride + k] = src[r * src_stride + k];
    }
  }
}

template <int N, bool kVector>
__global__ void __launch_bounds__(kThreads)
    topk_stage_kernel(Peers<N> slabs, std::uint8_t* control, int rank, std::size_t rows, std::size_t rows_per_owner,
                      std::size_t topk, const std::int32_t* idx, const std::int32_t* scores, std::int32_t* out_idx,
                      std::int32_t* out_scores, TaggedCall call, std::uint64_t timeout_ns) {
  __shared__ std::uint64_t stage_shared;
  __shared__ int failed;
  std::uint8_t* mine = slabs.at(rank);
  const std::size_t block = blockIdx.x;
  if (threadIdx.x == 0) {
    std::uint64_t* stages = word(mine, kTopkStagesOffset + block * 8);
    stage_shared = *stages + 1;
    *stages = stage_shared;
    // A rank that gave up arrives nowhere any more: an owner still waiting at the stage it left
    // must not take a later stage's arrival for one that agreed with it.
    failed = load_volatile(word(mine, kTopkGaveUpOffset)) != 0;
  }
  __syncthreads();
  const std::uint64_t stage = stage_shared;
  const std::size_t plane = rows_per_owner * N * topk;  // elements
  const std::size_t slot = kTopkHeaderBytes + (stage & 1) * 2 * plane * 4;
  const std::size_t per = (rows + N - 1) / N;  // rows each owner gets this stage
  const std::size_t share = (rows_per_owner + gridDim.x - 1) / gridDim.x;
  const std::size_t first_row = block * share;  // this block's owned rows, before clipping to a stage
  const auto flag = [block](std::size_t offset, int r) { return offset + (block * kMaxRanks + r) * 8; };

  // (1) The slot's block-b rows of every owner: free once each owner retired them two stages ago.
  if (stage > 2 && threadIdx.x < N && !failed) {
    if (!wait_at_least(word(mine, flag(kTopkRetireOffset, threadIdx.x)), stage - 2, control, rank, threadIdx.x,
                       timeout_ns)) {
      failed = 1;
      store_volatile(word(mine, kTopkGaveUpOffset), 1);
    }
  }
  __syncthreads();
  if (failed) return;

  // (2) Owner o's row i gets this rank's candidates at [i, rank, :] of both planes.
  for (int owner = 0; owner < N; ++owner) {
    const std::size_t first = min(rows, std::size_t(owner) * per);
    const std::size_t owned = min(rows, first + per) - first;
    const std::size_t lo = min(owned, first_row), hi = min(owned, first_row + share);
    if (hi <= lo) continue;
    auto* planes = reinterpret_cast<std::int32_t*>(slabs.at(owner) + slot);
    const std::size_t at = (lo * N + rank) * topk;
    copy_rows<kVector>(planes + at, N * topk, idx + (first + lo) * topk, topk, hi - lo, topk);
    copy_rows<kVector>(planes + plane + at, N * topk, scores + (first + lo) * topk, topk, hi - lo, topk);
  }

  // (3) Written: tell every owner, with this stage's call, then wait until every source has
  // written into this slab with the same call.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < N) {
    const int source = threadIdx.x;
    store_release(word(slabs.at(source), flag(kTopkArriveOffset, rank)), arrival(stage, call));
    if (!wait_arrival(word(mine, flag(kTopkArriveOffset, source)), stage, call, control, rank, source, timeout_ns)) {
      failed = 1;
      store_volatile(word(mine, kTopkGaveUpOffset), 1);
    }
  }
  __syncthreads();
  if (failed) return;

  // (4) This block's rows of this rank's table: rows x sources x topk, contiguous in both.
  const std::size_t first = min(rows, std::size_t(rank) * per);
  const std::size_t owned = min(rows, first + per) - first;
  const std::size_t lo = min(owned, first_row), hi = min(owned, first_row + share);
  if (hi > lo) {
    const auto* planes = reinterpret_cast<const std::int32_t*>(mine + slot);
    const std::size_t begin = lo * N * topk, n = (hi - lo) * N * topk;
    copy_rows<kVector>(out_idx + begin, 0, planes + begin, 0, 1, n);
    copy_rows<kVector>(out_scores + begin, 0, planes + plane + begin, 0, 1, n);
  }

  // (5) Read: every source may rewrite these rows of this slot (two stages on).
  __syncthreads();
  if (threadIdx.x < N) store_release(word(slabs.at(threadIdx.x), flag(kTopkRetireOffset, rank)), stage);
}

bool aligned(std::uintptr_t address) { return address % 16 == 0; }

}  // namespace

int topk_blocks_per_sm() {
  int per_sm = 1 << 30;
  for (const int world_size : kWorldSizes) {
    for_world(world_size, [&](auto world) {
      constexpr int N = decltype(world)::value;
      if constexpr (N <= kTopkMaxRanks) {
        per_sm = std::min({per_sm, blocks_per_sm(topk_stage_kernel<N, true>, kThreads),
                           blocks_per_sm(topk_stage_kernel<N, false>, kThreads)});
      }
    });
  }
  return per_sm;
}

int topk_blocks(std::size_t rows_per_owner, int world_size, std::size_t topk, int max_blocks) {
  const std::size_t wanted = (topk_plane_bytes(rows_per_owner, world_size, topk) + kBytesPerBlock - 1) / kBytesPerBlock;
  const std::size_t cap = std::min({std::size_t(std::max(max_blocks, 1)), std::size_t(kMaxBlocks),
                                    std::max<std::size_t>(rows_per_owner, 1)});
  return int(std::clamp<std::size_t>(wanted, 1, cap));
}

void topk_stage(const TopkView& view, std::uintptr_t idx, std::uintptr_t scores, std::size_t rows,
                std::uintptr_t out_idx, std::uintptr_t out_scores, double timeout_s, cudaStream_t stream) {
  NODECOMM_CHECK(view.rank >= 0 && view.rank < view.world_size, "rank out of range");
  NODECOMM_CHECK(view.world_size >= 1 && view.world_size <= kTopkMaxRanks,
                 "top-k exchanges support world sizes 1-" + std::to_string(kTopkMaxRanks) + ", got " +
                     std::to_string(view.world_size));
  NODECOMM_CHECK(view.control != 0, "control segment address is null");
  NODECOMM_CHECK(view.blocks >= 1 && view.blocks <= kMaxBlocks,
                 "blocks " + std::to_string(view.blocks) + ": expected 1.." + std::to_string(kMaxBlocks));
  NODECOMM_CHECK(view.topk >= 1, "topk must be at least 1");
  NODECOMM_CHECK(rows <= view.rows_per_owner * std::size_t(view.world_size),
                 std::to_string(rows) + " rows exceed the exchange's " +
                     std::to_string(view.rows_per_owner * std::size_t(view.world_size)));
  // Even a stage of no rows is launched: the ranks' row counts meet in it.
  const bool vector = view.topk % 4 == 0 && aligned(idx) && aligned(scores) && aligned(out_idx) && aligned(out_scores);
  const std::uint64_t timeout = timeout_ns(timeout_s);
  for_world(view.world_size, [&](auto world) {
    constexpr int N = decltype(world)::value;
    if constexpr (N <= kTopkMaxRanks) {
      const Peers<N> slabs = peers_of<N>(view.slabs);
      const auto kernel = vector ? topk_stage_kernel<N, true> : topk_stage_kernel<N, false>;
      kernel<<<view.blocks, kThreads, 0, stream>>>(
          slabs, reinterpret_cast<std::uint8_t*>(view.control), view.rank, rows, view.rows_per_owner, view.topk,
          reinterpret_cast<const std::int32_t*>(idx), reinterpret_cast<const std::int32_t*>(scores),
          reinterpret_cast<std::int32_t*>(out_idx), reinterpret_cast<std::int32_t*>(out_scores),
          tagged(Call{Collective::kTopkStage, rows}.packed()), timeout);
      NODECOMM_CUDA(cudaGetLastError());
    }
  });
}

}  // namespace nodecomm::cuda
