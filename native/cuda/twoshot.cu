// twoshot.cu — twoshot all-reduce: stage into this launch's slot, barrier, rank r reduces segment
// r of every block's share (into its slot and the output), barrier, every rank gathers the other
// segments from their owners' slots. Over a compressed wire the same steps on the encoding
// (wire_codec.cuh): encode, barrier, rank r sums segment r dequantized and keeps it behind the
// encoding in the element type, barrier, every rank gathers those sums: nothing is quantized twice,
// so twoshot gives oneshot's bits.
#include <cuda_runtime.h>

#include <algorithm>

#include "../errors.h"
#include "driver.h"
#include "pack.cuh"
#include "paths.h"
#include "rms_norm.cuh"
#include "signal.cuh"
#include "wire_codec.cuh"
#include "world.h"

namespace nodecomm::cuda {
namespace {

template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads)
    twoshot_kernel(__grid_constant__ const Signal<N> signal, std::size_t slot_stride, const T* input, T* output,
                   std::size_t count, TaggedCall call) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const std::size_t slot = kSlotOffset + (signal.next_launch() & 1) * slot_stride;
  const BlockShare share = block_share<T>(count);
  T* staged = reinterpret_cast<T*>(signal.mine() + slot);
  block_copy<T, kVector>(input, staged, share.begin, share.end);
  if (!signal.barrier(&failed, call, true)) return;

  // Element i of every rank's slot.
  const auto slots_at = [&signal, slot](std::size_t i) {
    return [&signal, slot, i](int r) { return reinterpret_cast<const T*>(signal.peers.at(r) + slot) + i; };
  };
  const std::size_t segment = round_to_packs<T>((share.end - share.begin + N - 1) / N);
  const auto segment_of = [&](int r) {
    const std::size_t lo = min(share.end, share.begin + std::size_t(r) * segment);
    return BlockShare{lo, min(share.end, lo + segment)};
  };
  const BlockShare own = segment_of(signal.rank);
  block_for<T, kVector>(
      own.begin, own.end,
      [&](std::size_t i) {
        const Pack<T> value = sum_pack<T, N>(slots_at(i));
        store_pack(staged + i, value);
        store_pack(output + i, value);
      },
      [&](std::size_t i) {
        const T value = sum_element<T, N>(slots_at(i));
        staged[i] = value;
        output[i] = value;
      });
  if (!signal.barrier(&failed, call, true)) return;
  for (int r = 0; r < N; ++r) {
    if (r == signal.rank) continue;
    const BlockShare theirs = segment_of(r);
    block_copy<T, kVector>(reinterpret_cast<const T*>(signal.peers.at(r) + slot), output, theirs.begin, theirs.end);
  }
}

template <typename T, int N, bool kVector>
__global__ void __launch_bounds__(kThreads)
    wire_twoshot_kernel(__grid_constant__ const Signal<N> signal, std::size_t slot_stride, const T* input, T* output,
                        std::size_t count, wire::Wire format, TaggedCall call) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const std::size_t slot = kSlotOffset + (signal.next_launch() & 1) * slot_stride;
  const BlockShare share = wire_share(count);
  encode_range(input, share.begin, share.end, count, signal.mine() + slot, format, threadIdx.x, blockDim.x);
  if (!signal.barrier(&failed, call, true)) return;

  const auto reduced_of = [&](int r) {
    return reinterpret_cast<T*>(signal.peers.at(r) + slot + wire::reduced_offset(count));
  };
  const std::size_t segment = ((share.end - share.begin + N - 1) / N + wire::kWireBlock - 1) / wire::kWireBlock * wire::kWireBlock;
  const auto segment_of = [&](int r) {
    const std::size_t lo = min(share.end, share.begin + std::size_t(r) * segment);
    return BlockShare{lo, min(share.end, lo + segment)};
  };
  const BlockShare own = segment_of(signal.rank);
  T* kept = reduced_of(signal.rank);
  reduce_encoded<T, N>([&](int r) { return encoded_at(signal.peers.at(r) + slot, count); }, own.begin, own.end, format,
                       threadIdx.x, blockDim.x, [&](std::size_t i, T value) {
                         kept[i] = value;
                         output[i] = value;
                       });
  if (!signal.barrier(&failed, call, true)) return;
  for (int r = 0; r < N; ++r) {
    if (r == signal.rank) continue;
    const BlockShare theirs = segment_of(r);
    block_copy<T, kVector>(reduced_of(r), output, theirs.begin, theirs.end);
  }
}

// all_reduce_rms_norm, reduce-scattered by rows: block b takes row groups b, b + grid, ... of N
// consecutive rows, row r of a group being rank r's. Stage the groups, barrier, each rank sums,
// adds and normalizes its rows and keeps out and residual_out in its slot (out over its staged
// rows, which no peer reads; residual_out past the staged payload), barrier, every rank gathers
// the other rows of both. The norm work is split across the ranks like the sum's.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    norm_twoshot_kernel(__grid_constant__ const Signal<N> signal, std::size_t slot_stride, NormArgs<T> args,
                        TaggedCall call) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const std::size_t slot = kSlotOffset + (signal.next_launch() & 1) * slot_stride;
  const std::size_t hidden = args.hidden, rows = args.rows;
  const auto staged_of = [&](int r) { return reinterpret_cast<T*>(signal.peers.at(r) + slot); };
  const auto kept_of = [&](int r) { return staged_of(r) + rows * hidden; };
  for (std::size_t group = blockIdx.x; group * N < rows; group += gridDim.x)
    block_copy<T, true>(args.input, staged_of(signal.rank), group * N * hidden, min(rows, (group + 1) * N) * hidden);
  if (!signal.barrier(&failed, call, true)) return;
  for (std::size_t group = blockIdx.x; group * N < rows; group += gridDim.x) {
    const std::size_t row = group * N + signal.rank;
    if (row >= rows) continue;  // the same for the whole block
    const std::size_t base = row * hidden;
    const auto summed = [&](std::size_t i) { return summed_chunk<T, N>([&](int r) { return staged_of(r) + base; }, i); };
    const auto keep = [&](std::size_t i, const Chunk<T>& normed, const Chunk<T>& kept) {
      store_chunk<T, true>(staged_of(signal.rank) + base, i, hidden, normed);
      store_chunk<T, true>(kept_of(signal.rank) + base, i, hidden, kept);
    };
    add_rms_norm_row<T, true>(summed, args.residual + base, args.weight, args.out + base, args.residual_out + base,
                              hidden, args.eps, keep);
  }
  if (!signal.barrier(&failed, call, true)) return;
  for (std::size_t group = blockIdx.x; group * N < rows; group += gridDim.x) {
    for (int r = 0; r < N; ++r) {
      const std::size_t row = group * N + r;
      if (r == signal.rank || row >= rows) continue;
      block_copy<T, true>(staged_of(r), args.out, row * hidden, (row + 1) * hidden);
      block_copy<T, true>(kept_of(r), args.residual_out, row * hidden, (row + 1) * hidden);
    }
  }
}

}  // namespace

// Whether a call of these rows runs as one twoshot kernel: its owners keep both results in the slot.
bool twoshot_fuses(const GroupView& group, const norm::Rows& rows, DType dtype) {
  return 2 * rows.count() * dtype_bytes(dtype) <= group.capacity_bytes;
}

void twoshot_all_reduce_rms_norm(const GroupView& group, const norm::Rows& rows, DType dtype, TaggedCall call,
                                 std::uint64_t timeout_ns, cudaStream_t stream) {
  // A block per group of world_size rows up to the grid's limit: the grid follows from the shape alone.
  const std::size_t groups = (rows.rows + group.world_size - 1) / group.world_size;
  const int blocks = int(std::clamp<std::size_t>(groups, 1, std::size_t(group.max_blocks)));
  for_instance<DeviceElements>(group.world_size, dtype, [&](auto world, auto element) {
    constexpr int N = decltype(world)::value;
    using T = typename decltype(element)::type;
    norm_twoshot_kernel<T, N><<<blocks, kThreads, 0, stream>>>(signal_of<N>(group, timeout_ns),
                                                              slot_stride(group.capacity_bytes), typed<T>(rows), call);
    NODECOMM_CUDA(cudaGetLastError());
  });
}

void twoshot_all_reduce(const GroupView& group, std::uintptr_t input, std::uintptr_t output, std::size_t count,
                        DType dtype, wire::Wire format, TaggedCall call, std::uint64_t timeout_ns,
                        cudaStream_t stream) {
  // Grids follow from the count alone, so every rank that agrees on the call launches the same one.
  const std::size_t wanted = (count + kThreads * 4 - 1) / (kThreads * 4);
  const int blocks = int(std::clamp<std::size_t>(wanted, 1, std::size_t(group.max_blocks)));
  for_instance<DeviceElements>(group.world_size, dtype, [&](auto world, auto element) {
    constexpr int N = decltype(world)::value;
    using T = typename decltype(element)::type;
    const auto* in = reinterpret_cast<const T*>(input);
    auto* out = reinterpret_cast<T*>(output);
    const Signal<N> signal = signal_of<N>(group, timeout_ns);
    if (format != wire::Wire::kLossless) {
      // The gather reads packs from the peers' slots, which are aligned, so only the output matters.
      const auto kernel = aligned(out) ? wire_twoshot_kernel<T, N, true> : wire_twoshot_kernel<T, N, false>;
      kernel<<<blocks, kThreads, 0, stream>>>(signal, slot_stride(group.capacity_bytes), in, out, count, format, call);
    } else {
      const auto kernel = aligned(in) && aligned(out) ? twoshot_kernel<T, N, true> : twoshot_kernel<T, N, false>;
      kernel<<<blocks, kThreads, 0, stream>>>(signal, slot_stride(group.capacity_bytes), in, out, count, call);
    }
    NODECOMM_CUDA(cudaGetLastError());
  });
}

int twoshot_blocks_per_sm() {
  int per_sm = 1 << 30;
  for_every_instance<DeviceElements>([&](auto world, auto element) {
    constexpr int N = decltype(world)::value;
    using T = typename decltype(element)::type;
    per_sm = std::min(
        {per_sm, blocks_per_sm(twoshot_kernel<T, N, true>, kThreads), blocks_per_sm(twoshot_kernel<T, N, false>, kThreads),
         blocks_per_sm(wire_twoshot_kernel<T, N, true>, kThreads), blocks_per_sm(wire_twoshot_kernel<T, N, false>, kThreads),
         blocks_per_sm(norm_twoshot_kernel<T, N>, kThreads)});
  });
  return per_sm;
}

}  // namespace nodecomm::cuda
