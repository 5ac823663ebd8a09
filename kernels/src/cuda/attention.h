// Contract between the GPU pipeline (backward_device.cu) and the flash-style attention kernels of
// SPEC section 2 steps 4 and 6 (attention_forward.cu, attention_backward.cu). Internal to kernels/.
//
// Layout: every tensor here is token-major, as the projection GEMMs produce it. Element
// (b, s, head, d) of a tensor with row stride `ld` (in elements) is at ptr[(b*S + s)*ld + head*D
// + d], D = head_dim (128 or 256). Query head h reads key-value head h / (num_heads /
// num_kv_heads).
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

// How the backward's dK/dV work is spread (a tuning knob; kAuto picks by problem size, the others
// exist for benchmarks and tests). Every choice is deterministic.
enum class AttentionTiles {
  kAuto,
  kSmall,       // one block per (64-key tile, key-value head): sums its 3 query heads in registers
  kSmallSplit,  // one block per (64-key tile, query head): partials in the workspace, summed over
                // the group in head order by a small kernel (3x the blocks: for small problems)
  // Short sequences (S <= 256) with fp16 operands: the whole sequence of a head in one block, each
  // product computed once (attention_backward_short.cu). Requested for another operand, a longer
  // sequence or a device with less than 204 KB of shared memory per block, these fall back to
  // kSmall / kSmallSplit.
  kShort,       // one block per (batch, key-value head)
  kShortSplit,  // one block per (batch, query head), partials summed over the group as above
  // The same products spread over many blocks in one launch: dK/dV blocks of (32 keys, query head)
  // and dQ blocks of (32 queries, query head), S and dP computed in both (7 products); dK/dV
  // partials summed over the group as above. Falls back to kSmallSplit like kShortSplit.
  kShortGrid,
};

// Which forward kernel runs (a knob for benchmarks and tests; every choice gives the contract's
// results). kAuto: the wgmma kernel (attention_forward_hopper.cu) for fp16 operands on a
// compute-capability-9.0 GPU where it measured faster, else the mma.sync kernel. kHopper: the wgmma
// kernel wherever it can run (fp16, scaling > 0, compute capability 9.0), else the mma.sync one.
// kShort: the short-sequence kernel (attention_forward_short.cu: fp16, head_dim 128, S <= 256, a
// block's keys split over its warps; kAuto takes it for small grids), else the mma.sync one.
enum class AttentionForwardPath { kAuto, kPortable, kHopper, kShort };

// Where the Hopper backward (fp16, head_dim 128, compute capability 9.0, not a short-sequence
// kernel) gets dS for dQ = dS k' (a knob for benchmarks and tests). kStored: its dK/dV kernel
// writes dS, as fp16 64 x 64 tiles, into the workspace and a second kernel computes dQ from them
// (5 products: S and dP once per score); kRecomputed: the dQ kernel computes S, dP and dS again (7
// products, no dS in memory). kAuto stores while dS takes at most kMaxStoredScoreBytes.
enum class AttentionScores { kAuto, kStored, kRecomputed };
constexpr std::size_t kMaxStoredScoreBytes = std::size_t{512} << 20;

struct AttentionProblem {
  int batch = 0;
  int seq_len = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  // 128 (the SPEC layer, Gemma-3 27B) or 256 (Gemma-3 270M to 12B); other values are
  // ATTNGRAD_UNSUPPORTED. At 256 the short-sequence kernel does not apply (kShort* fall back).
  int head_dim = 128;
  float scaling = 0.f;  // s = (q' k'^T) * scaling
  float softcap = 0.f;  // c = softcap * tanh(s / softcap); 0 = no soft-cap (c = s); < 0 is invalid
  // Sliding window: query i sees keys j with i - sliding_window < j <= i; 0 = full causal; < 0 is
  // invalid. Key tiles wholly outside a query tile's window are never loaded nor computed.
  int sliding_window = 0;
  AttentionOperand operand = AttentionOperand::kTf32;
  AttentionTiles tiles = AttentionTiles::kAuto;
  AttentionForwardPath forward_path = AttentionForwardPath::kAuto;
  AttentionScores scores = AttentionScores::kAuto;
};

// Common requirements (else ATTNGRAD_INVALID_ARGUMENT, before any launch): batch, seq_len >= 1;
// num_heads a multiple of num_kv_heads; head_dim 128 or 256; every pointer 16-byte aligned; row
// strides at least the heads' width and a multiple of 16 bytes (ld % 8 == 0 for __half, % 4 for
// float). All work is on `stream`: no allocation, no host synchronisation (CUDA-graph capturable;
// checked with cudaStreamCaptureModeGlobal). A failed launch returns ATTNGRAD_CUDA_ERROR. kTf32
// rounds q, k, v, dO, P, dS to TF32 (round to nearest) inside the kernels: callers may pass plain
// fp32. kFp16 callers pass fp16 operands.

// Forward: O = softmax(mask(c)) v per query head (causal, and within the sliding window when
// there is one), and the log-sum-exp of each row of c.
//   q [B*S, ldq], k and v [B*S, ldkv]: float* or __half* by `operand` (a const void* here).
//   out  fp32 [B*S, num_heads*D] (row stride num_heads*D): A of SPEC step 4, overwritten; may
//        be nullptr when out_half is given (the FP16 pipeline, whose backward takes Delta from the
//        forward, needs only the fp16 copy).
//   out_half: nullptr, or __half [B*S, num_heads*D] receiving the same values rounded to fp16
//             (the FP16 pipeline's operand of dWo = dY^T A).
//   lse  fp32 [B, num_heads, S]: log(sum_j exp(c_ij)) over unmasked j, overwritten.
//   fused_delta: nullptr, or where the forward also computes Delta = rowsum(dO * O) for the
//             backward (from the fp32 O it holds in registers, the way the backward's own Delta
//             pass would), writing it into the backward's workspace; that backward is then called
//             with delta_ready = true and skips its pass over O and dO.
struct FusedDelta {
  const void* grad_out = nullptr;  // dO as AttentionBackward takes it (element type of q)
  int ldo = 0;
  void* backward_workspace = nullptr;  // the workspace the backward will be given
};
attngrad_status AttentionForward(const AttentionProblem& problem, const void* q, int ldq,
                                 const void* k, const void* v, int ldkv, float* out, void* out_half,
                                 float* lse, cudaStream_t stream,
                                 const FusedDelta* fused_delta = nullptr);

// Bytes of scratch AttentionBackward needs (0 for an invalid shape): Delta = rowsum(dO * O), fp32
// [B, num_heads, S] (rounded up to 256 bytes), plus, when the dK/dV work is split over query heads
// (kSmallSplit, kShortSplit, kShortGrid; kAuto picks one of them for small problems), fp32
// partials [group][2][B*S][num_kv_heads*D] (24 KiB per token for Gemma-3 4B; at
// most ~80 MB), plus, when the Hopper backward stores dS (AttentionScores), its 8 KiB tiles: per
// (batch, query head) ceil(S/64) * (ceil(S/64) + 1) / 2 of them under the causal mask (207 MB at
// B = 2, S = 2048 for 24 heads), fewer with a sliding window.
std::size_t AttentionBackwardWorkspaceSize(const AttentionProblem& problem);

// Which kernels a backward call launches: all of them, or one of its two independent halves so
// that a caller can run them on two streams at once (both after the forward, delta_ready): the
// dK/dV half (the dK/dV kernel and the split partials' sum; for short sequences the whole backward,
// whose one kernel also writes dQ; with dS stored (AttentionScores), the dK/dV kernel and then the
// dQ kernel that reads its dS) and the dQ half (nothing for short sequences or stored dS).
enum class AttentionBackwardPart { kAll, kKeyValue, kQuery };

// Backward: SPEC step 6. Deterministic (no atomics: bitwise-identical results call after call).
// kFp16 at head_dim 128 on a compute-capability-9.0 GPU (H100/H200) runs the dK/dV and dQ kernels
// on wgmma (attention_backward_hopper.cu; dS stored or recomputed by problem.scores; the parts
// below keep their meaning); every other case,
// and S <= 256 where a short-sequence kernel is chosen (kAuto: its grid form while B * num_heads *
// ceil(S/32) <= 96, ShortGridPays), runs the mma.sync kernels.
// ATTNGRAD_WORKSPACE_TOO_SMALL when workspace_size < AttentionBackwardWorkspaceSize(problem).
//   q, k, v as in the forward; out fp32 [B*S, num_heads*D] is the forward's O; lse from the
//   forward. grad_out: dO, same element type as q (float or __half), [B*S, ldo]. grad_q fp32 [B*S,
//   num_heads*D], grad_k and grad_v fp32 [B*S, num_kv_heads*D]: dq', dk', dv (dk and dv summed
//   over the query heads of each key-value head), overwritten (ld = their widths). delta_ready: the
//   forward already wrote Delta into this workspace (FusedDelta, same problem, same dO); `out` is
//   then not read. Required for AttentionBackwardPart::kQuery.
attngrad_status AttentionBackward(const AttentionProblem& problem, const void* q, int ldq,
                                  const void* k, const void* v, int ldkv, const float* out,
                                  const void* grad_out, int ldo, const float* lse, float* grad_q,
                                  float* grad_k, float* grad_v, void* workspace,
                                  std::size_t workspace_size, cudaStream_t stream,
                                  bool delta_ready = false,
                                  AttentionBackwardPart part = AttentionBackwardPart::kAll);

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_H_
