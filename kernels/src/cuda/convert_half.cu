// Stage: operand conversion of the FP16 mode (SPEC section 4) — the fp32 inputs of the projection
// GEMMs (hidden states, grad_output, q/k/v/o weights) rounded to fp16, with an optional
// power-of-two scale, all tensors in one launch; grad_output's scale found on the device on the way
// (GradientScale in stages.h).
#include <cstdint>

#include "cuda/stages.h"

namespace attngrad::cuda {
namespace {

constexpr int kConvertThreads = 256;
constexpr int kScaleTargetExponent = 2;  // max|dY| * s lands in [2^2, 2^3)

struct ConvertBatch {
  ConvertSegment segments[kMaxConvertSegments];
};

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

// The maximum of every thread's `bits` over the block, returned to every thread.
__device__ unsigned int BlockMaximum(unsigned int bits) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  }
  __shared__ unsigned int warp_maxima[kConvertThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_maxima[threadIdx.x / 32] = bits;
  __syncthreads();
  for (int warp = 0; warp < kConvertThreads / 32; ++warp) bits = max(bits, warp_maxima[warp]);
  return bits;
}

// Each block of the tracked segment writes its maximum into its own slot (no atomics, no
// zeroing: the slots of this launch are all rewritten); RescaleToHalfKernel reduces them in order.
__device__ void RecordBlockMaximum(unsigned int bits, GradientScale* scale) {
  bits = BlockMaximum(bits);
  if (threadIdx.x != 0) return;
  scale->block_maxima[blockIdx.x] = bits;
  if (blockIdx.x == 0) scale->blocks = gridDim.x;
}

// Converts values [first, count) in steps of `stride` with the factor s (8-element chunks: two
// 16-byte loads, one 16-byte store, when both pointers are 16-byte aligned); returns max |x| as
// bits when kTrack.
template <bool kTrack>
__device__ unsigned int ConvertRange(const float* source, __half* destination, std::size_t count,
                                     float s, std::size_t first, std::size_t stride) {
  unsigned int bits = 0;
  std::size_t done = 0;
  if ((reinterpret_cast<std::uintptr_t>(source) % 16 == 0) &&
      (reinterpret_cast<std::uintptr_t>(destination) % 16 == 0)) {
    const std::size_t chunks = count / 8;
    const float4* source4 = reinterpret_cast<const float4*>(source);
    uint4* destination4 = reinterpret_cast<uint4*>(destination);
    for (std::size_t chunk = first; chunk < chunks; chunk += stride) {
      const float4 low = source4[2 * chunk];
      const float4 high = source4[2 * chunk + 1];
      if constexpr (kTrack) bits = max(bits, max(AbsBits(low), AbsBits(high)));
      __half2 packed[4] = {
          __floats2half2_rn(low.x * s, low.y * s), __floats2half2_rn(low.z * s, low.w * s),
          __floats2half2_rn(high.x * s, high.y * s), __floats2half2_rn(high.z * s, high.w * s)};
      destination4[chunk] = *reinterpret_cast<const uint4*>(packed);
    }
    done = chunks * 8;
  }
  for (std::size_t index = done + first; index < count; index += stride) {
    if constexpr (kTrack) bits = max(bits, AbsBits(source[index]));
    destination[index] = __float2half_rn(source[index] * s);
  }
  return bits;
}

// blockIdx.y picks the segment; a grid-stride loop over it. A segment with find_scale is converted
// with scale 1 and every block of it records its maximum (RescaleToHalfKernel finishes the scale).
__global__ void __launch_bounds__(kConvertThreads)
    ConvertToHalfKernel(const __grid_constant__ ConvertBatch batch) {
  const ConvertSegment& segment = batch.segments[blockIdx.y];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (segment.find_scale == nullptr) {
    ConvertRange<false>(segment.source, segment.destination, segment.count, segment.scale, first,
                        stride);
    return;
  }
  const unsigned int bits =
      ConvertRange<true>(segment.source, segment.destination, segment.count, 1.f, first, stride);
  RecordBlockMaximum(bits, segment.find_scale);
}

// Every block reduces the conversion's block maxima (the same order everywhere) into the scale;
// block 0 publishes it with the GEMMs' alpha/beta; then the segment is converted again with it,
// unless it is 1 (the conversion already done).
__global__ void __launch_bounds__(kConvertThreads)
    RescaleToHalfKernel(const float* __restrict__ source, __half* __restrict__ destination,
                        std::size_t count, GradientScale* scale) {
  unsigned int bits = 0;
  const unsigned int blocks = scale->blocks;
  for (unsigned int i = threadIdx.x; i < blocks; i += kConvertThreads) {
    bits = max(bits, scale->block_maxima[i]);
  }
  const float s = ScaleForMaximum(BlockMaximum(bits));
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    scale->scale = s;
    scale->inverse = 1.f / s;  // exact: s is a power of two within the normal range
    scale->one = 1.f;
    scale->zero = 0.f;
  }
  if (s == 1.f) return;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  ConvertRange<false>(source, destination, count, s, first, stride);
}

// Blocks along x for `count` elements: one 8-element chunk per thread, at most
// kMaxConvertBlocks.
unsigned BlocksFor(std::size_t count) {
  const std::size_t chunks = (count + 7) / 8;
  const std::size_t blocks = chunks / kConvertThreads + 1;
  return static_cast<unsigned>(blocks < kMaxConvertBlocks ? blocks : kMaxConvertBlocks);
}

}  // namespace

attngrad_status ConvertToHalf(const ConvertSegment* segments, int num_segments,
                              cudaStream_t stream) {
  if (num_segments < 1 || num_segments > kMaxConvertSegments) return ATTNGRAD_INTERNAL;
  ConvertBatch batch{};
  std::size_t largest = 0;
  int tracked = 0;
  for (int i = 0; i < num_segments; ++i) {
    batch.segments[i] = segments[i];
    if (segments[i].count > largest) largest = segments[i].count;
    if (segments[i].find_scale != nullptr) ++tracked;
  }
  if (tracked > 1) return ATTNGRAD_INTERNAL;  // one set of block maxima per launch
  if (largest == 0 && tracked == 0) return ATTNGRAD_OK;
  ConvertToHalfKernel<<<dim3(BlocksFor(largest), num_segments), kConvertThreads, 0, stream>>>(
      batch);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

attngrad_status RescaleToHalf(const ConvertSegment& segment, cudaStream_t stream) {
  if (segment.find_scale == nullptr) return ATTNGRAD_INTERNAL;
  // Always launched (the GEMMs read the scalars it publishes). Up to 4 blocks per SM of the H200:
  // each first reads the <= 8 KB of block maxima.
  const unsigned blocks = BlocksFor(segment.count) < 528 ? BlocksFor(segment.count) : 528;
  RescaleToHalfKernel<<<blocks, kConvertThreads, 0, stream>>>(segment.source, segment.destination,
                                                              segment.count, segment.find_scale);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace attngrad::cuda
