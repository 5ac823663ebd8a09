// Stage: SPEC section 2 steps 2-3 (forward recomputation) — Gemma RMSNorm of each q and k head
// (r = 1/sqrt(mean(x^2) + eps), x̂ = x r, xn = x̂ (1 + norm_weight)) followed by rotate-half RoPE
// (x' = xn cos + rot(xn) sin), fused in one pass that also keeps r per token and head for the
// backward and converts v to the attention's operand type.
//
// One warp per (token, head): lane l holds elements 4l..4l+3 of the 128, so rot() pairs lane l with
// lane l ^ 16 (elements d and d ± 64). Each block of 8 warps walks tokens in a grid-stride loop;
// a warp loads all its heads of a token before it computes any (more bytes in flight).
#include "cuda/stages.h"
#include "cuda/warp_vector_ops.cuh"

namespace attngrad::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kTasksPerWarp = 5;  // 40 heads per token = 8 warps x 5

template <typename Operand>
__global__ void __launch_bounds__(kWarps * 32)
    RmsNormRopeForwardKernel(HeadLayout layout, const float* __restrict__ qkv,
                             const float* __restrict__ cos, const float* __restrict__ sin,
                             const float* __restrict__ q_norm_weight,
                             const float* __restrict__ k_norm_weight, float eps, bool write_v,
                             Operand* __restrict__ operands, float* __restrict__ inv_rms) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int width = layout.qkv_width();
  const int norm_heads = layout.norm_heads();
  const int tasks = write_v ? norm_heads + layout.num_kv_heads : norm_heads;
  const float4 q_weight = reinterpret_cast<const float4*>(q_norm_weight)[lane];
  const float4 k_weight = reinterpret_cast<const float4*>(k_norm_weight)[lane];
  const bool low_half = lane < 16;  // elements 0..63

  for (int token = blockIdx.x; token < layout.tokens; token += gridDim.x) {
    const float* row = qkv + static_cast<std::size_t>(token) * width;
    Operand* out_row = operands + static_cast<std::size_t>(token) * width;
    const float4 c =
        reinterpret_cast<const float4*>(cos + static_cast<std::size_t>(token) * kHeadDim)[lane];
    const float4 s =
        reinterpret_cast<const float4*>(sin + static_cast<std::size_t>(token) * kHeadDim)[lane];
    // kTasksPerWarp heads per pass, all loads issued before the first use (memory parallelism).
    for (int base = warp; base < tasks; base += kWarps * kTasksPerWarp) {
      float4 x[kTasksPerWarp];
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head < tasks) x[i] = *reinterpret_cast<const float4*>(row + head * kHeadDim + 4 * lane);
      }
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head >= tasks) continue;
        const int column = head * kHeadDim + 4 * lane;
        if (head >= norm_heads) {  // v: conversion only
          Store4(out_row + column, x[i]);
          continue;
        }
        const float mean_square =
            WarpSum(x[i].x * x[i].x + x[i].y * x[i].y + x[i].z * x[i].z + x[i].w * x[i].w) /
            kHeadDim;
        const float r = 1.0f / sqrtf(mean_square + eps);
        const float4 w = head < layout.num_heads ? q_weight : k_weight;
        const float4 n = make_float4(x[i].x * r * (1.f + w.x), x[i].y * r * (1.f + w.y),
                                     x[i].z * r * (1.f + w.z), x[i].w * r * (1.f + w.w));
        float4 partner;
        partner.x = __shfl_xor_sync(0xffffffffu, n.x, 16);
        partner.y = __shfl_xor_sync(0xffffffffu, n.y, 16);
        partner.z = __shfl_xor_sync(0xffffffffu, n.z, 16);
        partner.w = __shfl_xor_sync(0xffffffffu, n.w, 16);
        // rot(n)[d] = -n[d+64] for d < 64, n[d-64] for d >= 64.
        const float sign = low_half ? -1.f : 1.f;
        const float4 out =
            make_float4(n.x * c.x + sign * partner.x * s.x, n.y * c.y + sign * partner.y * s.y,
                        n.z * c.z + sign * partner.z * s.z, n.w * c.w + sign * partner.w * s.w);
        Store4(out_row + column, out);
        if (lane == 0) inv_rms[static_cast<std::size_t>(token) * norm_heads + head] = r;
      }
    }
  }
}

}  // namespace

attngrad_status RmsNormRopeForward(const HeadLayout& layout, const float* qkv, const float* cos,
                                   const float* sin, const float* q_norm_weight,
                                   const float* k_norm_weight, float eps, OperandType type,
                                   bool write_v, void* operands, float* inv_rms,
                                   cudaStream_t stream) {
  if (layout.tokens < 1) return ATTNGRAD_INTERNAL;
  // One wave: as many blocks as the GPU holds at once (at most one per token).
  int device = 0, multiprocessors = 0, per_multiprocessor = 0;
  const cudaError_t queried =
      cudaGetDevice(&device) == cudaSuccess
          ? cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device)
          : cudaErrorInvalidDevice;
  const cudaError_t occupancy =
      type == OperandType::kHalf
          ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &per_multiprocessor, RmsNormRopeForwardKernel<__half>, kWarps * 32, 0)
          : cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &per_multiprocessor, RmsNormRopeForwardKernel<float>, kWarps * 32, 0);
  if (queried != cudaSuccess || occupancy != cudaSuccess) return ATTNGRAD_CUDA_ERROR;
  int blocks = multiprocessors * (per_multiprocessor > 0 ? per_multiprocessor : 1);
  if (blocks > layout.tokens) blocks = layout.tokens;
  if (type == OperandType::kHalf) {
    RmsNormRopeForwardKernel<__half>
        <<<blocks, kWarps * 32, 0, stream>>>(layout, qkv, cos, sin, q_norm_weight, k_norm_weight,
                                             eps, write_v, static_cast<__half*>(operands), inv_rms);
  } else {
    RmsNormRopeForwardKernel<float>
        <<<blocks, kWarps * 32, 0, stream>>>(layout, qkv, cos, sin, q_norm_weight, k_norm_weight,
                                             eps, write_v, static_cast<float*>(operands), inv_rms);
  }
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace attngrad::cuda
