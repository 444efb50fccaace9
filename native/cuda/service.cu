// service.cu — the daemon's CUDA executor for the service path (service.h).
#include "service.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "../errors.h"
#include "../topk_rows.h"
#include "driver.h"
#include "layout.h"
#include "numerics.cuh"

namespace nodecomm::cuda::service {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxGridBlocks = 1024;

struct Pointers {
  const void* input[kMaxRanks];
  void* output[kMaxRanks];
};

// Grid-stride over elements: each element of every input is read before that element of any
// output is written (by the same thread), so an output may be its rank's input.
template <typename T>
__global__ void __launch_bounds__(kThreads) reduce_kernel(Pointers p, int ranks, std::size_t count) {
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += std::size_t(gridDim.x) * blockDim.x) {
    float sum = widen(static_cast<const T*>(p.input[0])[i]);
    for (int r = 1; r < ranks; ++r) sum += widen(static_cast<const T*>(p.input[r])[i]);
    const T value = narrow<T>(sum);
    for (int r = 0; r < ranks; ++r) static_cast<T*>(p.output[r])[i] = value;
  }
}

template <typename T>
void launch_reduce(const Pointers& p, int ranks, std::size_t count, cudaStream_t stream) {
  const std::size_t wanted = (count + kThreads - 1) / kThreads;
  const int blocks = int(std::clamp<std::size_t>(wanted, 1, kMaxGridBlocks));
  reduce_kernel<T><<<blocks, kThreads, 0, stream>>>(p, ranks, count);
  NODECOMM_CUDA(cudaGetLastError());
}

void check_ranks(const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs) {
  NODECOMM_CHECK(!inputs.empty() && inputs.size() <= std::size_t(kMaxRanks),
                 "expected 1.." + std::to_string(kMaxRanks) + " inputs, got " + std::to_string(inputs.size()));
  NODECOMM_CHECK(inputs.size() == outputs.size(), "expected one output per input, got " +
                                                      std::to_string(outputs.size()) + " for " +
                                                      std::to_string(inputs.size()));
}

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }
cudaEvent_t as_event(std::uintptr_t event) { return reinterpret_cast<cudaEvent_t>(event); }

}  // namespace

std::uintptr_t stream_create(int device) {
  DeviceScope scope(device);
  cudaStream_t stream = nullptr;
  NODECOMM_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return reinterpret_cast<std::uintptr_t>(stream);
}

void stream_destroy(std::uintptr_t stream) { NODECOMM_CUDA(cudaStreamDestroy(as_stream(stream))); }

bool stream_idle(int device, std::uintptr_t stream) {
  DeviceScope scope(device);
  const cudaError_t status = cudaStreamQuery(as_stream(stream));
  if (status == cudaErrorNotReady) return false;
  NODECOMM_CUDA(status);
  return true;
}

std::uintptr_t ipc_event_create(int device, std::string* handle) {
  DeviceScope scope(device);
  cudaEvent_t event = nullptr;
  NODECOMM_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcEventHandle_t exported{};
  const cudaError_t status = cudaIpcGetEventHandle(&exported, event);
  if (status != cudaSuccess) {
    cudaEventDestroy(event);
    NODECOMM_CUDA(status);
  }
  handle->assign(exported.reserved, sizeof exported.reserved);
  return reinterpret_cast<std::uintptr_t>(event);
}

std::uintptr_t ipc_event_open(int device, const std::string& handle) {
  const auto imported = ipc_handle_from<cudaIpcEventHandle_t>(handle, "an event");
  DeviceScope scope(device);
  cudaEvent_t event = nullptr;
  NODECOMM_CUDA(cudaIpcOpenEventHandle(&event, imported));
  return reinterpret_cast<std::uintptr_t>(event);
}

void event_destroy(std::uintptr_t event) { NODECOMM_CUDA(cudaEventDestroy(as_event(event))); }

void wait_event(int device, std::uintptr_t stream, std::uintptr_t event) {
  DeviceScope scope(device);
  NODECOMM_CUDA(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
}

void record_event(int device, std::uintptr_t event, std::uintptr_t stream) {
  DeviceScope scope(device);
  NODECOMM_CUDA(cudaEventRecord(as_event(event), as_stream(stream)));
}

void all_reduce(int device, const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                std::size_t count, DType dtype, std::uintptr_t stream) {
  check_ranks(inputs, outputs);
  if (count == 0) return;
  Pointers p{};
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    p.input[r] = reinterpret_cast<const void*>(inputs[r]);
    p.output[r] = reinterpret_cast<void*>(outputs[r]);
  }
  DeviceScope scope(device);
  const int ranks = int(inputs.size());
  for_dtype<DeviceElements>(dtype, [&](auto element) {
    launch_reduce<typename decltype(element)::type>(p, ranks, count, as_stream(stream));
  });
}

void all_gather(int device, const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                std::size_t nbytes, std::uintptr_t stream) {
  check_ranks(inputs, outputs);
  if (nbytes == 0) return;
  DeviceScope scope(device);
  for (std::size_t q = 0; q < outputs.size(); ++q) {
    for (std::size_t r = 0; r < inputs.size(); ++r) {
      NODECOMM_CUDA(cudaMemcpyAsync(reinterpret_cast<std::uint8_t*>(outputs[q]) + r * nbytes,
                                    reinterpret_cast<const void*>(inputs[r]), nbytes, cudaMemcpyDefault,
                                    as_stream(stream)));
    }
  }
}

void topk_stage(int device, const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                std::size_t rows, std::size_t topk, std::uintptr_t stream) {
  check_ranks(inputs, outputs);
  if (rows == 0 || topk == 0) return;
  DeviceScope scope(device);
  const std::size_t n = inputs.size();
  const std::size_t row_bytes = topk * 4;
  for (std::size_t owner = 0; owner < n; ++owner) {
    const auto [first, owned] = owned_rows(rows, n, owner);
    if (owned == 0) continue;
    auto* out = reinterpret_cast<std::uint8_t*>(outputs[owner]);
    const std::size_t plane = owned * n * row_bytes;  // bytes of the owner's index plane
    for (std::size_t s = 0; s < n; ++s) {
      const auto* in = reinterpret_cast<const std::uint8_t*>(inputs[s]);
      // Rows [first, first + owned) of source s, one row of the table's n per owned row.
      for (const std::size_t offset : {std::size_t(0), rows * row_bytes}) {
        NODECOMM_CUDA(cudaMemcpy2DAsync(out + (offset ? plane : 0) + s * row_bytes, n * row_bytes,
                                        in + offset + first * row_bytes, row_bytes, row_bytes, owned,
                                        cudaMemcpyDefault, as_stream(stream)));
      }
    }
  }
}

}  // namespace nodecomm::cuda::service
