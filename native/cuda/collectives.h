// collectives.h — the host-side ABI of the CUDA transport: all_reduce in collectives.cu, which
// picks the path's file (paths.h); all_gather and barrier in dma.cu.
//
// Every call enqueues on the caller's stream and returns; nothing synchronises the host, nothing
// is patched on the host between launches, so every call can be captured in a CUDA graph and
// replayed. All ranks must make the same calls with the same sizes in the same order; where they
// do not, the first barrier or pushed line of the call finds it, every rank records its own call
// in its error record, the group is aborted (control.h), and nothing is written to the output.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../codes.h"
#include "../rms_norm.h"

namespace nodecomm::cuda {

// One rank's view of a group: every rank's buffer as mapped in this process (layout.h), and the
// group's control segment (../control.h) as the device addresses it.
struct GroupView {
  const std::uintptr_t* buffers;
  int world_size;
  int rank;
  std::size_t capacity_bytes;
  std::uintptr_t control;
  int max_blocks;  // kernel grids stay within this, the same on every rank (the daemon's choice)
};

// What the dma path needs besides the caller's stream: a second stream that pulls peers'
// segments while the caller's stream reduces the previous chunk, and two events to hand work
// between them. Owned by the caller, used by one collective at a time.
struct CopyPipeline {
  cudaStream_t copy_stream;
  cudaEvent_t fork;
  cudaEvent_t ready;
};

// Sum `count` elements of `dtype` across ranks into `output` (may equal
// `input`): fp32 accumulation in rank order 0..n-1, one rounding, the same bits for every
// path.
//   oneshot  payloads that fit the push slots (layout.h): every rank writes its input, flagged,
//            into every peer's push slot and sums what arrives in its own; larger ones: stage
//            into this launch's slot, one barrier, every rank sums every slot
//   twoshot  stage, barrier, rank r reduces segment r in place, barrier, every rank gathers
//   dma      copy engines stage the input, pull this rank's segment of every peer's slot and
//            gather the peers' sums into slot 1; SM kernels reduce, signal and copy the sums out;
//            fixed slots, so four barriers order the reuse
// Over a compressed wire (nodecomm.v1.Wire; ../wire.h) each rank's input is quantized once and
// the paths sum the dequantized values the same way: oneshot pulls, twoshot and dma gather the
// sums in the element type, so all three give the same bits.
// count * element size (compressed: count at most wire::elements_per_slot) must fit in one slot;
// call_count is the element count of the whole call this piece belongs to, which the ranks
// compare (so a call in pieces disagrees at its first). A count of 0 still meets the peers at one
// barrier.
void all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                std::size_t call_count, DType dtype, Path path, int wire, double timeout_s,
                cudaStream_t stream, const CopyPipeline& pipeline);

// all_reduce_rms_norm in one kernel on `path` (oneshot or twoshot): the rows' all-reduce (as
// all_reduce's), then residual_out = sum + residual and out = rms_norm(residual_out) * weight in
// the order of ../rms_norm.h, the bits of all_reduce followed by add_rms_norm. The ranks compare
// the shape (rows and hidden size), not only the count. Only for calls fused_norm() accepts.
void all_reduce_rms_norm(const GroupView& group, const norm::Rows& rows, DType dtype, Path path, double timeout_s,
                         cudaStream_t stream);
// Whether a call of these rows on `path` runs as one kernel: oneshot or twoshot, 16-byte aligned
// pointers and rows of whole chunks, and a payload that fits the slot (twoshot: twice, since its
// owners keep both results there).
bool fused_norm(const GroupView& group, const norm::Rows& rows, DType dtype, Path path);

// The add and norm alone, rows.input holding the all-reduce's sum: a block per row on `stream`.
void add_rms_norm(const norm::Rows& rows, DType dtype, cudaStream_t stream);

// Whether oneshot pushes a piece of `nbytes` (into peers' push slots) rather than pulling it
// (from peers' staging slots): the variant a call takes, for whoever times or reports it.
bool oneshot_pushes(const GroupView& group, std::size_t nbytes);

// Rank r's `nbytes` land at output + r * output_stride on every rank (copy engines into this
// rank's slot 1, a kernel from there; world_size * nbytes must fit in one slot; the stride lets
// callers gather a large payload in pieces, and is the whole call's bytes, which the ranks compare).
void all_gather(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t nbytes,
                std::size_t output_stride, double timeout_s, cudaStream_t stream);

// How many blocks of any kernel with block-pair waits (all-reduce, top-k) fit on `device` at once. Every rank's whole grid must
// be resident, or block pairs could wait on blocks that never get an SM: where several ranks share
// a GPU, their grids together.
int resident_blocks(int device);

// Work after this on `stream` starts only once every rank's stream has reached its barrier.
void barrier(const GroupView& group, double timeout_s, cudaStream_t stream);

}  // namespace nodecomm::cuda
