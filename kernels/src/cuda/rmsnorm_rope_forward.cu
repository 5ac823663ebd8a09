// Stage: SPEC section 2 steps 2-3 (forward recomputation) — Gemma RMSNorm of each q and k head
// (r = 1/sqrt(mean(x^2) + eps), x̂ = x r, xn = x̂ (1 + norm_weight)) followed by rotate-half RoPE
// (x' = xn cos + rot(xn) sin), fused in one pass that also keeps r per token and head for the
// backward and converts v to the attention's operand type.
//
// One warp per (token, head). head_dim 128: lane l holds elements 4l..4l+3, so rot() pairs lane l
// with lane l ^ 16 (elements d and d ± 64). head_dim 256: lane l holds two chunks, elements
// 4l..4l+3 and 128 + 4l..128 + 4l+3, and rot() pairs its own two chunks (d and d ± 128). Each block
// of 8 warps walks tokens in a grid-stride loop; a warp loads all its heads of a token before it
// computes any (more bytes in flight).
#include "cuda/stages.h"
#include "cuda/warp_vector_ops.cuh"

namespace attngrad::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kTasksPerWarp = 5;  // 40 heads per token = 8 warps x 5

template <typename Operand, int kDim>
__global__ void __launch_bounds__(kWarps * 32)
    RmsNormRopeForwardKernel(HeadLayout layout, const float* __restrict__ qkv,
                             const float* __restrict__ cos, const float* __restrict__ sin,
                             const float* __restrict__ q_norm_weight,
                             const float* __restrict__ k_norm_weight, float eps, bool write_v,
                             Operand* __restrict__ operands, float* __restrict__ inv_rms) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int width = (layout.num_heads + 2 * layout.num_kv_heads) * kDim;  // qkv_width()
  const int norm_heads = layout.norm_heads();
  const int tasks = write_v ? norm_heads + layout.num_kv_heads : norm_heads;
  constexpr int kChunks = kDim / 128;  // float4 per lane and head
  float4 q_weight[kChunks], k_weight[kChunks];
#pragma unroll
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    q_weight[chunk] = reinterpret_cast<const float4*>(q_norm_weight)[lane + 32 * chunk];
    k_weight[chunk] = reinterpret_cast<const float4*>(k_norm_weight)[lane + 32 * chunk];
  }
  const bool low_half = lane < 16;  // elements 0..63 (head_dim 128)

  for (int token = blockIdx.x; token < layout.tokens; token += gridDim.x) {
    const float* row = qkv + static_cast<std::size_t>(token) * width;
    Operand* out_row = operands + static_cast<std::size_t>(token) * width;
    float4 c[kChunks], s[kChunks];
#pragma unroll
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      c[chunk] = reinterpret_cast<const float4*>(cos + static_cast<std::size_t>(token) *
                                                           kDim)[lane + 32 * chunk];
      s[chunk] = reinterpret_cast<const float4*>(sin + static_cast<std::size_t>(token) *
                                                           kDim)[lane + 32 * chunk];
    }
    // kTasksPerWarp heads per pass, all loads issued before the first use (memory parallelism).
    for (int base = warp; base < tasks; base += kWarps * kTasksPerWarp) {
      float4 x[kTasksPerWarp][kChunks];
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head >= tasks) continue;
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          x[i][chunk] =
              *reinterpret_cast<const float4*>(row + head * kDim + 128 * chunk + 4 * lane);
        }
      }
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head >= tasks) continue;
        const int column = head * kDim + 4 * lane;
        if (head >= norm_heads) {  // v: conversion only
#pragma unroll
          for (int chunk = 0; chunk < kChunks; ++chunk) {
            Store4(out_row + column + 128 * chunk, x[i][chunk]);
          }
          continue;
        }
        float squares = 0.f;
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          const float4 v = x[i][chunk];
          squares += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        const float mean_square = WarpSum(squares) / kDim;
        const float r = 1.0f / sqrtf(mean_square + eps);
        float4 n[kChunks];
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          const float4 w = head < layout.num_heads ? q_weight[chunk] : k_weight[chunk];
          const float4 v = x[i][chunk];
          n[chunk] = make_float4(v.x * r * (1.f + w.x), v.y * r * (1.f + w.y),
                                 v.z * r * (1.f + w.z), v.w * r * (1.f + w.w));
        }
        // rot(n)[d] = -n[d + D/2] for d < D/2, n[d - D/2] for d >= D/2.
        float4 partner[kChunks];
        float sign[kChunks];
        if constexpr (kChunks == 1) {
          partner[0].x = __shfl_xor_sync(0xffffffffu, n[0].x, 16);
          partner[0].y = __shfl_xor_sync(0xffffffffu, n[0].y, 16);
          partner[0].z = __shfl_xor_sync(0xffffffffu, n[0].z, 16);
          partner[0].w = __shfl_xor_sync(0xffffffffu, n[0].w, 16);
          sign[0] = low_half ? -1.f : 1.f;
        } else {
          partner[0] = n[1];
          partner[1] = n[0];
          sign[0] = -1.f;
          sign[1] = 1.f;
        }
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          const float4 nc = n[chunk], pc = partner[chunk], cc = c[chunk], sc = s[chunk];
          const float sg = sign[chunk];
          const float4 out =
              make_float4(nc.x * cc.x + sg * pc.x * sc.x, nc.y * cc.y + sg * pc.y * sc.y,
                          nc.z * cc.z + sg * pc.z * sc.z, nc.w * cc.w + sg * pc.w * sc.w);
          Store4(out_row + column + 128 * chunk, out);
        }
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
  if (layout.tokens < 1 || (layout.head_dim != 128 && layout.head_dim != 256)) {
    return ATTNGRAD_INTERNAL;
  }
  // One wave: as many blocks as the GPU holds at once (at most one per token).
  auto launch = [&](auto kernel, auto* operand) {
    int device = 0, multiprocessors = 0, per_multiprocessor = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, kWarps * 32,
                                                      0) != cudaSuccess) {
      return ATTNGRAD_CUDA_ERROR;
    }
    int blocks = multiprocessors * (per_multiprocessor > 0 ? per_multiprocessor : 1);
    if (blocks > layout.tokens) blocks = layout.tokens;
    kernel<<<blocks, kWarps * 32, 0, stream>>>(layout, qkv, cos, sin, q_norm_weight, k_norm_weight,
                                               eps, write_v, operand, inv_rms);
    return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
  };
  const bool wide = layout.head_dim == 256;
  if (type == OperandType::kHalf) {
    auto* operand = static_cast<__half*>(operands);
    return wide ? launch(RmsNormRopeForwardKernel<__half, 256>, operand)
                : launch(RmsNormRopeForwardKernel<__half, 128>, operand);
  }
  auto* operand = static_cast<float*>(operands);
  return wide ? launch(RmsNormRopeForwardKernel<float, 256>, operand)
              : launch(RmsNormRopeForwardKernel<float, 128>, operand);
}

}  // namespace attngrad::cuda
