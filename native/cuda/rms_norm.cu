// rms_norm.cu — the residual add and RMSNorm on their own, for an all_reduce_rms_norm whose
// all-reduce ran apart (a path or size with no fused kernel): a block per row, the order of
// rms_norm.cuh, so the bits are the fused kernels'.
#include <cuda_runtime.h>

#include <algorithm>

#include "../errors.h"
#include "collectives.h"
#include "driver.h"
#include "rms_norm.cuh"

namespace nodecomm::cuda {
namespace {

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) add_rms_norm_kernel(NormArgs<T> args) {
  const std::size_t hidden = args.hidden;
  for (std::size_t row = blockIdx.x; row < args.rows; row += gridDim.x) {
    const std::size_t base = row * hidden;
    const auto summed = [&](std::size_t i) { return load_chunk<T, kVector>(args.input + base, i, hidden); };
    add_rms_norm_row<T, kVector>(summed, args.residual + base, args.weight, args.out + base,
                                 args.residual_out + base, hidden, args.eps, KeepNothing{});
  }
}

}  // namespace

void add_rms_norm(const norm::Rows& rows, DType dtype, cudaStream_t stream) {
  rows.check();
  if (rows.rows == 0) return;
  // Rows past this grid are looped over; enough blocks to fill any GPU several times.
  const int blocks = int(std::min<std::size_t>(rows.rows, 8192));
  for_dtype<DeviceElements>(dtype, [&](auto element) {
    using T = typename decltype(element)::type;
    const auto kernel = chunks_pack(rows) ? add_rms_norm_kernel<T, true> : add_rms_norm_kernel<T, false>;
    kernel<<<blocks, kThreads, 0, stream>>>(typed<T>(rows));
    NODECOMM_CUDA(cudaGetLastError());
  });
}

}  // namespace nodecomm::cuda
