// Contract between the GPU pipeline (backward_device.cu) and the flash-style attention kernels of
// SPEC section 2 steps 4 and 6 (attention_forward.cu, attention_backward.cu). Internal to kernels/.
//
// Layout: every tensor here is token-major, as the projection GEMMs produce it. Element
// (b, s, head, d) of a tensor with row stride `ld` (in elements) is at ptr[(b*S + s)*ld + head*128 + d].
// head_dim is 128. Query head h reads key-value head h / (num_heads / num_kv_heads).
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_H_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstddef>

#include "attngrad/attngrad.h"

namespace attngrad::cuda {

// Element type and arithmetic of the attention's matrix products.
enum class AttentionOperand {
  kFp32,  // float operands, exact fp32 FMA arithmetic
  kTf32,  // float operands rounded to TF32 on tensor cores, fp32 accumulation
  kFp16,  // __half operands, fp32 accumulation; small operands (dS) scaled by a power of two
};

// Tile shapes (a tuning knob; kAuto picks by problem size, the others exist for benchmarks and tests).
enum class AttentionTiles {
  kAuto,
  kSmall,       // 64-row tiles, 4 warps per block
  kLarge,       // kFp16 only: 128-row tiles, 8 warps per block (halves L2 traffic per product)
  kSmallSplit,  // 64-row tiles; dK/dV split over the query heads of a group into workspace
                // partials summed in a fixed order (more blocks for small problems)
  kPipelined,   // kFp16: 64-row tiles, fragment loads software-pipelined in the forward and dQ
                // kernels; dK/dV tiles as kAuto
};

struct AttentionProblem {
  int batch = 0;
  int seq_len = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  float scaling = 0.f;  // s = (q' k'^T) * scaling
  float softcap = 0.f;  // c = softcap * tanh(s / softcap)
  AttentionOperand operand = AttentionOperand::kTf32;
  AttentionTiles tiles = AttentionTiles::kAuto;
};

// Forward: O = softmax(causal(c)) v per query head, and the log-sum-exp of each row of c.
//   q [B*S, ldq], k and v [B*S, ldkv]: float* or __half* by `operand` (a const void* here).
//   out  fp32 [B*S, num_heads*128] (row stride num_heads*128): A of SPEC step 4, overwritten.
//   out_half: nullptr, or __half [B*S, num_heads*128] receiving the same values rounded to fp16
//             (the FP16 pipeline's operand of dWo = dY^T A).
//   lse  fp32 [B, num_heads, S]: log(sum_j exp(c_ij)) over unmasked j, overwritten.
attngrad_status AttentionForward(const AttentionProblem& problem, const void* q, int ldq,
                                 const void* k, const void* v, int ldkv, float* out,
                                 void* out_half, float* lse, cudaStream_t stream);

// Bytes of scratch AttentionBackward needs (e.g. Delta = rowsum(dO * O) per row and head).
std::size_t AttentionBackwardWorkspaceSize(const AttentionProblem& problem);

// Backward: SPEC step 6. Deterministic (no floating-point atomics whose order varies).
//   q, k, v as in the forward; out fp32 [B*S, num_heads*128] is the forward's O; lse from the forward.
//   grad_out: dO, same element type as q (float or __half), [B*S, ldo].
//   grad_q fp32 [B*S, num_heads*128], grad_k and grad_v fp32 [B*S, num_kv_heads*128]: dq', dk', dv
//   (dk and dv summed over the query heads of each key-value head), overwritten (ld = their widths).
attngrad_status AttentionBackward(const AttentionProblem& problem, const void* q, int ldq,
                                  const void* k, const void* v, int ldkv, const float* out,
                                  const void* grad_out, int ldo, const float* lse, float* grad_q,
                                  float* grad_k, float* grad_v, void* workspace,
                                  std::size_t workspace_size, cudaStream_t stream);

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_H_
