// stream_words.h — 64-bit words in device memory that streams of different processes order by,
// with no event and no shared /dev/shm: a stream writes a word once the work before it ran,
// another stream waits until the word reaches a value (cuStreamWriteValue64 / WaitValue64, which
// the GPU's front end runs without an SM). The service path's "input ready" and "done" counters
// (layout.h) are such words; and the stop word, which whoever sees a group abort sets so that its
// kernels stop at once.
#pragma once

#include <cstdint>

namespace nodecomm::cuda {

// Whether `device` runs 64-bit stream memory operations (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS).
bool stream_words_supported(int device);

// Enqueue on `stream` (a cudaStream_t): write `value` to the word at `address` once the work
// before it ran (visible to other processes and the host: system scope).
void write_word(std::uintptr_t stream, std::uintptr_t address, std::uint64_t value);

// Enqueue on `stream`: work after this starts once the word at `address` is at least `value`,
// compared cyclically as the driver does: (int64_t)(word - value) >= 0 (the words only grow, and
// stay below 2^62: layout.h's kServiceReleased).
void wait_word(std::uintptr_t stream, std::uintptr_t address, std::uint64_t value);

// Write `value` to the word at `address`, mapped in this process on `device`, now: on a side
// stream of the device's, ordered after nothing, not waited for (a stream already waiting on that
// device may wait for this very word).
void write_word_now(int device, std::uintptr_t address, std::uint64_t value);
// Make the side stream (and the driver calls) ready before an abort needs them.
void prepare_write_now(int device);
// Wait until every write_word_now on `device` so far has landed.
void finish_writes_now(int device);

// The "asked to stop" word of the rank buffer at `buffer` (layout.h), set to "the host asked": the
// rank's running waits end at their next clock check and its queued kernels return at their start.
void ask_to_stop(int device, std::uintptr_t buffer);

}  // namespace nodecomm::cuda
