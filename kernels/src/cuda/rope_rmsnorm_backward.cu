// Stage: SPEC section 2 steps 7-8 — RoPE backward (dxn = dx' cos + rot^T(dx' sin)) and Gemma
// RMSNorm backward (g = dxn (1 + w), dx = r (g - x̂ mean(g x̂))) of every q and k head, writing dq,
// dk and the converted dv side by side as the operand of the dX and dW_qkv GEMMs, plus the
// norm-weight gradients (sum over tokens and heads of dxn x̂) through a deterministic two-pass
// reduction: each block sums its tokens in a fixed order into its own row of `partials`, then one
// block adds the rows in a fixed order.
//
// One warp per (token, head) as in rmsnorm_rope_forward.cu: lane l holds elements 4l..4l+3 of each
// 128 columns (one chunk at head_dim 128, two at 256).
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

template <typename Operand, int kDim, int kMinBlocksPerSm>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocksPerSm)
    RopeRmsNormBackwardKernel(HeadLayout layout, const float* __restrict__ grad_q_rot,
                              const float* __restrict__ grad_k_rot,
                              const float* __restrict__ grad_v, const float* __restrict__ qkv,
                              const float* __restrict__ inv_rms, const float* __restrict__ cos,
                              const float* __restrict__ sin,
                              const float* __restrict__ q_norm_weight,
                              const float* __restrict__ k_norm_weight,
                              Operand* __restrict__ grad_qkv, float* __restrict__ partials) {
  constexpr int kChunks = kDim / 128;  // float4 per lane and head
  __shared__ float block_sums[kWarps][2 * kDim];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int width = (layout.num_heads + 2 * layout.num_kv_heads) * kDim;  // qkv_width()
  const int norm_heads = layout.norm_heads();
  const int tasks = norm_heads + layout.num_kv_heads;
  const int q_width = layout.num_heads * kDim;
  const int kv_width = layout.num_kv_heads * kDim;
  // The norm weights are read per head from L1 (kept out of registers for the occupancy above).
  const float4* q_weight = reinterpret_cast<const float4*>(q_norm_weight) + lane;
  const float4* k_weight = reinterpret_cast<const float4*>(k_norm_weight) + lane;
  const bool low_half = lane < 16;
  float4 q_sum[kChunks], k_sum[kChunks];  // this lane's elements of grad_q/k_norm_weight
#pragma unroll
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    q_sum[chunk] = make_float4(0.f, 0.f, 0.f, 0.f);
    k_sum[chunk] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  for (int token = blockIdx.x; token < layout.tokens; token += gridDim.x) {
    const std::size_t t = static_cast<std::size_t>(token);
    const float* row = qkv + t * width;
    Operand* out_row = grad_qkv + t * width;
    float4 c[kChunks], s[kChunks];
#pragma unroll
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      c[chunk] = reinterpret_cast<const float4*>(cos + t * kDim)[lane + 32 * chunk];
      s[chunk] = reinterpret_cast<const float4*>(sin + t * kDim)[lane + 32 * chunk];
    }
    // kTasksPerWarp heads per pass, all loads issued before the first use (memory parallelism).
    for (int base = warp; base < tasks; base += kWarps * kTasksPerWarp) {
      float4 g[kTasksPerWarp][kChunks], x[kTasksPerWarp][kChunks];
      float r[kTasksPerWarp];
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head >= tasks) continue;
        const int column = head * kDim + 4 * lane;
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          const int at = column + 128 * chunk;
          if (head >= norm_heads) {  // dv
            g[i][chunk] =
                *reinterpret_cast<const float4*>(grad_v + t * kv_width + at - q_width - kv_width);
          } else if (head < layout.num_heads) {
            g[i][chunk] = *reinterpret_cast<const float4*>(grad_q_rot + t * q_width + at);
          } else {
            g[i][chunk] =
                *reinterpret_cast<const float4*>(grad_k_rot + t * kv_width + at - q_width);
          }
          if (head < norm_heads) x[i][chunk] = *reinterpret_cast<const float4*>(row + at);
        }
        if (head < norm_heads) r[i] = inv_rms[t * norm_heads + head];
      }
#pragma unroll
      for (int i = 0; i < kTasksPerWarp; ++i) {
        const int head = base + i * kWarps;
        if (head >= tasks) continue;
        const int column = head * kDim + 4 * lane;
        if (head >= norm_heads) {  // dv: convert only
#pragma unroll
          for (int chunk = 0; chunk < kChunks; ++chunk) {
            Store4(out_row + column + 128 * chunk, g[i][chunk]);
          }
          continue;
        }
        const bool is_q = head < layout.num_heads;
        // rot^T(u)[d] = u[d + D/2] for d < D/2, -u[d - D/2] for d >= D/2, with u = dx' sin.
        float4 u[kChunks];
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          const float4 gc = g[i][chunk], sc = s[chunk];
          u[chunk] = make_float4(gc.x * sc.x, gc.y * sc.y, gc.z * sc.z, gc.w * sc.w);
        }
        float4 partner[kChunks];
        float sign[kChunks];
        if constexpr (kChunks == 1) {
          partner[0].x = __shfl_xor_sync(0xffffffffu, u[0].x, 16);
          partner[0].y = __shfl_xor_sync(0xffffffffu, u[0].y, 16);
          partner[0].z = __shfl_xor_sync(0xffffffffu, u[0].z, 16);
          partner[0].w = __shfl_xor_sync(0xffffffffu, u[0].w, 16);
          sign[0] = low_half ? 1.f : -1.f;
        } else {
          partner[0] = u[1];
          partner[1] = u[0];
          sign[0] = 1.f;
          sign[1] = -1.f;
        }
        float4 dn[kChunks], xh[kChunks], gg[kChunks];
        float dot = 0.f;
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          const float4 gc = g[i][chunk], cc = c[chunk], pc = partner[chunk], xc = x[i][chunk];
          const float sg = sign[chunk];
          dn[chunk] = make_float4(gc.x * cc.x + sg * pc.x, gc.y * cc.y + sg * pc.y,
                                  gc.z * cc.z + sg * pc.z, gc.w * cc.w + sg * pc.w);
          xh[chunk] = make_float4(xc.x * r[i], xc.y * r[i], xc.z * r[i], xc.w * r[i]);
          if (is_q) {
            q_sum[chunk].x += dn[chunk].x * xh[chunk].x;
            q_sum[chunk].y += dn[chunk].y * xh[chunk].y;
            q_sum[chunk].z += dn[chunk].z * xh[chunk].z;
            q_sum[chunk].w += dn[chunk].w * xh[chunk].w;
          } else {
            k_sum[chunk].x += dn[chunk].x * xh[chunk].x;
            k_sum[chunk].y += dn[chunk].y * xh[chunk].y;
            k_sum[chunk].z += dn[chunk].z * xh[chunk].z;
            k_sum[chunk].w += dn[chunk].w * xh[chunk].w;
          }
          const float4 w = __ldg((is_q ? q_weight : k_weight) + 32 * chunk);
          gg[chunk] = make_float4(dn[chunk].x * (1.f + w.x), dn[chunk].y * (1.f + w.y),
                                  dn[chunk].z * (1.f + w.z), dn[chunk].w * (1.f + w.w));
          dot += gg[chunk].x * xh[chunk].x + gg[chunk].y * xh[chunk].y + gg[chunk].z * xh[chunk].z +
                 gg[chunk].w * xh[chunk].w;
        }
        const float mean = WarpSum(dot) / kDim;
#pragma unroll
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          const float4 gc = gg[chunk], xc = xh[chunk];
          Store4(out_row + column + 128 * chunk,
                 make_float4(r[i] * (gc.x - xc.x * mean), r[i] * (gc.y - xc.y * mean),
                             r[i] * (gc.z - xc.z * mean), r[i] * (gc.w - xc.w * mean)));
        }
      }
    }
  }
  // Block partial: warps' sums added in warp order (fixed), one row of `partials` per block.
#pragma unroll
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    float* q_row = &block_sums[warp][128 * chunk + 4 * lane];
    float* k_row = &block_sums[warp][kDim + 128 * chunk + 4 * lane];
    q_row[0] = q_sum[chunk].x;
    q_row[1] = q_sum[chunk].y;
    q_row[2] = q_sum[chunk].z;
    q_row[3] = q_sum[chunk].w;
    k_row[0] = k_sum[chunk].x;
    k_row[1] = k_sum[chunk].y;
    k_row[2] = k_sum[chunk].z;
    k_row[3] = k_sum[chunk].w;
  }
  __syncthreads();
  for (int element = threadIdx.x; element < 2 * kDim; element += blockDim.x) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += block_sums[w][element];
    partials[static_cast<std::size_t>(blockIdx.x) * 2 * kDim + element] = total;
  }
}

// Second pass: thread (part, element) sums rows part, part + 4, ... of `partials`; the four parts
// are then added in order. The result depends only on the number of rows, never on timing.
template <int kDim>
__global__ void __launch_bounds__(kFinalThreads)
    NormWeightGradientFinalKernel(const float* __restrict__ partials, int rows,
                                  const float* __restrict__ inverse_scale,
                                  float* __restrict__ grad_q_norm_weight,
                                  float* __restrict__ grad_k_norm_weight, bool accumulate) {
  constexpr int kParts = kFinalThreads / (2 * kDim);
  __shared__ float part_sums[kParts][2 * kDim];
  const int element = threadIdx.x % (2 * kDim);
  const int part = threadIdx.x / (2 * kDim);
  // Unrolled so that 8 loads are in flight before the (in-order) additions use them.
  float total = 0.f;
#pragma unroll 8
  for (int row = part; row < rows; row += kParts) {
    total += partials[static_cast<std::size_t>(row) * 2 * kDim + element];
  }
  part_sums[part][element] = total;
  __syncthreads();
  if (part == 0) {
    float sum = 0.f;
#pragma unroll
    for (int p = 0; p < kParts; ++p) sum += part_sums[p][element];
    if (inverse_scale != nullptr) sum *= *inverse_scale;
    float* destination =
        element < kDim ? grad_q_norm_weight + element : grad_k_norm_weight + (element - kDim);
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
  if (layout.tokens < 1 || partial_rows == nullptr ||
      (layout.head_dim != 128 && layout.head_dim != 256)) {
    return ATTNGRAD_INTERNAL;
  }
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
  // head_dim 256: one build (the few heads of those models; its registers double at 3 per SM).
  const bool many = layout.tokens >= kManyTokens;
  if (type == OperandType::kHalf) {
    auto* operand = static_cast<__half*>(grad_qkv);
    if (layout.head_dim == 256) return launch(RopeRmsNormBackwardKernel<__half, 256, 1>, operand);
    return many ? launch(RopeRmsNormBackwardKernel<__half, 128, 3>, operand)
                : launch(RopeRmsNormBackwardKernel<__half, 128, 1>, operand);
  }
  auto* operand = static_cast<float*>(grad_qkv);
  if (layout.head_dim == 256) return launch(RopeRmsNormBackwardKernel<float, 256, 1>, operand);
  return many ? launch(RopeRmsNormBackwardKernel<float, 128, 3>, operand)
              : launch(RopeRmsNormBackwardKernel<float, 128, 1>, operand);
}

attngrad_status NormWeightGradientSum(int head_dim, const float* partials, int partial_rows,
                                      const float* inverse_scale, float* grad_q_norm_weight,
                                      float* grad_k_norm_weight, bool accumulate,
                                      cudaStream_t stream) {
  if (partial_rows < 1 || (head_dim != 128 && head_dim != 256)) return ATTNGRAD_INTERNAL;
  const auto kernel =
      head_dim == 256 ? NormWeightGradientFinalKernel<256> : NormWeightGradientFinalKernel<128>;
  kernel<<<1, kFinalThreads, 0, stream>>>(partials, partial_rows, inverse_scale, grad_q_norm_weight,
                                          grad_k_norm_weight, accumulate);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace attngrad::cuda
