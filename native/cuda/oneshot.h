// oneshot.h — the host-side ABI of the CUDA one-shot all-reduce (defined in transport.cu).
#pragma once

#include <cstddef>
#include <cstdint>

namespace nodecomm::cuda {

// Every rank stages its input into its own slot, block pairs exchange epochs, then every rank sums
// all ranks' slots in rank order (fp32 accumulation, one rounding). `buffers` are every rank's
// buffer as mapped in this process (layout.h); all ranks launch with the same count, so the same
// grid. Graph-safe: the epoch and slot come from device memory, nothing is patched on the host.
// count * element size must fit in one slot.
void oneshot_all_reduce(const std::uintptr_t* buffers, int world_size, int rank, std::size_t slot_bytes,
                        std::uintptr_t input, std::uintptr_t output, std::size_t count, int dtype,
                        double timeout_s, std::uintptr_t stream);

// The error record of this rank's buffer: (code, rank waited for, epoch); synchronises the device.
void read_error(std::uintptr_t buffer, std::uint64_t record[3]);

}  // namespace nodecomm::cuda
