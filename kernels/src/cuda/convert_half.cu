// Stage: operand conversion of the FP16 mode (SPEC section 4) — the fp32 inputs of the projection
// GEMMs (hidden states, grad_output, q/k/v/o weights) rounded to fp16, with an optional
// power-of-two scale, all tensors in one launch; and grad_output's scale, found on the device
// (GradientScale in stages.h).
#include <cstdint>

#include "cuda/stages.h"

namespace attngrad::cuda {
namespace {

struct ConvertBatch {
  ConvertSegment segments[kMaxConvertSegments];
};

// blockIdx.y picks the segment; a grid-stride loop over 8-element chunks (two 16-byte loads, one
// 16-byte store) when the segment is 16-byte aligned, element by element otherwise.
__global__ void __launch_bounds__(256) ConvertToHalfKernel(const __grid_constant__ ConvertBatch batch) {
  const ConvertSegment segment = batch.segments[blockIdx.y];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vector = (reinterpret_cast<std::uintptr_t>(segment.source) % 16 == 0) &&
                      (reinterpret_cast<std::uintptr_t>(segment.destination) % 16 == 0);
  const float s = segment.device_scale != nullptr ? *segment.device_scale : segment.scale;
  std::size_t done = 0;
  if (vector) {
    const std::size_t chunks = segment.count / 8;
    const float4* source = reinterpret_cast<const float4*>(segment.source);
    uint4* destination = reinterpret_cast<uint4*>(segment.destination);
    for (std::size_t chunk = first; chunk < chunks; chunk += stride) {
      const float4 low = source[2 * chunk];
      const float4 high = source[2 * chunk + 1];
      __half2 packed[4] = {__floats2half2_rn(low.x * s, low.y * s),
                           __floats2half2_rn(low.z * s, low.w * s),
                           __floats2half2_rn(high.x * s, high.y * s),
                           __floats2half2_rn(high.z * s, high.w * s)};
      destination[chunk] = *reinterpret_cast<const uint4*>(packed);
    }
    done = chunks * 8;
  }
  for (std::size_t index = done + first; index < segment.count; index += stride) {
    segment.destination[index] = __float2half_rn(segment.source[index] * s);
  }
}

constexpr int kScaleThreads = 256;
constexpr int kScaleTargetExponent = 2;  // max|dY| * s lands in [2^2, 2^3)

// s = 2^k with max * s in [4, 8), k clamped so that s and 1/s are normal floats; 1 when the
// maximum is 0, NaN or Inf.
__device__ float ScaleForMaximum(unsigned int bits) {
  if (bits == 0u || bits >= 0x7f800000u) return 1.f;
  const int exponent = static_cast<int>(bits >> 23) - 127;  // floor(log2 max); -127 if subnormal
  int power = kScaleTargetExponent - exponent;
  power = power < -126 ? -126 : (power > 126 ? 126 : power);
  return ldexpf(1.f, power);
}

// |x| as ordered bits: for non-negative floats the bits order like the values, and a NaN's exceed
// Inf's, so a NaN wins the maximum (fmaxf would drop it).
__device__ __forceinline__ unsigned int AbsBits(float x) { return __float_as_uint(fabsf(x)); }
__device__ __forceinline__ unsigned int AbsBits(float4 v) {
  return max(max(AbsBits(v.x), AbsBits(v.y)), max(AbsBits(v.z), AbsBits(v.w)));
}

// max |x| over the tensor (each block's maximum, then atomicMax on the bits: max is exact and
// order-free, so the result does not depend on timing); the last block to finish turns it into the
// scale and the GEMMs' alpha/beta.
__global__ void __launch_bounds__(kScaleThreads)
    GradientScaleKernel(const float* __restrict__ values, std::size_t count, float weight_beta,
                        GradientScale* scale) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned int bits = 0;
  std::size_t done = 0;
  if (reinterpret_cast<std::uintptr_t>(values) % 16 == 0) {
    const std::size_t chunks = count / 4;
    const float4* source = reinterpret_cast<const float4*>(values);
    std::size_t chunk = first;
    for (; chunk + 3 * stride < chunks; chunk += 4 * stride) {  // four loads in flight
      const float4 v0 = source[chunk], v1 = source[chunk + stride];
      const float4 v2 = source[chunk + 2 * stride], v3 = source[chunk + 3 * stride];
      bits = max(bits, max(max(AbsBits(v0), AbsBits(v1)), max(AbsBits(v2), AbsBits(v3))));
    }
    for (; chunk < chunks; chunk += stride) bits = max(bits, AbsBits(source[chunk]));
    done = chunks * 4;
  }
  for (std::size_t index = done + first; index < count; index += stride) {
    bits = max(bits, AbsBits(values[index]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  }
  __shared__ unsigned int warp_maxima[kScaleThreads / 32];
  __shared__ bool last_block;
  if ((threadIdx.x & 31) == 0) warp_maxima[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int warp = 1; warp < kScaleThreads / 32; ++warp) bits = max(bits, warp_maxima[warp]);
    atomicMax(&scale->abs_max_bits, bits);
    __threadfence();
    last_block = atomicAdd(&scale->blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last_block && threadIdx.x == 0) {
    __threadfence();
    const float s = ScaleForMaximum(atomicMax(&scale->abs_max_bits, 0u));
    scale->scale = s;
    scale->inverse = 1.f / s;  // exact: s is a power of two within the normal range
    scale->weight_beta = weight_beta;
    scale->zero = 0.f;
  }
}

}  // namespace

attngrad_status FindGradientScale(const float* grad_output, std::size_t count, bool accumulate,
                                  GradientScale* scale, cudaStream_t stream) {
  if (grad_output == nullptr || scale == nullptr) return ATTNGRAD_INTERNAL;
  // Both counters start at zero (the workspace holds whatever the last call left).
  if (cudaMemsetAsync(scale, 0, 2 * sizeof(unsigned int), stream) != cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  int device = 0, multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  // At most a full SM's worth of threads per SM (8 blocks), 4 x 16 bytes in flight per thread.
  const std::size_t wanted = (count / 4 + kScaleThreads - 1) / kScaleThreads;
  const std::size_t cap = static_cast<std::size_t>(8 * multiprocessors);
  const unsigned blocks = static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
  GradientScaleKernel<<<blocks, kScaleThreads, 0, stream>>>(grad_output, count,
                                                            accumulate ? 1.f : 0.f, scale);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

attngrad_status ConvertToHalf(const ConvertSegment* segments, int num_segments,
                              cudaStream_t stream) {
  if (num_segments < 1 || num_segments > kMaxConvertSegments) return ATTNGRAD_INTERNAL;
  ConvertBatch batch{};
  std::size_t largest = 0;
  for (int i = 0; i < num_segments; ++i) {
    batch.segments[i] = segments[i];
    if (segments[i].count > largest) largest = segments[i].count;
  }
  if (largest == 0) return ATTNGRAD_OK;
  const std::size_t chunks = (largest + 7) / 8;
  const unsigned blocks_x =
      static_cast<unsigned>(chunks / 256 + 1 < 2048 ? chunks / 256 + 1 : 2048);
  ConvertToHalfKernel<<<dim3(blocks_x, num_segments), 256, 0, stream>>>(batch);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace attngrad::cuda
