// Wire dtype conversion kernels of the GPU worker (not a SPEC section 2 stage: they convert the
// service's wire tensors before and after the backward pass). Grid-stride loops, one element per
// thread and step; memory-bound.
#include "devices/wire_convert.h"

#include <algorithm>

#include "attngrad/wire/dtype_bits.h"

namespace attngrad::server {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 4096;

__global__ void WidenKernel(const std::uint16_t* source, bool bfloat16, std::size_t count,
                            float* destination) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint16_t value = source[i];
    destination[i] = __uint_as_float(bfloat16 ? wire::bits::BFloat16ToFloatBits(value)
                                              : wire::bits::HalfToFloatBits(value));
  }
}

__global__ void NarrowKernel(const float* source, bool bfloat16, std::size_t count,
                             std::uint16_t* destination) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t value = __float_as_uint(source[i]);
    destination[i] =
        bfloat16 ? wire::bits::FloatBitsToBFloat16(value) : wire::bits::FloatBitsToHalf(value);
  }
}

unsigned int Blocks(std::size_t count) {
  return static_cast<unsigned int>(
      std::max<std::size_t>(1, std::min(kMaxBlocks, (count + kThreads - 1) / kThreads)));
}

}  // namespace

cudaError_t WidenToFloat(const std::uint16_t* source, HalfFormat format, std::size_t count,
                         float* destination, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  WidenKernel<<<Blocks(count), kThreads, 0, stream>>>(source, format == HalfFormat::kBFloat16,
                                                      count, destination);
  return cudaGetLastError();
}

cudaError_t NarrowFromFloat(const float* source, HalfFormat format, std::size_t count,
                            std::uint16_t* destination, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  NarrowKernel<<<Blocks(count), kThreads, 0, stream>>>(source, format == HalfFormat::kBFloat16,
                                                       count, destination);
  return cudaGetLastError();
}

}  // namespace attngrad::server
