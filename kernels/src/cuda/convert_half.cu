// Stage: operand conversion of the FP16 mode (SPEC section 4) — the fp32 inputs of the projection
// GEMMs (hidden states, grad_output, q/k/v/o weights) rounded to fp16, with an optional
// power-of-two scale, all tensors in one launch.
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
  std::size_t done = 0;
  if (vector) {
    const std::size_t chunks = segment.count / 8;
    const float4* source = reinterpret_cast<const float4*>(segment.source);
    uint4* destination = reinterpret_cast<uint4*>(segment.destination);
    for (std::size_t chunk = first; chunk < chunks; chunk += stride) {
      const float4 low = source[2 * chunk];
      const float4 high = source[2 * chunk + 1];
      const float s = segment.scale;
      __half2 packed[4] = {__floats2half2_rn(low.x * s, low.y * s),
                           __floats2half2_rn(low.z * s, low.w * s),
                           __floats2half2_rn(high.x * s, high.y * s),
                           __floats2half2_rn(high.z * s, high.w * s)};
      destination[chunk] = *reinterpret_cast<const uint4*>(packed);
    }
    done = chunks * 8;
  }
  for (std::size_t index = done + first; index < segment.count; index += stride) {
    segment.destination[index] = __float2half_rn(segment.source[index] * segment.scale);
  }
}

}  // namespace

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
