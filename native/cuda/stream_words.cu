// stream_words.cu — stream_words.h over the driver's stream memory operations.
#include "stream_words.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <map>
#include <mutex>

#include "driver.h"
#include "layout.h"

namespace nodecomm::cuda {
namespace {

struct StreamWordApi {
  PFN_cuStreamWriteValue64_v11070 write = nullptr;
  PFN_cuStreamWaitValue64_v11070 wait = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 attribute = nullptr;
};

const StreamWordApi& stream_word_api() {
  static const StreamWordApi api = [] {
    StreamWordApi a;
    resolve("cuStreamWriteValue64", 11070, a.write);
    resolve("cuStreamWaitValue64", 11070, a.wait);
    resolve("cuDeviceGet", 2000, a.device_get);
    resolve("cuDeviceGetAttribute", 2000, a.attribute);
    return a;
  }();
  return api;
}

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
  NODECOMM_CU(stream_word_api().device_get(&handle, device));
  NODECOMM_CU(stream_word_api().attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, handle));
  return supported != 0;
}

void write_word(std::uintptr_t stream, std::uintptr_t address, std::uint64_t value) {
  NODECOMM_CU(stream_word_api().write(as_stream(stream), CUdeviceptr(address), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void wait_word(std::uintptr_t stream, std::uintptr_t address, std::uint64_t value) {
  // The writer's default write fences the work before it, so what the waiter reads after the
  // wait is what the writer's stream wrote before the word.
  NODECOMM_CU(stream_word_api().wait(as_stream(stream), CUdeviceptr(address), value, CU_STREAM_WAIT_VALUE_GEQ));
}

void prepare_write_now(int device) {
  DeviceScope scope(device);
  side_stream(device);
  stream_word_api();
}

void finish_writes_now(int device) {
  DeviceScope scope(device);
  NODECOMM_CUDA(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(side_stream(device))));
}

void write_word_now(int device, std::uintptr_t address, std::uint64_t value) {
  DeviceScope scope(device);
  NODECOMM_CU(stream_word_api().write(side_stream(device), CUdeviceptr(address), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void ask_to_stop(int device, std::uintptr_t buffer) {
  write_word_now(device, buffer + kStopAskedOffset, 1 + std::uint64_t(kAskedByHost));
}

}  // namespace nodecomm::cuda
