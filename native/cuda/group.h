// group.h — one rank's membership in a CUDA group: the peers' buffers as mapped here, the
// control segment registered with the device, and the dma path's copy stream. The Python
// Communicator holds one and calls it with the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../control.h"
#include "collectives.h"
#include "driver.h"
#include "layout.h"

namespace nodecomm::cuda {

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    NODECOMM_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) NODECOMM_CUDA(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

class CudaGroup {
 public:
  // `buffers`: every rank's buffer mapped on `device`; `control`: the host mapping of the group's
  // control segment, which this registers with the device for the kernels' abort checks.
  CudaGroup(int rank, int world_size, std::vector<std::uintptr_t> buffers, std::uintptr_t control,
            std::size_t slot_bytes, int device)
      : buffers_(std::move(buffers)), device_(device) {
    NODECOMM_CHECK(world_size >= 1 && world_size <= kMaxRanks,
                   "world_size " + std::to_string(world_size) + ": expected 1.." + std::to_string(kMaxRanks));
    NODECOMM_CHECK(rank >= 0 && rank < world_size, "rank out of range");
    NODECOMM_CHECK(int(buffers_.size()) == world_size, "expected one buffer per rank");
    NODECOMM_CHECK(control != 0, "control segment address is null");
    DeviceScope scope(device);
    NODECOMM_CUDA(cudaHostRegister(reinterpret_cast<void*>(control), control::kControlBytes,
                                   cudaHostRegisterMapped | cudaHostRegisterPortable));
    control_host_ = control;
    try {
      void* device_control = nullptr;
      NODECOMM_CUDA(cudaHostGetDevicePointer(&device_control, reinterpret_cast<void*>(control), 0));
      NODECOMM_CUDA(cudaStreamCreateWithFlags(&pipeline_.copy_stream, cudaStreamNonBlocking));
      NODECOMM_CUDA(cudaEventCreateWithFlags(&pipeline_.fork, cudaEventDisableTiming));
      NODECOMM_CUDA(cudaEventCreateWithFlags(&pipeline_.ready, cudaEventDisableTiming));
      view_ = GroupView{buffers_.data(), world_size, rank, slot_bytes, reinterpret_cast<std::uintptr_t>(device_control)};
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaGroup() { release(); }
  CudaGroup(const CudaGroup&) = delete;
  CudaGroup& operator=(const CudaGroup&) = delete;

  void all_reduce(std::uintptr_t input, std::uintptr_t output, std::size_t count, int dtype, int algorithm,
                  double timeout_s, std::uintptr_t stream) {
    DeviceScope scope(device_);
    cuda::all_reduce(view_, input, output, count, dtype, Algorithm(algorithm), timeout_s,
                     reinterpret_cast<cudaStream_t>(stream), pipeline_);
  }

  void all_gather(std::uintptr_t input, std::uintptr_t output, std::size_t nbytes, std::size_t output_stride,
                  double timeout_s, std::uintptr_t stream) {
    DeviceScope scope(device_);
    cuda::all_gather(view_, input, output, nbytes, output_stride, timeout_s, reinterpret_cast<cudaStream_t>(stream));
  }

  void barrier(double timeout_s, std::uintptr_t stream) {
    DeviceScope scope(device_);
    cuda::barrier(view_, timeout_s, reinterpret_cast<cudaStream_t>(stream));
  }

  int rank() const { return view_.rank; }
  int world_size() const { return view_.world_size; }
  int device() const { return device_; }

 private:
  // Frees what the constructor made; the caller must have synchronised work that uses it.
  void release() {
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
};

}  // namespace nodecomm::cuda
