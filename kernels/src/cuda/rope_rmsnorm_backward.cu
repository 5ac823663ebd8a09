// Stage: SPEC section 2 steps 7-8 — RoPE backward (dxn = dx' cos + rot^T(dx' sin)) and Gemma
// RMSNorm backward (g = dxn (1 + w), dx = r (g - x̂ mean(g x̂))) of every q and k head, writing dq,
// dk and the converted dv side by side as the operand of the dX and dW_qkv GEMMs, plus the
// norm-weight gradients (sum over tokens and heads of dxn x̂) through a deterministic two-pass
// reduction: each block sums its tokens in a fixed order into its own row of `partials`, then one
// block adds the rows in a fixed order.
//
// One warp per (token, head) as in rmsnorm_rope_forward.cu: lane l holds elements 4l..4l+3.
#include "cuda/stages.h"
#include "cuda/warp_vector_ops.cuh"

namespace attngrad::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxBlocks = 1024;
constexpr int kFinalThreads = 1024;
constexpr int kTasksPerWarp = 5;  // 40 heads per token = 8 warps x 5

// Two builds of the kernel: as ptxas likes it (117 registers, 2 blocks per SM) and squeezed to 80
// registers for 3 blocks (24 warps) per SM, more loads in flight for the ~47 KB per token. On the
// H200 the second ran 9-15% faster from 2048 tokens up (2.75 -> 3.2 TB/s at 16384) and a little
// slower below (its small spills lengthen the per-token latency that dominates there).
constexpr int kManyTokens = 2048;

template <typename Operand, int kMinBlocksPerSm>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocksPerSm)
    RopeRmsNormBackwardKernel(HeadLayout layout, const float* __restrict__ grad_q_rot,
                              const float* __restrict__ grad_k_rot,
                              const float* __restrict__ grad_v, const float* __restrict__ qkv,
                              const float* __restrict__ inv_rms, const float* __restrict__ cos,
                              const float* __restrict__ sin,
                              const float* __restrict__ q_norm_weight,
                              const float* __restrict__ k_norm_weight,
                              Operand* __restrict__ grad_qkv, float* __restrict__ partials) {
  __shared__ float block_sums[kWarps][2 * kHeadDim];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int width = layout.qkv_width();
  const int norm_heads = layout.norm_heads();
  const int tasks = norm_heads + layout.num_kv_heads;
  const int q_width = layout.num_heads * kHeadDim;
  const int kv_width = layout.num_kv_heads * kHeadDim;
  // The norm weights are read per head from L1 (kept out of registers for the occupancy above).
  const float4* q_weight = reinterpret_cast<const float4*>(q_norm_weight) + lane;
  const float4* k_weight = reinterpret_cast<const float4*>(k_norm_weight) + lane;
  const bool low_half = lane < 16;
  float4 q_sum = make_float4(0.f, 0.f, 0.f, 0.f);  // this lane's 4 elements of grad_q_norm_weight
  float4 k_sum = make_float4(0.f, 0.f, 0.f, 0.f);

  for (int token = blockIdx.x; token < layout.tokens; token += gridDim.x) {
    const std::size_t t = static_cast<std::size_t>(token);
    const float* row = qkv + t * width;
    Operand* out_row = grad_qkv + t * width;
    const float4 c = reinterpret_cast<const float4*>(cos + t * kHeadDim)[lane];
    const float4 s = reinterpret_cast<const float4*>(sin + t * kHeadDim)[lane];
    // kTasksPerWarp heads per pass, all loads issued before the first use (memory parallelism).
    for (int base = warp; base < tasks; base += kWarps * kTasksPerWarp) {
      float4 g[kTasksPerWarp], x[kTasksPerWarp];
      float r[kTasksPerWarp];
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head >= tasks) continue;
        const int column = head * kHeadDim + 4 * lane;
        if (head >= norm_heads) {  // dv
          g[i] =
              *reinterpret_cast<const float4*>(grad_v + t * kv_width + column - q_width - kv_width);
        } else if (head < layout.num_heads) {
          g[i] = *reinterpret_cast<const float4*>(grad_q_rot + t * q_width + column);
        } else {
          g[i] = *reinterpret_cast<const float4*>(grad_k_rot + t * kv_width + column - q_width);
        }
        if (head < norm_heads) {
          x[i] = *reinterpret_cast<const float4*>(row + column);
          r[i] = inv_rms[t * norm_heads + head];
        }
      }
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head >= tasks) continue;
        const int column = head * kHeadDim + 4 * lane;
        if (head >= norm_heads) {  // dv: convert only
          Store4(out_row + column, g[i]);
          continue;
        }
        const bool is_q = head < layout.num_heads;
        // rot^T(u)[d] = u[d+64] for d < 64, -u[d-64] for d >= 64, with u = dx' sin.
        const float4 u = make_float4(g[i].x * s.x, g[i].y * s.y, g[i].z * s.z, g[i].w * s.w);
        float4 partner;
        partner.x = __shfl_xor_sync(0xffffffffu, u.x, 16);
        partner.y = __shfl_xor_sync(0xffffffffu, u.y, 16);
        partner.z = __shfl_xor_sync(0xffffffffu, u.z, 16);
        partner.w = __shfl_xor_sync(0xffffffffu, u.w, 16);
        const float sign = low_half ? 1.f : -1.f;
        const float4 dn =
            make_float4(g[i].x * c.x + sign * partner.x, g[i].y * c.y + sign * partner.y,
                        g[i].z * c.z + sign * partner.z, g[i].w * c.w + sign * partner.w);
        const float4 xh = make_float4(x[i].x * r[i], x[i].y * r[i], x[i].z * r[i], x[i].w * r[i]);
        if (is_q) {
          q_sum.x += dn.x * xh.x;
          q_sum.y += dn.y * xh.y;
          q_sum.z += dn.z * xh.z;
          q_sum.w += dn.w * xh.w;
        } else {
          k_sum.x += dn.x * xh.x;
          k_sum.y += dn.y * xh.y;
          k_sum.z += dn.z * xh.z;
          k_sum.w += dn.w * xh.w;
        }
        const float4 w = __ldg(is_q ? q_weight : k_weight);
        const float4 gg = make_float4(dn.x * (1.f + w.x), dn.y * (1.f + w.y), dn.z * (1.f + w.z),
                                      dn.w * (1.f + w.w));
        const float mean =
            WarpSum(gg.x * xh.x + gg.y * xh.y + gg.z * xh.z + gg.w * xh.w) / kHeadDim;
        Store4(out_row + column,
               make_float4(r[i] * (gg.x - xh.x * mean), r[i] * (gg.y - xh.y * mean),
                           r[i] * (gg.z - xh.z * mean), r[i] * (gg.w - xh.w * mean)));
      }
    }
  }
  // Block partial: warps' sums added in warp order (fixed), one row of `partials` per block.
  block_sums[warp][4 * lane + 0] = q_sum.x;
  block_sums[warp][4 * lane + 1] = q_sum.y;
  block_sums[warp][4 * lane + 2] = q_sum.z;
  block_sums[warp][4 * lane + 3] = q_sum.w;
  block_sums[warp][kHeadDim + 4 * lane + 0] = k_sum.x;
  block_sums[warp][kHeadDim + 4 * lane + 1] = k_sum.y;
  block_sums[warp][kHeadDim + 4 * lane + 2] = k_sum.z;
  block_sums[warp][kHeadDim + 4 * lane + 3] = k_sum.w;
  __syncthreads();
  for (int element = threadIdx.x; element < 2 * kHeadDim; element += blockDim.x) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += block_sums[w][element];
    partials[static_cast<std::size_t>(blockIdx.x) * 2 * kHeadDim + element] = total;
  }
}

// Second pass: thread (part, element) sums rows part, part + 4, ... of `partials`; the four parts
// are then added in order. The result depends only on the number of rows, never on timing.
__global__ void __launch_bounds__(kFinalThreads)
    NormWeightGradientFinalKernel(const float* __restrict__ partials, int rows,
                                  const float* __restrict__ inverse_scale,
                                  float* __restrict__ grad_q_norm_weight,
                                  float* __restrict__ grad_k_norm_weight, bool accumulate) {
  constexpr int kParts = kFinalThreads / (2 * kHeadDim);
  __shared__ float part_sums[kParts][2 * kHeadDim];
  const int element = threadIdx.x % (2 * kHeadDim);
  const int part = threadIdx.x / (2 * kHeadDim);
  // Unrolled so that 8 loads are in flight before the (in-order) additions use them.
  float total = 0.f;
#pragma unroll 8
  for (int row = part; row < rows; row += kParts) {
    total += partials[static_cast<std::size_t>(row) * 2 * kHeadDim + element];
  }
  part_sums[part][element] = total;
  __syncthreads();
  if (part == 0) {
    float sum = 0.f;
#pragma unroll
    for (int p = 0; p < kParts; ++p) sum += part_sums[p][element];
    if (inverse_scale != nullptr) sum *= *inverse_scale;
    float* destination = element < kHeadDim ? grad_q_norm_weight + element
                                            : grad_k_norm_weight + (element - kHeadDim);
    *destination = accumulate ? *destination + sum : sum;
  }
}

}  // namespace

int RopeRmsNormBackwardBlocks(int tokens) {
  return tokens < 1 ? 1 : (tokens < kMaxBlocks ? tokens : kMaxBlocks);
}

namespace {

// Blocks of the main kernel: as many as the GPU holds at once (one wave, no tail), at most one per
// token and at most RopeRmsNormBackwardBlocks(tokens) (the partials' rows). Depends only on the
// device and T, so the reduction order is the same call after call.
template <typename Kernel>
attngrad_status BlocksFor(Kernel kernel, int tokens, int* blocks) {
  int device = 0, multiprocessors = 0, per_multiprocessor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, kWarps * 32, 0) !=
          cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  const int resident = multiprocessors * (per_multiprocessor > 0 ? per_multiprocessor : 1);
  const int cap = RopeRmsNormBackwardBlocks(tokens);
  *blocks = resident < cap ? resident : cap;
  return ATTNGRAD_OK;
}

}  // namespace

attngrad_status RopeRmsNormBackward(const HeadLayout& layout, const float* grad_q_rot,
                                    const float* grad_k_rot, const float* grad_v, const float* qkv,
                                    const float* inv_rms, const float* cos, const float* sin,
                                    const float* q_norm_weight, const float* k_norm_weight,
                                    OperandType type, void* grad_qkv, float* partials,
                                    int* partial_rows, cudaStream_t stream) {
  if (layout.tokens < 1 || partial_rows == nullptr) return ATTNGRAD_INTERNAL;
  // The build for the shape; the block count then depends only on the device and T, so the
  // reduction order is the same call after call.
  auto launch = [&](auto kernel, auto* operand) {
    const attngrad_status sized = BlocksFor(kernel, layout.tokens, partial_rows);
    if (sized != ATTNGRAD_OK) return sized;
    kernel<<<*partial_rows, kWarps * 32, 0, stream>>>(layout, grad_q_rot, grad_k_rot, grad_v, qkv,
                                                      inv_rms, cos, sin, q_norm_weight,
                                                      k_norm_weight, operand, partials);
    return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
  };
  const bool many = layout.tokens >= kManyTokens;
  if (type == OperandType::kHalf) {
    auto* operand = static_cast<__half*>(grad_qkv);
    return many ? launch(RopeRmsNormBackwardKernel<__half, 3>, operand)
                : launch(RopeRmsNormBackwardKernel<__half, 1>, operand);
  }
  auto* operand = static_cast<float*>(grad_qkv);
  return many ? launch(RopeRmsNormBackwardKernel<float, 3>, operand)
              : launch(RopeRmsNormBackwardKernel<float, 1>, operand);
}

attngrad_status NormWeightGradientSum(const float* partials, int partial_rows,
                                      const float* inverse_scale, float* grad_q_norm_weight,
                                      float* grad_k_norm_weight, bool accumulate,
                                      cudaStream_t stream) {
  if (partial_rows < 1) return ATTNGRAD_INTERNAL;
  NormWeightGradientFinalKernel<<<1, kFinalThreads, 0, stream>>>(
      partials, partial_rows, inverse_scale, grad_q_norm_weight, grad_k_norm_weight, accumulate);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace attngrad::cuda
