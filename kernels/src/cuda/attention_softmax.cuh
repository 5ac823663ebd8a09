// Softmax arithmetic of the attention kernels: fast exp2/tanh/reciprocal, the soft-cap in log2
// units (CappedLog2), the backward's P and dS per element and its row statistics, and the
// forwards' online-softmax step. Internal to kernels/.
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_SOFTMAX_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_SOFTMAX_CUH_

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/attention_block_range.cuh"
#include "cuda/attention_params.cuh"

namespace attngrad::cuda::attention_detail {

__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float FastReciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// u = 1 / (1 + 2^(2 x log2(e))) of tanh's argument x = s * score_scale for a raw score s, so that
// tanh(x) = 1 - 2u: branch-free (ex2, add, rcp); x -> +inf gives u = 0 and x -> -inf u = 1 (ex2's
// inf and 0), so t = +-1 exactly. Absolute error of t ~1e-7 (what the softmax sees: c = cap t).
__device__ __forceinline__ float TanhComplement(const AttentionParams& p, float s) {
  return FastReciprocal(1.f + FastExp2(s * (2.f * kLog2e * p.score_scale)));
}

// tanh(x) in one special-function instruction (tanh.approx.f32, relative error <= 2^-10.99).
__device__ __forceinline__ float FastTanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Soft-capped score in log2 units: returns c * log2(e) of a raw score s and writes the cap's
// derivative factor slope = 1 - t^2, t = tanh(s * scaling / cap) (slope = 1 without a cap).
// kPreciseTanh (FP32 mode): tanhf. FP16 mode: t = FastTanh, one special-function instruction
// where TanhComplement takes two (its relative error ~5e-4 moves c by |c| 5e-4, the size of the
// fp16 rounding of the P and dS operands that follow). TF32 mode, with u = TanhComplement: c *
// log2(e) = cap_log2e (1 - 2u) and 1 - t^2 = 4u(1 - u), free of the cancellation of 1 - t^2 near
// |t| = 1.
template <class Op>
__device__ __forceinline__ float CappedLog2(const AttentionParams& p, float s, float& slope) {
  if (!p.has_cap) {
    slope = 1.f;
    return s * p.score_scale;
  }
  if constexpr (Op::kPreciseTanh || Op::kIsFp16) {
    const float t = Op::kPreciseTanh ? tanhf(s * p.score_scale) : FastTanh(s * p.score_scale);
    slope = fmaf(-t, t, 1.f);
    return t * p.cap_log2e;
  } else {
    const float u = TanhComplement(p, s);
    slope = 4.f * fmaf(-u, u, u);
    return fmaf(-2.f * p.cap_log2e, u, p.cap_log2e);
  }
}

// The backward's per-row statistics of a warp's two rows (row_a, row_b = row_a + 8): the forward's
// log-sum-exp in log2 units and Delta; rows past the sequence get lse = inf (P = 0) and Delta = 0.
struct RowStatistics {
  float lse_a, lse_b, delta_a, delta_b;
};
__device__ __forceinline__ RowStatistics LoadRowStatistics(const AttentionParams& p,
                                                           long long stat0, int row_a, int row_b) {
  RowStatistics rows;
  rows.lse_a = row_a < p.seq_len ? p.lse_in[stat0 + row_a] * kLog2e : INFINITY;
  rows.lse_b = row_b < p.seq_len ? p.lse_in[stat0 + row_b] * kLog2e : INFINITY;
  rows.delta_a = row_a < p.seq_len ? p.delta[stat0 + row_a] : 0.f;
  rows.delta_b = row_b < p.seq_len ? p.delta[stat0 + row_b] : 0.f;
  return rows;
}

inline constexpr float kHalfMax = 65504.f;

// P = exp(c - lse) of one recomputed score s (0 when masked), and the cap's factor slope = 1 - t^2
// (CappedLog2). lse_log2 is the row's log-sum-exp in log2 units.
template <class Op>
__device__ __forceinline__ float Probability(const AttentionParams& p, float s, float lse_log2,
                                             bool masked, float& slope) {
  const float c = CappedLog2<Op>(p, s, slope);
  const float prob = FastExp2(c - lse_log2);
  return masked ? 0.f : prob;
}

// dS clamped to fp16's range in the FP16 mode (an fp16 operand next).
template <class Op>
__device__ __forceinline__ float ClampGradient(float ds) {
  if constexpr (Op::kIsFp16) return fminf(fmaxf(ds, -kHalfMax), kHalfMax);
  return ds;
}

// One element of the backward's softmax gradient from the recomputed score s and dP:
// P = exp(c - lse) (0 when masked), dS = P (dP - Delta) (1 - t^2) scaling, times ds_factor
// (scaling and the FP16 mode's power-of-two scale), clamped to fp16's range in that mode.
// Returns P, writes dS.
template <class Op>
__device__ __forceinline__ float SoftmaxGradient(const AttentionParams& p, float s, float dp,
                                                 float lse_log2, float delta, float ds_factor,
                                                 bool masked, float& ds) {
  float slope;
  const float prob = Probability<Op>(p, s, lse_log2, masked, slope);
  ds = ClampGradient<Op>(prob * (dp - delta) * slope * ds_factor);
  return prob;
}

// The same in two halves, so that a kernel can do the first while the tensor cores still compute
// dP (attention_backward_hopper.cu). First: P, and the weight w = P (1 - t^2) ds_factor.
template <class Op>
__device__ __forceinline__ float ProbabilityAndWeight(const AttentionParams& p, float s,
                                                      float lse_log2, float ds_factor, bool masked,
                                                      float& weight) {
  float slope;
  const float prob = Probability<Op>(p, s, lse_log2, masked, slope);
  weight = prob * slope * ds_factor;
  return prob;
}
// Second: dS = w (dP - Delta), clamped as above unless the caller's conversion to fp16 saturates
// (kClamp = false: hopper_wgmma.cuh's AccumulatorToSaturatedOperand).
template <class Op, bool kClamp = true>
__device__ __forceinline__ float ScaledGradient(float weight, float dp, float delta) {
  const float ds = weight * (dp - delta);
  if constexpr (kClamp) return ClampGradient<Op>(ds);
  return ds;
}

// One key step of the mma.sync forwards' online softmax (attention_forward.cu,
// attention_forward_short.cu): a warp's scores s (rows row_a / row_b of its 16, keys from key0 in
// 8-column tiles, seq_len = p.seq_len) become their capped logits in log2 units (masked: -inf, when
// needs_mask), then P unnormalised against the rows' running max (max_a, max_b), added to this
// thread's part of the row sums; the row sums' and the output accumulator's earlier parts are
// rescaled to the new max.
template <class Op, int kNT, int kOutTiles>
__device__ __forceinline__ void OnlineSoftmaxStep(const AttentionParams& p, float (&s)[kNT][4],
                                                  float (&acc_o)[kOutTiles][4], bool needs_mask,
                                                  int key0, int seq_len, int row_a, int row_b,
                                                  int t, float& max_a, float& max_b, float& sum_a,
                                                  float& sum_b) {
  float tile_max_a = -INFINITY, tile_max_b = -INFINITY;
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float slope;  // (the backward's factor; unused here)
      float c = CappedLog2<Op>(p, s[n][e], slope);
      if (needs_mask) {
        const int key = key0 + n * 8 + 2 * t + (e & 1);
        const int row = e < 2 ? row_a : row_b;
        if (IsMasked(p, key, row) || key >= seq_len) c = -INFINITY;
      }
      s[n][e] = c;
    }
    tile_max_a = fmaxf(tile_max_a, fmaxf(s[n][0], s[n][1]));
    tile_max_b = fmaxf(tile_max_b, fmaxf(s[n][2], s[n][3]));
  }
  tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(0xffffffffu, tile_max_a, 1));
  tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(0xffffffffu, tile_max_a, 2));
  tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(0xffffffffu, tile_max_b, 1));
  tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(0xffffffffu, tile_max_b, 2));
  // With a sliding window a row may see none of a step's keys (its max stays -inf until its first
  // visible key): exponents are then taken against 0, so nothing becomes NaN.
  const float new_max_a = fmaxf(max_a, tile_max_a), new_max_b = fmaxf(max_b, tile_max_b);
  const float base_a = new_max_a == -INFINITY ? 0.f : new_max_a;
  const float base_b = new_max_b == -INFINITY ? 0.f : new_max_b;
  const float alpha_a = FastExp2(max_a - base_a), alpha_b = FastExp2(max_b - base_b);
  max_a = new_max_a;
  max_b = new_max_b;
  float part_a = 0.f, part_b = 0.f;
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    s[n][0] = FastExp2(s[n][0] - base_a);
    s[n][1] = FastExp2(s[n][1] - base_a);
    s[n][2] = FastExp2(s[n][2] - base_b);
    s[n][3] = FastExp2(s[n][3] - base_b);
    part_a += s[n][0] + s[n][1];
    part_b += s[n][2] + s[n][3];
  }
  sum_a = sum_a * alpha_a + part_a;
  sum_b = sum_b * alpha_b + part_b;
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n) {
    acc_o[n][0] *= alpha_a;
    acc_o[n][1] *= alpha_a;
    acc_o[n][2] *= alpha_b;
    acc_o[n][3] *= alpha_b;
  }
}

}  // namespace attngrad::cuda::attention_detail

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_SOFTMAX_CUH_
