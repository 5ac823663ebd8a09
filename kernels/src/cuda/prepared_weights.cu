// Stage: the weight part of the FP16 mode's operand conversion (SPEC section 2's "convert", see
// backward_device.cu), done once ahead of many calls: attngrad::PreparedWeights
// (prepared_weights.h) rounds q/k/v/o_proj to fp16 with the very launch the pipeline uses
// (ConvertToHalf, scale 1), into memory it owns, so a call that reads these copies computes on the
// same fp16 values as one that converts them itself.
#include <cuda_runtime.h>

#include <cstdint>

#include "attngrad/prepared_weights.h"
#include "cuda/stages.h"

namespace attngrad {
namespace {

bool Aligned16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

bool SameConfig(const LayerConfig& a, const LayerConfig& b) {
  return a.hidden_size == b.hidden_size && a.num_heads == b.num_heads &&
         a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim;
}

}  // namespace

void PreparedWeights::DeviceMemoryRelease::operator()(void* pointer) const noexcept {
  cudaFree(pointer);
}

Status PreparedWeights::Prepare(const LayerConfig& config, const PerWeight<const float*>& weights,
                                void* stream) {
  if (!config.IsValid()) {
    return {ATTNGRAD_INVALID_ARGUMENT,
            "LayerConfig is invalid (sizes must be positive, num_heads a multiple of num_kv_heads, "
            "head_dim even)"};
  }
  if (config.head_dim != 128 && config.head_dim != 256) {
    return {ATTNGRAD_UNSUPPORTED, "the GPU kernels support head_dim 128 and 256 only"};
  }
  for (const float* weight : weights) {
    if (weight == nullptr) return {ATTNGRAD_INVALID_ARGUMENT, "a weight to prepare is null"};
  }
  if (!Aligned16(weights[Weight::kQNorm]) || !Aligned16(weights[Weight::kKNorm])) {
    return {ATTNGRAD_INVALID_ARGUMENT, "weights[q_norm] or weights[k_norm] is not 16-byte aligned"};
  }
  if (half_ == nullptr || !SameConfig(config, config_)) {
    half_.reset();
    source_ = {};
    void* allocated = nullptr;
    if (cudaMalloc(&allocated, CopiesBytes(config)) != cudaSuccess) {
      cudaGetLastError();
      return {ATTNGRAD_CUDA_ERROR, "cudaMalloc of the prepared fp16 weights failed"};
    }
    half_.reset(allocated);
  }
  config_ = config;
  source_ = weights;
  // The same segments, scale and launch as the pipeline's own conversion (ConvertOperands).
  auto* half = static_cast<__half*>(half_.get());
  const std::size_t hidden = static_cast<std::size_t>(config.hidden_size);
  const std::size_t q_rows = static_cast<std::size_t>(config.q_out());
  const std::size_t kv_rows = static_cast<std::size_t>(config.kv_out());
  const cuda::ConvertSegment segments[4] = {
      {weights[Weight::kQProj], half, q_rows * hidden, 1.f},
      {weights[Weight::kKProj], half + q_rows * hidden, kv_rows * hidden, 1.f},
      {weights[Weight::kVProj], half + (q_rows + kv_rows) * hidden, kv_rows * hidden, 1.f},
      {weights[Weight::kOProj], static_cast<__half*>(const_cast<void*>(half_o())), hidden * q_rows,
       1.f},
  };
  if (cuda::ConvertToHalf(segments, 4, static_cast<cudaStream_t>(stream)) != ATTNGRAD_OK) {
    half_.reset();
    source_ = {};
    return {ATTNGRAD_CUDA_ERROR, "the conversion of the weights to fp16 failed to launch"};
  }
  return {};
}

}  // namespace attngrad
