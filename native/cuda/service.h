// service.h — the daemon's CUDA executor for the service path: collectives that ranks submit and
// the daemon runs on their device allocations, on a stream of its own, ordered after each rank's
// "input ready" event and followed by a "done" event the ranks' streams wait on. Nothing here
// waits on the host. Addresses are the daemon's mappings of the ranks' allocations, in rank
// order, readable from `device` (the group's executing GPU); the caller has bounds-checked them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../codes.h"

namespace nodecomm::cuda::service {

// A stream on `device` that does not synchronise with the legacy default stream.
std::uintptr_t stream_create(int device);
void stream_destroy(std::uintptr_t stream);
// Whether everything enqueued on `stream` has run (cudaStreamQuery): the daemon polls it before
// unmapping memory the stream used, since the stream may wait on a rank that never gets there.
bool stream_idle(int device, std::uintptr_t stream);

// An event other processes can wait on (interprocess, no timing): the event, and its 64-byte
// cudaIpcEventHandle_t for them.
std::uintptr_t ipc_event_create(int device, std::string* handle);
// Another process's event from its handle.
std::uintptr_t ipc_event_open(int device, const std::string& handle);
void event_destroy(std::uintptr_t event);

// Work enqueued on `stream` after this starts once `event` (as last recorded) has completed.
void wait_event(int device, std::uintptr_t stream, std::uintptr_t event);
void record_event(int device, std::uintptr_t event, std::uintptr_t stream);

// Every output gets the sum of every input: fp32 accumulation in rank order 0..n-1, one rounding,
// the same bits as every other path. An output may be its rank's input.
void all_reduce(int device, const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                std::size_t count, DType dtype, std::uintptr_t stream);

// Rank r's nbytes land at outputs[q] + r * nbytes for every q: copies, so copy engines move them.
void all_gather(int device, const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                std::size_t nbytes, std::uintptr_t stream);

// The top-k owner exchange, laid out as the host executor's (../service.h): inputs[s] holds source
// s's [rows, topk] int32 indices then float32 scores; outputs[o] owner o's [owned, n, topk] indices
// then scores. Strided copies, so copy engines move them; scores move as bits.
void topk_stage(int device, const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                std::size_t rows, std::size_t topk, std::uintptr_t stream);

}  // namespace nodecomm::cuda::service
