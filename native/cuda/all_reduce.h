// all_reduce.h — the host-side ABI of the CUDA all-reduce kernels (defined in transport.cu).
#pragma once

#include <cstddef>
#include <cstdint>

namespace nodecomm::cuda {

// Algorithms; equal to nodecomm.v1.Path values.
enum class Algorithm : int { kOneshot = 1, kTwoshot = 2 };

// Sum `count` elements across ranks on `stream`: fp32 accumulation in rank order, one rounding,
// the same bits for both algorithms. oneshot: stage, one block-pair barrier, every rank sums all
// slots. twoshot: stage, barrier, rank r reduces segment r into its slot, barrier, every rank
// gathers the segments. `buffers` are every rank's buffer as mapped in this process (layout.h);
// all ranks launch with the same count, so the same grid. Graph-safe: epochs and slots come from
// device memory, nothing is patched on the host. count * element size must fit in one slot.
void all_reduce(const std::uintptr_t* buffers, int world_size, int rank, std::size_t slot_bytes,
                std::uintptr_t input, std::uintptr_t output, std::size_t count, int dtype, Algorithm algorithm,
                double timeout_s, std::uintptr_t stream);

// The error record of this rank's buffer: (code, rank waited for, epoch); synchronises the device.
void read_error(std::uintptr_t buffer, std::uint64_t record[3]);

}  // namespace nodecomm::cuda
