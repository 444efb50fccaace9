// numerics.cuh — the element types' conversions every CUDA reduction uses: widen to fp32, add in
// rank order, narrow once with round-to-nearest-even (the numerics contract of ../numerics.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../numerics.h"

namespace nodecomm::cuda {

// The element types the kernels reduce, for for_dtype (../numerics.h).
struct DeviceElements {
  using Float32 = float;
  using Float16 = __half;
  using BFloat16 = __nv_bfloat16;
};

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace nodecomm::cuda
