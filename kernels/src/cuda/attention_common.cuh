// What the flash-style attention kernels (attention_forward*.cu, SPEC section 2 step 4;
// attention_backward*.cu, step 6) share beyond their building blocks: the mma.sync dQ kernels' key
// step, the forwards' epilogue, and the host-side choice of kernel. Internal to kernels/.
//
// The building blocks, by role (each included here, so that a kernel file includes this one):
//   attention_operand_traits.cuh  operand traits per AttentionOperand mode and head dimension
//   attention_params.cuh          AttentionParams and the host-side checks that fill them
//   attention_block_range.cuh     the causal/window mask, key/query block ranges, work items, the
//                                 stored dS tiles
//   attention_mma_fragments.cuh   mma.sync fragments, accumulator tiles, warp tile products
//   attention_softmax.cuh         soft-cap, exp, P and dS per element, the online-softmax step
//   attention_tile_loads.cuh      cp.async tile loads
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_COMMON_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_COMMON_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/attention.h"
#include "cuda/attention_block_range.cuh"
#include "cuda/attention_mma_fragments.cuh"
#include "cuda/attention_operand_traits.cuh"
#include "cuda/attention_params.cuh"
#include "cuda/attention_softmax.cuh"
#include "cuda/attention_tile_loads.cuh"

namespace attngrad::cuda::attention_detail {

// One key step of the mma.sync dQ kernels (attention_backward.cu, attention_backward_short.cu's
// grid form): for a warp's 16 query rows from a_row0 of q_tile / do_tile and the keys from key0 of
// k_tile / v_tile (this thread's rows row_a, row_b; their lse and Delta in rows), S and dP are
// recomputed, dS formed (SoftmaxGradient) and dQ += dS K added into acc_dq.
template <class Op, int kNT, int kOutTiles>
__device__ __forceinline__ void QueryGradientStep(
    const AttentionParams& p, const typename Op::Elem* q_tile, const typename Op::Elem* do_tile,
    int a_row0, const typename Op::Elem* k_tile, const typename Op::Elem* v_tile, int key0,
    int row_a, int row_b, int t, const RowStatistics& rows, float ds_factor,
    float (&acc_dq)[kOutTiles][4]) {
  float s[kNT][4], dp[kNT][4];
  ClearAccumulators(s);
  ClearAccumulators(dp);
  WarpProductNk<Op, kNT>(s, q_tile, a_row0, k_tile);
  WarpProductNk<Op, kNT>(dp, do_tile, a_row0, v_tile);
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + n * 8 + 2 * t + (e & 1);
      const int row = e < 2 ? row_a : row_b;
      float ds;
      SoftmaxGradient<Op>(p, s[n][e], dp[n][e], e < 2 ? rows.lse_a : rows.lse_b,
                          e < 2 ? rows.delta_a : rows.delta_b, ds_factor, IsMasked(p, key, row),
                          ds);
      dp[n][e] = ds;
    }
  }
  AccumulatorA<Op, kNT> ds_a;
  AccumulatorToA<Op, kNT>(dp, 1.f, ds_a);
  WarpProductKn<Op, kNT>(acc_dq, ds_a, k_tile);
}

// The forward's epilogue (attention_forward.cu and attention_forward_hopper.cu): a thread holds
// output columns 8n + 2t, 8n + 2t + 1 of two rows (row_a, row_b = row_a + 8: acc_o[n][0..1] and
// [2..3]) with their running max (log2 units) and partial sums over its 4-thread row group. Writes
// O (fp32 and/or fp16), lse (natural log), and with a fused Delta (p.delta set) Delta =
// rowsum(dO * O) from the fp32 O in registers, each thread's columns in order, then across the 4
// threads of the row (fixed order).
template <class Op, int kOutTiles>
__device__ __forceinline__ void StoreForwardRows(const AttentionParams& p,
                                                 const float (&acc_o)[kOutTiles][4], float max_a,
                                                 float max_b, float sum_a, float sum_b, int row_a,
                                                 int row_b, int t, long long token0,
                                                 const WorkItem& item) {
  using Elem = typename Op::Elem;
  constexpr int kD = Op::kHeadDim;
  const int seq_len = p.seq_len;
  sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
  sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
  sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
  sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);
  const float inv_a = 1.f / sum_a, inv_b = 1.f / sum_b;
  const int out_ld = p.num_heads * kD;
  const bool fuse_delta = p.delta != nullptr;
#pragma unroll
  for (int half_rows = 0; half_rows < 2; ++half_rows) {
    const int row = half_rows == 0 ? row_a : row_b;
    const bool valid = row < seq_len;
    const float inv = half_rows == 0 ? inv_a : inv_b;
    const long long offset = (token0 + row) * out_ld + item.head * kD + 2 * t;
    float delta = 0.f;
    // 128 columns at a time (16 tiles): dO loaded before the stores (which may alias for the
    // compiler), in at most 32 registers.
#pragma unroll
    for (int n0 = 0; n0 < kOutTiles; n0 += 16) {
      float2 grad_out[16];
      if (fuse_delta && valid) {
        const Elem* grad_row =
            static_cast<const Elem*>(p.grad_out) + (token0 + row) * p.ldo + item.head * kD + 2 * t;
#pragma unroll
        for (int n = 0; n < 16; ++n) grad_out[n] = LoadGradOutPair<Op>(grad_row + (n0 + n) * 8);
      }
      if (valid) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          const float o0 = acc_o[n0 + n][2 * half_rows] * inv;
          const float o1 = acc_o[n0 + n][2 * half_rows + 1] * inv;
          if (p.out != nullptr) {
            *reinterpret_cast<float2*>(p.out + offset + (n0 + n) * 8) = make_float2(o0, o1);
          }
          if (p.out_half != nullptr) {
            *reinterpret_cast<__half2*>(p.out_half + offset + (n0 + n) * 8) =
                __floats2half2_rn(o0, o1);
          }
          if (fuse_delta) delta = fmaf(grad_out[n].x, o0, fmaf(grad_out[n].y, o1, delta));
        }
      }
    }
    if (valid && t == 0) {
      const float row_max = half_rows == 0 ? max_a : max_b;
      const float row_sum = half_rows == 0 ? sum_a : sum_b;
      p.lse[(static_cast<long long>(item.batch) * p.num_heads + item.head) * seq_len + row] =
          (row_max + log2f(row_sum)) * kLn2;
    }
    if (fuse_delta) {  // the whole warp takes part in the shuffles
      delta += __shfl_xor_sync(0xffffffffu, delta, 1);
      delta += __shfl_xor_sync(0xffffffffu, delta, 2);
      if (t == 0 && valid) {
        p.delta[(static_cast<long long>(item.batch) * p.num_heads + item.head) * seq_len + row] =
            delta;
      }
    }
  }
}

// The short-sequence backward (attention_backward_short.cu): fp16 operands, head_dim 128, S <=
// this, and a device that gives a block its 204 KB of shared memory (sm_90/sm_100; not
// sm_80/sm_86/sm_89).
inline constexpr int kShortSequenceMaxLength = 256;
bool ShortSequenceBackwardFitsDevice();
inline bool ShortSequenceBackwardApplies(const AttentionProblem& problem) {
  return problem.operand == AttentionOperand::kFp16 && problem.head_dim == 128 &&
         problem.seq_len <= kShortSequenceMaxLength && ShortSequenceBackwardFitsDevice();
}
// Launches it (after DeltaKernel; SumPartialsKernel follows when params.kv_split).
attngrad_status LaunchShortSequenceBackward(const AttentionParams& params, cudaStream_t stream);
// Its grid form (attention_backward_short.cu, AttentionTiles::kShortGrid): one launch of dK/dV
// blocks (32 keys, query head) and dQ blocks (32 queries, query head), same operands and limits,
// 155 KB of shared memory per block.
bool ShortGridBackwardFitsDevice();
inline bool ShortGridBackwardApplies(const AttentionProblem& problem) {
  return problem.operand == AttentionOperand::kFp16 && problem.head_dim == 128 &&
         problem.seq_len <= kShortSequenceMaxLength && ShortGridBackwardFitsDevice();
}
attngrad_status LaunchShortGridBackward(const AttentionParams& params, cudaStream_t stream);

// The Hopper backward (attention_backward_hopper.cu): the dK/dV and dQ kernels on wgmma, for fp16
// operands at head_dim 128 on a compute-capability-9.0 GPU (its code is the sm_90a build); the
// mma.sync kernels serve every other case.
// Whether the current device is compute capability 9.0 (Hopper: wgmma; the sm_90a code of this
// build runs there). Both Hopper kernels ask it at every call (no cached state).
bool CurrentDeviceIsHopper();
inline bool HopperBackwardApplies(const AttentionProblem& problem) {
  return problem.operand == AttentionOperand::kFp16 && problem.head_dim == 128 &&
         CurrentDeviceIsHopper();
}
// Launch the dK/dV kernel and the dQ kernel.
attngrad_status LaunchHopperKeyValue(const AttentionParams& params, cudaStream_t stream);
attngrad_status LaunchHopperQuery(const AttentionParams& params, cudaStream_t stream);

// The Hopper forward (attention_forward_hopper.cu): fp16 operands on a compute-capability-9.0 GPU
// (wgmma; the binary must hold sm_90a code), by problem.forward_path and, for kAuto, where it
// measured faster. Other operands and GPUs take AttentionForwardKernel.
bool HopperForwardApplies(const AttentionProblem& problem);
attngrad_status LaunchHopperForward(const AttentionParams& params, cudaStream_t stream);

// The short-sequence forward (attention_forward_short.cu): fp16 operands, head_dim 128, S <= 256,
// by problem.forward_path (kShort) and, for kAuto, where it is chosen; taken before the others.
bool ShortForwardApplies(const AttentionProblem& problem);
attngrad_status LaunchShortForward(const AttentionParams& params, cudaStream_t stream);

// Where the short-sequence kernels of 32-row blocks (the forward of attention_forward_short.cu and
// the backward's grid form) measured faster in the whole pipeline (H200, 2026-12-02): at most 96
// such blocks (B * num_heads * ceil(S / 32)), i.e. one sequence of S <= 128 for Gemma-3 4B's 24
// heads: (1,128) 145.0 / 146.3 against 148.5 / 148.8 us (backward alone 19.3 against 26.4 us,
// forward 9.5 against 12.6). At (1,256) the backward alone won (31.4 against 39.3 us) but the
// pipeline lost (190.8 against 185.1; why was not examined); at (4,128), (4,256), (8,128) and
// larger grids both lost.
inline bool ShortGridPays(const AttentionProblem& problem) {
  return static_cast<long long>(problem.batch) * problem.num_heads *
             ((problem.seq_len + 31) / 32) <=
         96;
}

// dK/dV tile choice (measured on the H200, bench/history/ATTENTION_NOTES-log.md).
// kGrid / kGridSplit: the grid form of the short-sequence kernel, writing dK/dV itself (one query
// head per key-value head) or per query head into the partials.
enum class KeyValueTiling { kSmall, kSmallSplit, kShort, kShortSplit, kGrid, kGridSplit };
inline bool IsSplit(KeyValueTiling tiling) {
  return tiling == KeyValueTiling::kSmallSplit || tiling == KeyValueTiling::kShortSplit ||
         tiling == KeyValueTiling::kGridSplit;
}
inline bool IsWholeSequence(KeyValueTiling tiling) {  // one kernel writes dQ, dK and dV
  return tiling == KeyValueTiling::kShort || tiling == KeyValueTiling::kShortSplit ||
         tiling == KeyValueTiling::kGrid || tiling == KeyValueTiling::kGridSplit;
}
inline KeyValueTiling ChooseKeyValueTiling(const AttentionProblem& problem) {
  const bool short_applies = ShortSequenceBackwardApplies(problem);
  const bool grouped = problem.num_heads != problem.num_kv_heads;
  switch (problem.tiles) {
    case AttentionTiles::kSmall: return KeyValueTiling::kSmall;
    case AttentionTiles::kSmallSplit: return KeyValueTiling::kSmallSplit;
    case AttentionTiles::kShort:
      return short_applies ? KeyValueTiling::kShort : KeyValueTiling::kSmall;
    case AttentionTiles::kShortSplit:
      return short_applies ? KeyValueTiling::kShortSplit : KeyValueTiling::kSmallSplit;
    case AttentionTiles::kShortGrid:
      if (!ShortGridBackwardApplies(problem)) return KeyValueTiling::kSmallSplit;
      return grouped ? KeyValueTiling::kGridSplit : KeyValueTiling::kGrid;
    case AttentionTiles::kAuto: break;
  }
  // The grid form where it measured faster in the whole pipeline (ShortGridPays).
  if (ShortGridBackwardApplies(problem) && ShortGridPays(problem)) {
    return grouped ? KeyValueTiling::kGridSplit : KeyValueTiling::kGrid;
  }
  // The short-sequence kernel (split over the query heads) measured faster than the tiled ones
  // only for S <= 128 with few key-value blocks (H200: (1,128) 28 vs 32 us, (4,128) 35 vs 41 us,
  // (8,128) even; slower at (32,128) and at every S = 256 shape; measured 2026-11-29).
  if (short_applies && problem.seq_len <= 128 && problem.num_heads != problem.num_kv_heads &&
      static_cast<long long>(problem.batch) * problem.num_kv_heads < 128) {
    return KeyValueTiling::kShortSplit;
  }
  // Splitting over the query heads pays while there are fewer than ~2 waves of 64-key blocks.
  const long long small_blocks =
      static_cast<long long>((problem.seq_len + 63) / 64) * problem.num_kv_heads * problem.batch;
  if (small_blocks >= 400 || problem.num_heads == problem.num_kv_heads)
    return KeyValueTiling::kSmall;
  return KeyValueTiling::kSmallSplit;
}

}  // namespace attngrad::cuda::attention_detail

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_COMMON_CUH_
