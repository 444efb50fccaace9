// group.h — one rank's membership in a CUDA group: the peers' buffers as mapped here, the
// control segment registered with the device, the dma path's copy stream, and the thread that
// stops this rank's kernels when the group aborts (abort_watch.h). The Python
// Communicator holds one and calls it with the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../control.h"
#include "../wire.h"
#include "abort_watch.h"
#include "collectives.h"
#include "driver.h"
#include "layout.h"
#include "topk.h"

namespace nodecomm::cuda {

class CudaGroup {
 public:
  // `buffers`: every rank's buffer mapped on `device`; `control`: the host mapping of the group's
  // control segment, which this registers with the device for the kernels' abort checks.
  CudaGroup(int rank, int world_size, std::vector<std::uintptr_t> buffers, std::uintptr_t control,
            std::size_t capacity_bytes, int device, int max_blocks)
      : buffers_(std::move(buffers)), device_(device) {
    NODECOMM_CHECK(world_size >= 1 && world_size <= kMaxRanks,
                   "world_size " + std::to_string(world_size) + ": expected 1.." + std::to_string(kMaxRanks));
    NODECOMM_CHECK(rank >= 0 && rank < world_size, "rank out of range");
    NODECOMM_CHECK(int(buffers_.size()) == world_size, "expected one buffer per rank");
    NODECOMM_CHECK(control != 0, "control segment address is null");
    DeviceScope scope(device);
    NODECOMM_CHECK(max_blocks >= 1 && max_blocks <= kMaxBlocks,
                   "max_blocks " + std::to_string(max_blocks) + ": expected 1.." + std::to_string(kMaxBlocks));
    NODECOMM_CUDA(cudaHostRegister(reinterpret_cast<void*>(control), control::kControlBytes,
                                   cudaHostRegisterMapped | cudaHostRegisterPortable));
    control_host_ = control;
    try {
      void* device_control = nullptr;
      NODECOMM_CUDA(cudaHostGetDevicePointer(&device_control, reinterpret_cast<void*>(control), 0));
      NODECOMM_CUDA(cudaStreamCreateWithFlags(&pipeline_.copy_stream, cudaStreamNonBlocking));
      NODECOMM_CUDA(cudaEventCreateWithFlags(&pipeline_.fork, cudaEventDisableTiming));
      NODECOMM_CUDA(cudaEventCreateWithFlags(&pipeline_.ready, cudaEventDisableTiming));
      view_ = GroupView{buffers_.data(), world_size, rank, capacity_bytes,
                        reinterpret_cast<std::uintptr_t>(device_control), max_blocks};
      watch_ = std::make_unique<AbortWatch>(control, device, buffers_[rank]);
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaGroup() { release(); }
  CudaGroup(const CudaGroup&) = delete;
  CudaGroup& operator=(const CudaGroup&) = delete;

  // A call larger than a slot runs as pieces of a slot each (over a compressed wire, of what a slot
  // holds encoded and reduced), every piece carrying the whole call's count, which the ranks
  // compare; a call of nothing still meets the peers once.
  void all_reduce(std::uintptr_t input, std::uintptr_t output, std::size_t count, DType dtype, Path path,
                  int wire, double timeout_s, std::uintptr_t stream) {
    const wire::Wire format = wire::wire_of(wire);
    refuse_if_stopped(Call{Collective::kAllReduce, count, int(dtype), int(path), wire});
    DeviceScope scope(device_);
    const std::size_t element = dtype_bytes(dtype);
    const std::size_t per_piece = format == wire::Wire::kLossless
                                      ? view_.capacity_bytes / element
                                      : wire::elements_per_slot(view_.capacity_bytes, element);
    NODECOMM_CHECK(per_piece > 0, "a slot of " + std::to_string(view_.capacity_bytes) + " bytes holds no piece");
    for (std::size_t start = 0; start < std::max<std::size_t>(count, 1); start += per_piece) {
      const std::size_t offset = start * element;
      cuda::all_reduce(view_, input + offset, output + offset, std::min(per_piece, count - start), count, dtype,
                       path, wire, timeout_s, reinterpret_cast<cudaStream_t>(stream), pipeline_);
    }
  }

  // all_reduce_rms_norm on a kernel path (../rms_norm.h's Rows): one kernel where fused_norm
  // allows, else the all-reduce into out (in pieces, comparing the count) and the norm after it.
  void all_reduce_rms_norm(const norm::Rows& rows, DType dtype, Path path, double timeout_s, std::uintptr_t stream) {
    rows.check();
    const auto on = reinterpret_cast<cudaStream_t>(stream);
    if (fused_norm(view_, rows, dtype, path)) {
      refuse_if_stopped(rows.call(dtype, path));
      DeviceScope scope(device_);
      return cuda::all_reduce_rms_norm(view_, rows, dtype, path, timeout_s, on);
    }
    all_reduce(rows.input, rows.out, rows.count(), dtype, path, int(wire::Wire::kLossless), timeout_s, stream);
    DeviceScope scope(device_);
    cuda::add_rms_norm(rows.summed(), dtype, on);
  }

  // Every rank's piece of a call together fills at most a slot; pieces start 256-byte aligned.
  void all_gather(std::uintptr_t input, std::uintptr_t output, std::size_t nbytes, double timeout_s,
                  std::uintptr_t stream) {
    refuse_if_stopped(Call{Collective::kAllGather, nbytes});
    DeviceScope scope(device_);
    const std::size_t share = view_.capacity_bytes / std::size_t(view_.world_size);
    const std::size_t per_piece = share >= 256 ? share / 256 * 256 : share;
    for (std::size_t offset = 0; offset < std::max<std::size_t>(nbytes, 1); offset += per_piece) {
      cuda::all_gather(view_, input + offset, output + offset, std::min(per_piece, nbytes - offset), nbytes, timeout_s,
                       reinterpret_cast<cudaStream_t>(stream));
    }
  }

  void barrier(double timeout_s, std::uintptr_t stream) {
    refuse_if_stopped(Call{Collective::kBarrier});
    DeviceScope scope(device_);
    cuda::barrier(view_, timeout_s, reinterpret_cast<cudaStream_t>(stream));
  }

  // One stage of a top-k exchange whose slabs (every rank's, mapped here) the daemon laid out
  // for rows_per_owner and topk, with the grid it chose (topk.h).
  void topk_stage(const std::vector<std::uintptr_t>& slabs, std::size_t rows_per_owner, std::size_t topk, int blocks,
                  std::uintptr_t idx, std::uintptr_t scores, std::size_t rows, std::uintptr_t out_idx,
                  std::uintptr_t out_scores, double timeout_s, std::uintptr_t stream) {
    NODECOMM_CHECK(int(slabs.size()) == view_.world_size, "expected one slab per rank");
    refuse_if_stopped(Call{Collective::kTopkStage, rows});
    DeviceScope scope(device_);
    const TopkView view{slabs.data(), view_.world_size, view_.rank, rows_per_owner, topk, view_.control, blocks};
    cuda::topk_stage(view, idx, scores, rows, out_idx, out_scores, timeout_s, reinterpret_cast<cudaStream_t>(stream));
  }

  // Proves that this rank can write every peer's buffer through its mapping and that every peer's
  // write reached this rank: rank r writes a tag derived from `nonce` into probe[r] of every
  // buffer, then reads its own probe area until every peer's tag is there. Returns "" when every
  // directed pair works, else what failed. Synchronous; call it before any collective.
  std::string check_peers(std::uint64_t nonce, double timeout_s) {
    DeviceScope scope(device_);
    const int rank = view_.rank, world = view_.world_size;
    for (int p = 0; p < world; ++p) {
      const std::uint64_t tag = probe_tag(nonce, rank, p);
      void* target = reinterpret_cast<void*>(buffers_[p] + kProbeOffset + 8 * std::size_t(rank));
      const cudaError_t status = cudaMemcpy(target, &tag, 8, cudaMemcpyHostToDevice);
      if (status != cudaSuccess) {
        cudaGetLastError();
        return "writing rank " + std::to_string(p) + "'s buffer failed: " + cudaGetErrorString(status);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    std::uint64_t seen[kMaxRanks] = {};
    while (true) {
      const cudaError_t status = cudaMemcpy(seen, reinterpret_cast<const void*>(buffers_[rank] + kProbeOffset),
                                            8 * std::size_t(world), cudaMemcpyDeviceToHost);
      if (status != cudaSuccess) {
        cudaGetLastError();
        return std::string("reading this rank's buffer failed: ") + cudaGetErrorString(status);
      }
      std::string missing;
      for (int p = 0; p < world; ++p) {
        if (seen[p] != probe_tag(nonce, p, rank)) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
      }
      if (missing.empty()) return "";
      if (std::chrono::steady_clock::now() > deadline) {
        return "the writes of ranks [" + missing + "] did not arrive in this rank's buffer within " +
               std::to_string(timeout_s) + " s";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Whether oneshot pushes an all-reduce of `nbytes` (its pieces, past a slot).
  bool oneshot_pushes(std::size_t nbytes) const {
    return cuda::oneshot_pushes(view_, std::min(nbytes, view_.capacity_bytes));
  }

  int rank() const { return view_.rank; }
  int world_size() const { return view_.world_size; }
  int device() const { return device_; }

 private:
  // A group a mismatch stopped (control.h) runs nothing more: this raises GroupMismatchError,
  // whose message the caller builds from the ranks' records, once this rank's record is there.
  // Kernels already queued record their call as they notice the abort, within a poll interval
  // each, so they get a moment first; a rank that never launched the call its peers disagreed on
  // records `call`, the one it was about to make, which is that call.
  void refuse_if_stopped(const Call& call) {
    if (control::abort_state(control_host_).first != control::kMismatch) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
    while (control::error_record(control_host_, view_.rank).code != control::kErrorMismatch &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    control::record_refused_call(control_host_, view_.rank, call.packed());
    NODECOMM_RAISE(kGroupMismatch, "the group stopped at a mismatch");
  }

  static std::uint64_t probe_tag(std::uint64_t nonce, int writer, int owner) {
    return (nonce * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t(writer + 1) << 40) ^ (std::uint64_t(owner + 1) << 20) ^ 1;
  }

  // Frees what the constructor made; the caller must have synchronised work that uses it.
  void release() {
    watch_.reset();
    if (pipeline_.ready != nullptr) cudaEventDestroy(pipeline_.ready);
    if (pipeline_.fork != nullptr) cudaEventDestroy(pipeline_.fork);
    if (pipeline_.copy_stream != nullptr) cudaStreamDestroy(pipeline_.copy_stream);
    if (control_host_ != 0) cudaHostUnregister(reinterpret_cast<void*>(control_host_));
    pipeline_ = CopyPipeline{};
    control_host_ = 0;
  }

  std::vector<std::uintptr_t> buffers_;
  int device_;
  std::uintptr_t control_host_ = 0;
  CopyPipeline pipeline_{};
  GroupView view_{};
  std::unique_ptr<AbortWatch> watch_;  // stops this rank's kernels the moment the group aborts
};

}  // namespace nodecomm::cuda
