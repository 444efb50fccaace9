// topk.h — the CUDA top-k owner exchange: every source rank writes its candidates for a row
// straight into the row owner's slab, and the owner copies out [owned_rows, world_size, topk]
// (defined in topk.cu). Host ABI; the layout is shared with the daemon, which allocates the slabs.
//
// Each rank's slab lives on its GPU and every rank maps it:
//   stages    kMaxBlocks counters: block b of this rank's stages so far (picks the slot)
//   arrive    kMaxBlocks x kMaxRanks: source s stores its arrival at stage n (sync.cuh: the
//             stage and a digest of its call, its row count) into arrive[b][s] of the owner's
//             slab once its block b wrote its rows of stage n there; the owner compares the
//             digest with its own before it copies anything out
//   retire    kMaxBlocks x kMaxRanks: owner o stores stage n into retire[b][o] of every source's
//             slab once its block b copied those rows out; a source writes stage n + 2 (the same
//             slot) into o's block-b rows only after retire[b][o] reached n
//   slots     two, each an index plane then a score plane of [rows_per_owner, world_size, topk]
//             4-byte elements: the layout of nodecomm.topk_layout, behind this header
// Block b of every rank handles the same owned rows, [b * share, (b + 1) * share) with
// share = ceil(rows_per_owner / blocks), whatever a stage's row count: block pairs stay pairs
// across stages, which is why every rank must run the exchange's one grid.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "layout.h"

namespace nodecomm::cuda {

constexpr std::size_t kTopkStagesOffset = 0;
constexpr std::size_t kTopkArriveOffset = kTopkStagesOffset + kMaxBlocks * 8;
constexpr std::size_t kTopkRetireOffset = kTopkArriveOffset + std::size_t(kMaxBlocks) * kMaxRanks * 8;
// One word, set once a wait of this rank's stages failed: its later stages arrive nowhere.
constexpr std::size_t kTopkGaveUpOffset = kTopkRetireOffset + std::size_t(kMaxBlocks) * kMaxRanks * 8;
constexpr std::size_t kTopkHeaderBytes = (kTopkGaveUpOffset + 8 + 255) / 256 * 256;

inline std::size_t topk_plane_bytes(std::size_t rows_per_owner, int world_size, std::size_t topk) {
  return rows_per_owner * std::size_t(world_size) * topk * 4;
}

inline std::size_t topk_slab_bytes(std::size_t rows_per_owner, int world_size, std::size_t topk) {
  return kTopkHeaderBytes + 4 * topk_plane_bytes(rows_per_owner, world_size, topk);
}

// The exchange's grid: from its geometry and the group's block cap, so every rank gets the same.
int topk_blocks(std::size_t rows_per_owner, int world_size, std::size_t topk, int max_blocks);

// Blocks of the stage kernel that fit on one SM of the current device at once (its fewest over
// world sizes and copy widths): its blocks wait on peers' blocks, so its grid must be resident.
int topk_blocks_per_sm();

// One rank's view of an exchange: every rank's slab as mapped here, in rank order.
struct TopkView {
  const std::uintptr_t* slabs;
  int world_size;
  int rank;
  std::size_t rows_per_owner;
  std::size_t topk;
  std::uintptr_t control;  // the group's control segment, as the device addresses it
  int blocks;              // topk_blocks(...), the same on every rank
};

// Enqueue one stage on `stream`: idx and scores are this rank's [rows, topk] int32 / float32
// candidates (rows <= world_size * rows_per_owner, the same on every rank: where they differ,
// every rank records the mismatch, aborts the group and writes no output); out_idx and
// out_scores receive this rank's owner table, [owned, world_size, topk] each, scores as bits.
void topk_stage(const TopkView& view, std::uintptr_t idx, std::uintptr_t scores, std::size_t rows,
                std::uintptr_t out_idx, std::uintptr_t out_scores, double timeout_s, cudaStream_t stream);

}  // namespace nodecomm::cuda
