// stream_words.cu — stream_words.h over the driver's stream memory operations.
#include "stream_words.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>

#include "driver.h"
#include "layout.h"

namespace nodecomm::cuda {
namespace {

CUstream as_stream(std::uintptr_t stream) { return reinterpret_cast<CUstream>(stream); }

// One non-blocking stream per device for write_word_now, kept for the process's life: an abort
// should not pay for creating one (the caller makes it current).
CUstream side_stream(int device) {
  static std::mutex lock;
  static std::map<int, cudaStream_t> streams;
  const std::lock_guard<std::mutex> held(lock);
  cudaStream_t& stream = streams[device];
  if (stream == nullptr) NODECOMM_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return reinterpret_cast<CUstream>(stream);
}

}  // namespace

bool stream_words_supported(int device) {
  DeviceScope scope(device);  // the runtime's context first: the driver calls need one
  CUdevice handle = 0;
  int supported = 0;
  NODECOMM_CU(driver().device_get(&handle, device));
  NODECOMM_CU(driver().device_attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, handle));
  return supported != 0;
}

void write_word(std::uintptr_t stream, std::uintptr_t address, std::uint64_t value) {
  NODECOMM_CU(driver().stream_write_value(as_stream(stream), CUdeviceptr(address), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void wait_word(std::uintptr_t stream, std::uintptr_t address, std::uint64_t value) {
  // The writer's default write fences the work before it, so what the waiter reads after the
  // wait is what the writer's stream wrote before the word.
  NODECOMM_CU(driver().stream_wait_value(as_stream(stream), CUdeviceptr(address), value, CU_STREAM_WAIT_VALUE_GEQ));
}

void prepare_write_now(int device) {
  DeviceScope scope(device);
  side_stream(device);
  driver();
}

void finish_writes_now(int device) {
  DeviceScope scope(device);
  NODECOMM_CUDA(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(side_stream(device))));
}

void write_word_now(int device, std::uintptr_t address, std::uint64_t value) {
  DeviceScope scope(device);
  NODECOMM_CU(driver().stream_write_value(side_stream(device), CUdeviceptr(address), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void ask_to_stop(int device, std::uintptr_t buffer) {
  write_word_now(device, buffer + kStopAskedOffset, 1 + std::uint64_t(kAskedByHost));
}

}  // namespace nodecomm::cuda
