// Small device helpers shared by the element-wise stages of SPEC section 2 steps 2-3
// (rmsnorm_rope_forward.cu) and 7-8 (rope_rmsnorm_backward.cu): a warp-wide sum and 16-byte (fp32)
// or 8-byte (fp16) stores of four values.
#ifndef ATTNGRAD_KERNELS_CUDA_WARP_VECTOR_OPS_CUH_
#define ATTNGRAD_KERNELS_CUDA_WARP_VECTOR_OPS_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace attngrad::cuda {

__device__ __forceinline__ float WarpSum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ void Store4(float* destination, float4 value) {
  *reinterpret_cast<float4*>(destination) = value;
}
__device__ __forceinline__ void Store4(__half* destination, float4 value) {
  __half2 packed[2] = {__floats2half2_rn(value.x, value.y), __floats2half2_rn(value.z, value.w)};
  *reinterpret_cast<uint2*>(destination) = *reinterpret_cast<const uint2*>(packed);
}

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_WARP_VECTOR_OPS_CUH_
