// The parameters every attention kernel takes (AttentionParams, by value) and the host-side checks
// that fill them from an AttentionProblem (attention.h). Internal to kernels/.
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_PARAMS_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_PARAMS_CUH_

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "cuda/attention.h"

namespace attngrad::cuda::attention_detail {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// Everything the kernels need, by value.
struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* grad_out = nullptr;
  int ldq = 0, ldkv = 0, ldo = 0;
  float* out = nullptr;
  __half* out_half = nullptr;
  float* lse = nullptr;
  const float* out_in = nullptr;
  const float* lse_in = nullptr;
  float* delta = nullptr;
  float* grad_q = nullptr;
  float* grad_k = nullptr;
  float* grad_v = nullptr;
  int batch = 0, seq_len = 0, num_heads = 0, num_kv_heads = 0, group = 1;
  int head_dim = 128;  // 128 or 256: the kernels' Op::kHeadDim
  // The effective sliding window, in [1, seq_len]: query i sees keys j with i - window < j <= i.
  // Full causal attention is window = seq_len (then no key of a valid row is cut off).
  int window = 0;
  float scaling = 0.f;
  bool has_cap = true;
  float score_scale =
      0.f;                // s * score_scale is tanh's argument (scaling / cap), or c*log2e (no cap)
  float cap_log2e = 0.f;  // cap * log2(e)
  bool kv_split = false;  // dK/dV per query head into `partials`, summed by a reduce kernel
  float* partials = nullptr;  // [group][2][B*S][num_kv_heads*head_dim]
  float ds_scale = 1.f;       // power of two applied to dS before it becomes an fp16 operand
  float inv_ds_scale = 1.f;
  // dS stored by the Hopper dK/dV kernel for the dQ kernel (AttentionScores::kStored): fp16 tiles
  // of 64 queries x 64 keys, ScoreTiles (attention_block_range.cuh); nullptr: not stored.
  __half* grad_scores = nullptr;
};

// ---- Host-side argument checks shared by the forward and the backward ---------------------------
inline bool Aligned16(const void* pointer) {
  return (reinterpret_cast<std::uintptr_t>(pointer) & 15u) == 0;
}

// AttentionParams::window of a problem: its sliding window, or seq_len for none (or one as long).
inline int EffectiveWindow(const AttentionProblem& problem) {
  return problem.sliding_window > 0 && problem.sliding_window < problem.seq_len
             ? problem.sliding_window
             : problem.seq_len;
}

inline int ElementBytes(AttentionOperand operand) {
  return operand == AttentionOperand::kFp16 ? 2 : 4;
}

// Checks the shape, the scalars and the q/k/v operands (non-null, 16-byte aligned, row strides that
// keep every row 16-byte aligned and wide enough), and fills the common part of the parameters.
inline attngrad_status MakeParams(const AttentionProblem& problem, const void* q, int ldq,
                                  const void* k, const void* v, int ldkv, AttentionParams* params) {
  if (problem.batch < 1 || problem.seq_len < 1 || problem.num_heads < 1 ||
      problem.num_kv_heads < 1 || problem.num_heads % problem.num_kv_heads != 0) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  if (!std::isfinite(problem.scaling) || !std::isfinite(problem.softcap) || problem.softcap < 0.f ||
      problem.sliding_window < 0) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  if (problem.head_dim != 128 && problem.head_dim != 256) return ATTNGRAD_UNSUPPORTED;
  if (problem.operand != AttentionOperand::kFp16 && problem.operand != AttentionOperand::kTf32 &&
      problem.operand != AttentionOperand::kFp32) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  const int per_16_bytes = 16 / ElementBytes(problem.operand);
  if (q == nullptr || k == nullptr || v == nullptr || !Aligned16(q) || !Aligned16(k) ||
      !Aligned16(v) || ldq < problem.num_heads * problem.head_dim ||
      ldkv < problem.num_kv_heads * problem.head_dim || ldq % per_16_bytes != 0 ||
      ldkv % per_16_bytes != 0) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  params->q = q;
  params->k = k;
  params->v = v;
  params->ldq = ldq;
  params->ldkv = ldkv;
  params->batch = problem.batch;
  params->seq_len = problem.seq_len;
  params->num_heads = problem.num_heads;
  params->num_kv_heads = problem.num_kv_heads;
  params->group = problem.num_heads / problem.num_kv_heads;
  params->head_dim = problem.head_dim;
  params->window = EffectiveWindow(problem);
  params->scaling = problem.scaling;
  params->has_cap = problem.softcap > 0.f;
  params->score_scale =
      params->has_cap ? problem.scaling / problem.softcap : problem.scaling * kLog2e;
  params->cap_log2e = params->has_cap ? problem.softcap * kLog2e : 0.f;
  return ATTNGRAD_OK;
}

}  // namespace attngrad::cuda::attention_detail

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_PARAMS_CUH_
