// Serves the end of SPEC section 2's backward (after step 9, the gradient GEMMs), before a server
// adds a batch's weight gradients to its accumulators: the finite check, so that one batch whose
// gradients overflowed never turns a sum into Inf/NaN. One launch counts the NaN/Inf values of
// grad_hidden_states and of the six weight gradients (a warp reduction, one atomic per warp that
// saw any), a second adds the gradients to the accumulators only when every count is 0. Both read
// the counts on the device: no host round trip between compute and accumulation. See
// attngrad/finite_check.h.
#include <cuda_runtime.h>

#include "attngrad/finite_check.h"

namespace attngrad {
namespace {

constexpr int kThreads = 256;
constexpr unsigned int kMaxBlocksPerTensor = 1024;

// Up to kCheckedGradients tensors, passed by value to one launch (blockIdx.y picks one).
struct Segments {
  const float* source[kCheckedGradients];
  float* destination[kCheckedGradients];  // AccumulateIfFinite and CountOverflowingSums only
  unsigned long long elements[kCheckedGradients];
};

__device__ __forceinline__ bool NotFinite(float value) {
  // Exponent all ones: Inf or NaN. A bit test, so no compiler flag can fold it away.
  return (__float_as_uint(value) & 0x7f800000u) == 0x7f800000u;
}

__device__ __forceinline__ unsigned int NotFiniteCount(float4 v) {
  return (NotFinite(v.x) ? 1u : 0u) + (NotFinite(v.y) ? 1u : 0u) + (NotFinite(v.z) ? 1u : 0u) +
         (NotFinite(v.w) ? 1u : 0u);
}

__device__ __forceinline__ bool Aligned16(const void* pointer) {
  return (reinterpret_cast<unsigned long long>(pointer) & 15ull) == 0;
}

// Both kernels stream through memory: 16-byte loads (when the tensors are 16-byte aligned, as
// cudaMalloc'd buffers and the packed layouts are), kUnroll of them in flight per thread, a grid-
// stride loop of this block's share; the < 4 elements past the last whole vector one at a time.
constexpr int kUnroll = 4;

__global__ void CountNonFiniteKernel(Segments segments, unsigned long long* counts) {
  const int tensor = static_cast<int>(blockIdx.y);
  const float* source = segments.source[tensor];
  const unsigned long long elements = segments.elements[tensor];
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long first =
      static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned int count = 0;
  unsigned long long done = 0;
  if (Aligned16(source)) {
    const float4* vectors = reinterpret_cast<const float4*>(source);
    const unsigned long long vector_count = elements / 4;
    unsigned long long i = first;
    for (; i + (kUnroll - 1) * stride < vector_count; i += kUnroll * stride) {
      float4 values[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) values[u] = vectors[i + u * stride];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) count += NotFiniteCount(values[u]);
    }
    for (; i < vector_count; i += stride) count += NotFiniteCount(vectors[i]);
    done = vector_count * 4;
  }
  for (unsigned long long i = done + first; i < elements; i += stride) {
    count += NotFinite(source[i]) ? 1u : 0u;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    count += __shfl_down_sync(0xffffffffu, count, offset);
  }
  if ((threadIdx.x & 31u) == 0 && count != 0) atomicAdd(&counts[tensor], count);
}

// counts[kCheckedGradients + tensor] += the elements where destination + source is not finite.
__global__ void CountOverflowingSumsKernel(Segments segments, unsigned long long* counts) {
  const int tensor = static_cast<int>(blockIdx.y);
  const float* source = segments.source[tensor];
  const float* sums = segments.destination[tensor];
  const unsigned long long elements = segments.elements[tensor];
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  unsigned int count = 0;
  for (unsigned long long i =
           static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < elements; i += stride) {
    count += NotFinite(sums[i] + source[i]) ? 1u : 0u;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    count += __shfl_down_sync(0xffffffffu, count, offset);
  }
  if ((threadIdx.x & 31u) == 0 && count != 0) {
    atomicAdd(&counts[kCheckedGradients + tensor], count);
  }
}

__global__ void AccumulateIfFiniteKernel(Segments segments, const unsigned long long* counts) {
  unsigned long long total = 0;
  for (int i = 0; i < kCheckedCounts; ++i) total += counts[i];
  if (total != 0) return;
  const int tensor = static_cast<int>(blockIdx.y);
  const float* source = segments.source[tensor];
  float* destination = segments.destination[tensor];
  const unsigned long long elements = segments.elements[tensor];
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long first =
      static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned long long done = 0;
  if (Aligned16(source) && Aligned16(destination)) {
    const float4* sources = reinterpret_cast<const float4*>(source);
    float4* destinations = reinterpret_cast<float4*>(destination);
    const unsigned long long vector_count = elements / 4;
    auto add = [](float4 sum, float4 term) {
      return make_float4(sum.x + term.x, sum.y + term.y, sum.z + term.z, sum.w + term.w);
    };
    unsigned long long i = first;
    for (; i + (kUnroll - 1) * stride < vector_count; i += kUnroll * stride) {
      float4 terms[kUnroll], sums[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        terms[u] = sources[i + u * stride];
        sums[u] = destinations[i + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) destinations[i + u * stride] = add(sums[u], terms[u]);
    }
    for (; i < vector_count; i += stride) destinations[i] = add(destinations[i], sources[i]);
    done = vector_count * 4;
  }
  for (unsigned long long i = done + first; i < elements; i += stride) {
    destination[i] += source[i];
  }
}

unsigned int BlocksFor(const Segments& segments, int tensors) {
  unsigned long long largest = 0;
  for (int i = 0; i < tensors; ++i)
    largest = largest > segments.elements[i] ? largest : segments.elements[i];
  const unsigned long long blocks = (largest + kThreads - 1) / kThreads;
  if (blocks == 0) return 1;
  return blocks < kMaxBlocksPerTensor ? static_cast<unsigned int>(blocks) : kMaxBlocksPerTensor;
}

// The six (gradient, accumulator) pairs of a layer as segments (the kernels that read an
// accumulator only never write through destination); INVALID_ARGUMENT for a null pointer.
Status PairSegments(const LayerConfig& config, const PerWeight<const float*>& gradients,
                    const PerWeight<const float*>& accumulators, Segments* segments) {
  for (Weight weight : kAllWeights) {
    if (gradients[weight] == nullptr || accumulators[weight] == nullptr) {
      return {ATTNGRAD_INVALID_ARGUMENT, "finite check: a gradient or accumulator is null"};
    }
    segments->source[IndexOf(weight)] = gradients[weight];
    segments->destination[IndexOf(weight)] = const_cast<float*>(accumulators[weight]);
    segments->elements[IndexOf(weight)] = WeightElements(config, weight);
  }
  return {};
}

Status LaunchStatus() {
  if (cudaGetLastError() != cudaSuccess)
    return {ATTNGRAD_CUDA_ERROR, "finite check: launch failed"};
  return {};
}

}  // namespace

Status CountNonFiniteDevice(const LayerConfig& config, const float* grad_hidden_states,
                            std::size_t activations,
                            const PerWeight<const float*>& weight_gradients,
                            unsigned long long* counts, void* stream) {
  if (counts == nullptr) return {ATTNGRAD_INVALID_ARGUMENT, "finite check: counts is null"};
  if (grad_hidden_states == nullptr && activations != 0) {
    return {ATTNGRAD_INVALID_ARGUMENT, "finite check: grad_hidden_states is null"};
  }
  Segments segments{};
  segments.source[0] = grad_hidden_states;
  segments.elements[0] = activations;
  for (Weight weight : kAllWeights) {
    if (weight_gradients[weight] == nullptr) {
      return {ATTNGRAD_INVALID_ARGUMENT, "finite check: a weight gradient is null"};
    }
    segments.source[CountIndexOf(weight)] = weight_gradients[weight];
    segments.elements[CountIndexOf(weight)] = WeightElements(config, weight);
  }
  const dim3 grid(BlocksFor(segments, kCheckedGradients), kCheckedGradients);
  CountNonFiniteKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(segments, counts);
  return LaunchStatus();
}

Status CountOverflowingSumsDevice(const LayerConfig& config,
                                  const PerWeight<const float*>& gradients,
                                  const PerWeight<const float*>& accumulators,
                                  unsigned long long* counts, void* stream) {
  if (counts == nullptr) return {ATTNGRAD_INVALID_ARGUMENT, "finite check: counts is null"};
  Segments segments{};
  const Status paired = PairSegments(config, gradients, accumulators, &segments);
  if (!paired.ok()) return paired;
  const dim3 grid(BlocksFor(segments, kNumWeights), kNumWeights);
  CountOverflowingSumsKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(segments,
                                                                                       counts);
  return LaunchStatus();
}

Status AccumulateIfFiniteDevice(const LayerConfig& config, const PerWeight<const float*>& gradients,
                                const PerWeight<float*>& accumulators,
                                const unsigned long long* counts, void* stream) {
  if (counts == nullptr) return {ATTNGRAD_INVALID_ARGUMENT, "finite check: counts is null"};
  PerWeight<const float*> sums;
  for (Weight weight : kAllWeights) sums[weight] = accumulators[weight];
  Segments segments{};
  const Status paired = PairSegments(config, gradients, sums, &segments);
  if (!paired.ok()) return paired;
  const dim3 grid(BlocksFor(segments, kNumWeights), kNumWeights);
  AccumulateIfFiniteKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(segments,
                                                                                     counts);
  return LaunchStatus();
}

}  // namespace attngrad
