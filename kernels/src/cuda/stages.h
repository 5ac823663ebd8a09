// The element-wise stages of the GPU pipeline between the projection GEMMs and the attention
// kernels (SPEC section 2 steps 2-3 and 7-8), and the fp32 -> fp16 operand conversion of the FP16
// mode. Internal to kernels/; backward_device.cu strings them together.
//
// Layout (token-major, as the GEMMs produce it): the projections of one token are one row of
// width qkv_width = (num_heads + 2 * num_kv_heads) * 128: q heads first, then k heads, then v heads.
// Every kernel here supports head_dim == 128 only.
#ifndef ATTNGRAD_KERNELS_CUDA_STAGES_H_
#define ATTNGRAD_KERNELS_CUDA_STAGES_H_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "attngrad/attngrad.h"

namespace attngrad::cuda {

inline constexpr int kHeadDim = 128;

// Element type of the operands the stages write for the tensor-core GEMMs and the attention.
enum class OperandType { kFloat, kHalf };

// fp32 -> fp16 conversion of up to kMaxConvertSegments tensors in one launch (FP16 mode operands:
// hidden states, grad_output, the weights). Values are rounded to nearest; `scale` (a power of two)
// multiplies each value first so that small tensors stay in fp16's normal range.
inline constexpr int kMaxConvertSegments = 8;
struct ConvertSegment {
  const float* source = nullptr;
  __half* destination = nullptr;
  std::size_t count = 0;  // elements
  float scale = 1.f;
};
attngrad_status ConvertToHalf(const ConvertSegment* segments, int num_segments,
                              cudaStream_t stream);

// Shape shared by the RMSNorm/RoPE stages.
struct HeadLayout {
  int tokens = 0;        // B*S
  int num_heads = 0;     // query heads
  int num_kv_heads = 0;  // key-value heads
  __host__ __device__ int qkv_width() const {
    return (num_heads + 2 * num_kv_heads) * kHeadDim;
  }
  // Heads with an RMSNorm (q and k).
  __host__ __device__ int norm_heads() const { return num_heads + num_kv_heads; }
};

// SPEC steps 2-3 (forward recomputation): from the projections qkv fp32 [T, qkv_width], writes the
// attention operands q' = rope(rmsnorm(q)), k' = rope(rmsnorm(k)) into `operands` [T, qkv_width]
// (float or __half by `type`, same column positions as qkv) and, when write_v, v (converted) too;
// inv_rms fp32 [T, norm_heads] receives r = 1/sqrt(mean(x^2) + eps) per token and q/k head.
attngrad_status RmsNormRopeForward(const HeadLayout& layout, const float* qkv, const float* cos,
                                   const float* sin, const float* q_norm_weight,
                                   const float* k_norm_weight, float eps, OperandType type,
                                   bool write_v, void* operands, float* inv_rms,
                                   cudaStream_t stream);

// Per-block partial sums of the norm-weight gradients: [blocks, 2 * 128] floats.
int RopeRmsNormBackwardBlocks(int tokens);
inline std::size_t RopeRmsNormBackwardPartialsBytes(int tokens) {
  return static_cast<std::size_t>(RopeRmsNormBackwardBlocks(tokens)) * 2 * kHeadDim * sizeof(float);
}

// SPEC steps 7-8: from dq' fp32 [T, num_heads*128], dk' and dv fp32 [T, num_kv_heads*128] (the
// attention backward's outputs), the forward's qkv and inv_rms, writes dq, dk and dv times
// `grad_scale` (a power of two) into grad_qkv [T, qkv_width] (float or __half), and the first pass
// of the norm-weight gradients' deterministic reduction: per-block partial sums, *partial_rows rows
// of `partials` (a count that depends only on the device and T).
attngrad_status RopeRmsNormBackward(const HeadLayout& layout, const float* grad_q_rot,
                                    const float* grad_k_rot, const float* grad_v,
                                    const float* qkv, const float* inv_rms, const float* cos,
                                    const float* sin, const float* q_norm_weight,
                                    const float* k_norm_weight, OperandType type, float grad_scale,
                                    void* grad_qkv, float* partials, int* partial_rows,
                                    cudaStream_t stream);

// The second pass: the norm-weight gradients as the fixed-order sum of the partials' rows, added to
// grad_*_norm_weight when `accumulate`, written otherwise. A separate launch so that the pipeline
// can run it on another stream (nothing else waits for it).
attngrad_status NormWeightGradientSum(const float* partials, int partial_rows,
                                      float* grad_q_norm_weight, float* grad_k_norm_weight,
                                      bool accumulate, cudaStream_t stream);

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_STAGES_H_
