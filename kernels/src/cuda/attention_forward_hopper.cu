// SPEC section 2 step 4 on Hopper (sm_90a, fp16 operands): the attention forward of
// attention_forward.cu (same contract, same arithmetic for the soft-cap, the mask and the online
// softmax) with the two products on warpgroup MMA (wgmma, hopper_wgmma.cuh). One block per
// (query tile, query head, batch), heaviest tiles first, of one warpgroup (64 query rows) at
// head_dim 128 and two (128 rows) at 256 (HopperForwardShape); each warpgroup owns 64 query rows.
// Key/value tiles of 64 keys stream through
// 128-byte-swizzled shared memory with cp.async, two stages each; the next tile's copies are issued
// right after the one barrier of an iteration, so they have a whole iteration to land. Within a
// warpgroup the score product of tile j (S_j = Q K_j^T, A and B from shared memory) and the value
// product of tile j - 1 (O += P_{j-1} V_{j-1}, P from registers) are in flight together while the
// softmax of S_j runs (FlashAttention-3's intra-warpgroup overlap). Key tiles that no row of
// the block sees (after the diagonal, before the sliding window) are never loaded nor computed; a
// warpgroup computes every tile of its block (wgmma under a condition that ptxas cannot prove
// warpgroup-uniform is serialised), its masked scores becoming P = 0.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/attention.h"
#include "cuda/attention_common.cuh"
#include "cuda/hopper_wgmma.cuh"

namespace attngrad::cuda::attention_detail {
namespace {

using hopper::SwizzledTile;

// The block's shape per head_dim. D = 128: one warpgroup (64 query rows) per block and key tiles
// of 64, 80 KB of shared memory, two blocks per SM that run unsynchronised, so that one block's
// softmax overlaps the other's products (two warpgroups of one block, lock-stepped by the block
// barrier of each key tile, left the tensor cores idle during both softmaxes). D = 256: two
// warpgroups of 64 rows and key tiles of 64 (the 64 x 256 output takes 128 registers per thread).
template <int D>
struct HopperForwardShape {
  static constexpr int kThreads = D == 128 ? 128 : 256;
  static constexpr int kRows = kThreads / 2;  // 64 query rows per warpgroup
  static constexpr int kKeys = 64;
  static constexpr int kMinBlocks = D == 128 ? 2 : 1;
};

template <int D>
struct HopperForwardLayout {
  static constexpr int kKeys = HopperForwardShape<D>::kKeys;
  using QueryTile = SwizzledTile<HopperForwardShape<D>::kRows, D>;
  using KeyTile = SwizzledTile<kKeys, D>;
  static constexpr int kKeyOffset = QueryTile::kBytes;                   // 2 stages
  static constexpr int kValueOffset = kKeyOffset + 2 * KeyTile::kBytes;  // 2 stages
  static constexpr int kBytes = kValueOffset + 2 * KeyTile::kBytes;
  static constexpr int kSharedBytes = kBytes + 1024;  // the base is rounded up to 1024 bytes
};

#if defined(ATTNGRAD_HOPPER_WGMMA)  // (the kernel's body is sm_90a code only)
// tanh(x) for |x| <= kPolynomialTanhBound as x Q(x^2), Q of degree 4 fitted to tanh(x) / x
// (relative minimax on [0, 0.25]): absolute error <= 5e-8 in fp32 arithmetic (TanhComplement's
// ~1e-7), six instructions on the FMA pipe instead of two on the special-function unit (ex2, rcp).
// This kernel's soft-capped softmax kept that unit busy with three per score (226 -> 194 us at
// 2x2048 on the H200 with this, 2026-12-03). The other kernels take CappedLog2's FastTanh
// (tanh.approx, one instruction on that unit); here it measured the same as this polynomial (2x2048
// 194.5 vs 193.6 us), which is the more accurate, so it stays.
inline constexpr float kPolynomialTanhBound = 0.5f;
__device__ __forceinline__ float PolynomialTanh(float x) {
  const float y = x * x;
  float q = fmaf(y, 0.017135001718997955f, -0.05298607423901558f);
  q = fmaf(y, q, 0.13324779272079468f);
  q = fmaf(y, q, -0.3333306908607483f);
  q = fmaf(y, q, 1.f);
  return x * q;
}

// Whether every raw score of a warp's tile (each thread's part: s) gives a tanh argument within
// kPolynomialTanhBound, so that the tile's soft-cap may take PolynomialTanh: a warp vote, so
// warp-uniform. False without a cap. Scores of ordinary size (|s| <= 25 for a cap of 50 at any
// scaling <= 1: every score of SPEC's inputs) pass.
template <int kTiles>
__device__ __forceinline__ bool TanhIsPolynomial(const AttentionParams& p,
                                                 const float (&s)[kTiles][4]) {
  if (!p.has_cap) return false;
  float largest = 0.f;
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    largest = fmaxf(largest, fmaxf(fmaxf(fabsf(s[n][0]), fabsf(s[n][1])),
                                   fmaxf(fabsf(s[n][2]), fabsf(s[n][3]))));
  }
  return __all_sync(0xffffffffu, largest * fabsf(p.score_scale) <= kPolynomialTanhBound);
}
#endif  // ATTNGRAD_HOPPER_WGMMA

template <int D>
__global__ void __launch_bounds__(HopperForwardShape<D>::kThreads,
                                  HopperForwardShape<D>::kMinBlocks)
    HopperAttentionForwardKernel(const AttentionParams p) {
#if defined(ATTNGRAD_HOPPER_WGMMA)
  using namespace hopper;
  using Op = Fp16Operand<D>;
  using Layout = HopperForwardLayout<D>;
  constexpr int kBM = HopperForwardShape<D>::kRows, kBN = Layout::kKeys;
  constexpr int kNT = kBN / 8;  // score tiles of 8 columns per thread row pair
  constexpr int kOutTiles = D / 8;
  constexpr int kThreads = HopperForwardShape<D>::kThreads;

  extern __shared__ unsigned char shared_raw[];
  const std::uint32_t base = (SharedAddress(shared_raw) + 1023u) & ~1023u;
  const std::uint32_t q_tile = base;  // the query tile comes first
  const std::uint32_t k_tiles = base + Layout::kKeyOffset;
  const std::uint32_t v_tiles = base + Layout::kValueOffset;
  constexpr std::uint32_t kTileBytes = Layout::KeyTile::kBytes;

  const int seq_len = p.seq_len;
  const int num_q_tiles = (seq_len + kBM - 1) / kBM;
  const WorkItem item = DecodeBlock(num_q_tiles, p.num_heads, p.batch, /*heavy_last=*/true);
  const int q0 = item.tile * kBM;
  const int kv_head = item.head / p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;
  const __half* q_base = static_cast<const __half*>(p.q) + token0 * p.ldq + item.head * D;
  const __half* k_base = static_cast<const __half*>(p.k) + token0 * p.ldkv + kv_head * D;
  const __half* v_base = static_cast<const __half*>(p.v) + token0 * p.ldkv + kv_head * D;

  const TileRange key_tiles = BlockRange<kBM, kBN>::KeyTiles(q0, seq_len, p.window);
  const int first_kv_tile = key_tiles.first;
  const int num_kv_tiles = key_tiles.Count();

  const int thread = threadIdx.x;
  const int warpgroup = kThreads == 128 ? 0 : thread / 128;  // (0 written out: warp-uniform)
  const int warp = (thread / 32) % 4, lane = thread & 31;
  const int t = lane & 3;
  const int wg_row0 = q0 + 64 * warpgroup;  // this warpgroup's first query row
  const int row_a = wg_row0 + 16 * warp + (lane >> 2), row_b = row_a + 8;

  // cp.async groups in commit order: G0 = {Q, K0}; G_j = {V_{j-1}, K_j} for j >= 1 (K_j only when
  // j < n), issued at the start of iteration j - 1 (G1 in the prologue).
  LoadSwizzledTileAsync<kBM, D, kThreads>(q_tile, q_base, p.ldq, q0, seq_len, thread);
  LoadSwizzledTileAsync<kBN, D, kThreads>(k_tiles, k_base, p.ldkv, first_kv_tile * kBN, seq_len,
                                          thread);
  CpAsyncCommit();
  LoadSwizzledTileAsync<kBN, D, kThreads>(v_tiles, v_base, p.ldkv, first_kv_tile * kBN, seq_len,
                                          thread);
  if (num_kv_tiles > 1) {
    LoadSwizzledTileAsync<kBN, D, kThreads>(k_tiles + kTileBytes, k_base, p.ldkv,
                                            (first_kv_tile + 1) * kBN, seq_len, thread);
  }
  CpAsyncCommit();
  CpAsyncWait<1>();
  FenceProxyAsync();
  __syncthreads();

  float acc_o[kOutTiles][4];
  ClearAccumulator(acc_o);
  float s[kNT][4];
  std::uint32_t prob[kNT / 2][4];
  float max_a = -INFINITY, max_b = -INFINITY;  // running max of the raw scores
  float base_a = 0.f, base_b = 0.f;            // its logit c * log2(e) (0 while the max is -inf)
  // c * log2(e) of a raw score (CappedLog2), with the same arithmetic as the elements below.
  auto logit = [&](float score) {
    float slope;  // (the backward's factor; unused here)
    return CappedLog2<Op>(p, score, slope);
  };
  float sum_a = 0.f, sum_b = 0.f;  // this thread's part of the row sums

  // S_j = Q K_j^T into s (asynchronous: committed as one group).
  auto issue_scores = [&](int j) {
    const std::uint32_t k_tile = k_tiles + (j & 1) * kTileBytes;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      Wgmma<kBN>::template SharedShared<0, 0>(s,
                                              KMajorDescriptor<kBM, D>(q_tile, 64 * warpgroup, ks),
                                              KMajorDescriptor<kBN, D>(k_tile, 0, ks), ks > 0);
    }
  };
  // O += P_j V_j (asynchronous).
  auto issue_values = [&](int j) {
    const std::uint32_t v_tile = v_tiles + (j & 1) * kTileBytes;
#pragma unroll
    for (int ks = 0; ks < kBN / 16; ++ks) {
      Wgmma<D>::template RegisterShared<1>(acc_o, prob[ks], MnMajorDescriptor<kBN, D>(v_tile, ks),
                                           1);
    }
  };
  // The online softmax of S_j (in s, in place: s becomes P_j unnormalised); returns the factors
  // that rescale the rows' earlier sums and outputs. The soft-cap and the scale are increasing
  // (scaling > 0, HopperForwardApplies), so a row's largest logit is that of its largest raw score:
  // the running max is kept on raw scores and only it goes through the cap. Per element, with the
  // cap: c * log2(e) = cap_log2e * tanh(x) = cap_log2e - 2 cap_log2e / (1 + 2^(2 x log2(e))), so
  // P = 2^(c log2(e) - base) is ex2, add, rcp, fma, ex2 (branch-free; absolute error of c ~ cap *
  // 1e-6, far below the fp16 rounding of P). A warp tile whose scores are all of ordinary size
  // (TanhIsPolynomial) takes t = PolynomialTanh instead: one ex2 per element, not three
  // special-function instructions. Masked entries get P = 0.
  auto softmax = [&](int j, float& alpha_a, float& alpha_b) {
    const bool polynomial = TanhIsPolynomial(p, s);  // on the raw scores, before the mask
    const int key0 = (first_kv_tile + j) * kBN;
    const int warp_row0 = wg_row0 + 16 * warp;
    const bool needs_mask = key0 + kBN - 1 > warp_row0 || key0 + kBN > seq_len ||
                            key0 < FirstVisibleKey(p, warp_row0 + 15);
    if (needs_mask) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + n * 8 + 2 * t + (e & 1);
          const int row = e < 2 ? row_a : row_b;
          if (IsMasked(p, key, row) || key >= seq_len) s[n][e] = -INFINITY;
        }
      }
    }
    float tile_max_a = -INFINITY, tile_max_b = -INFINITY;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      tile_max_a = fmaxf(tile_max_a, fmaxf(s[n][0], s[n][1]));
      tile_max_b = fmaxf(tile_max_b, fmaxf(s[n][2], s[n][3]));
    }
    tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(0xffffffffu, tile_max_a, 1));
    tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(0xffffffffu, tile_max_a, 2));
    tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(0xffffffffu, tile_max_b, 1));
    tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(0xffffffffu, tile_max_b, 2));
    // A row that has seen none of its keys keeps max -inf and base 0 (no NaN); its sum and output
    // are still zero, so its factor is 0.
    const float new_max_a = fmaxf(max_a, tile_max_a), new_max_b = fmaxf(max_b, tile_max_b);
    const float new_base_a = new_max_a == -INFINITY ? 0.f : logit(new_max_a);
    const float new_base_b = new_max_b == -INFINITY ? 0.f : logit(new_max_b);
    alpha_a = max_a == -INFINITY ? 0.f : FastExp2(base_a - new_base_a);
    alpha_b = max_b == -INFINITY ? 0.f : FastExp2(base_b - new_base_b);
    max_a = new_max_a;
    max_b = new_max_b;
    base_a = new_base_a;
    base_b = new_base_b;
    float part_a = 0.f, part_b = 0.f;
    if (polynomial) {  // c * log2(e) = cap_log2e * t (masked: -inf * cap, P = 0)
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float t = PolynomialTanh(s[n][e] * p.score_scale);
          float prob_value = FastExp2(fmaf(t, p.cap_log2e, e < 2 ? -base_a : -base_b));
          if (needs_mask && s[n][e] == -INFINITY) prob_value = 0.f;
          s[n][e] = prob_value;
        }
        part_a += s[n][0] + s[n][1];
        part_b += s[n][2] + s[n][3];
      }
    } else if (p.has_cap) {
      const float offset_a = p.cap_log2e - base_a, offset_b = p.cap_log2e - base_b;
      const float minus_two_cap = -2.f * p.cap_log2e;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float r = TanhComplement(p, s[n][e]);
          float prob_value = FastExp2(fmaf(minus_two_cap, r, e < 2 ? offset_a : offset_b));
          if (needs_mask && s[n][e] == -INFINITY) prob_value = 0.f;
          s[n][e] = prob_value;
        }
        part_a += s[n][0] + s[n][1];
        part_b += s[n][2] + s[n][3];
      }
    } else {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        s[n][0] = FastExp2(fmaf(s[n][0], p.score_scale, -base_a));
        s[n][1] = FastExp2(fmaf(s[n][1], p.score_scale, -base_a));
        s[n][2] = FastExp2(fmaf(s[n][2], p.score_scale, -base_b));
        s[n][3] = FastExp2(fmaf(s[n][3], p.score_scale, -base_b));
        part_a += s[n][0] + s[n][1];
        part_b += s[n][2] + s[n][3];
      }
    }
    sum_a = sum_a * alpha_a + part_a;
    sum_b = sum_b * alpha_b + part_b;
  };

  // Tile 0: its scores alone.
  {
    FenceAccumulators(s);
    WgmmaFence();
    issue_scores(0);
    WgmmaCommit();
    WgmmaWait<0>();
    FenceAccumulators(s);
    float alpha_a, alpha_b;
    softmax(0, alpha_a, alpha_b);  // O is still zero: nothing to rescale
    AccumulatorToOperand(s, 1.f, prob);
  }

  for (int j = 1; j < num_kv_tiles; ++j) {
    // G_j (V_{j-1}, K_j) has landed for every thread, and every warpgroup has retired its products
    // of iteration j - 1, so the buffers of K_{j-1} and V_{j-2} are free.
    CpAsyncWait<0>();
    FenceProxyAsync();
    __syncthreads();
    LoadSwizzledTileAsync<kBN, D, kThreads>(v_tiles + (j & 1) * kTileBytes, v_base, p.ldkv,
                                            (first_kv_tile + j) * kBN, seq_len, thread);
    if (j + 1 < num_kv_tiles) {
      LoadSwizzledTileAsync<kBN, D, kThreads>(k_tiles + ((j + 1) & 1) * kTileBytes, k_base, p.ldkv,
                                              (first_kv_tile + j + 1) * kBN, seq_len, thread);
    }
    CpAsyncCommit();

    FenceAccumulators(s);
    FenceAccumulators(acc_o);
    FenceOperand(prob);
    WgmmaFence();
    issue_scores(j);
    WgmmaCommit();
    issue_values(j - 1);
    WgmmaCommit();
    WgmmaWait<1>();
    FenceAccumulators(s);
    float alpha_a = 1.f, alpha_b = 1.f;
    softmax(j, alpha_a, alpha_b);
    WgmmaWait<0>();
    FenceAccumulators(acc_o);
    FenceOperand(prob);
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      acc_o[n][0] *= alpha_a;
      acc_o[n][1] *= alpha_a;
      acc_o[n][2] *= alpha_b;
      acc_o[n][3] *= alpha_b;
    }
    AccumulatorToOperand(s, 1.f, prob);
  }

  // The last tile's values (G_n = {V_{n-1}}, or G1 when n = 1).
  CpAsyncWait<0>();
  FenceProxyAsync();
  __syncthreads();
  {
    FenceAccumulators(acc_o);
    FenceOperand(prob);
    WgmmaFence();
    issue_values(num_kv_tiles - 1);
    WgmmaCommit();
    WgmmaWait<0>();
    FenceAccumulators(acc_o);
    FenceOperand(prob);
  }

  // Epilogue, as attention_forward.cu's: O (fp32 and/or fp16), lse, and the fused Delta.
  StoreForwardRows<Op>(p, acc_o, base_a, base_b, sum_a, sum_b, row_a, row_b, t, token0, item);
#else
  // Compiled for a GPU without wgmma. Only a build for Hopper without its sm_90a features (sm_90
  // instead of the project's 90a-real) would send work here: it fails loudly, never silently.
  __trap();
#endif  // ATTNGRAD_HOPPER_WGMMA
}

template <int D>
attngrad_status LaunchHopperForwardFor(const AttentionParams& params, cudaStream_t stream) {
  constexpr int kShared = HopperForwardLayout<D>::kSharedBytes;
  if (cudaFuncSetAttribute(HopperAttentionForwardKernel<D>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kShared) != cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  constexpr int kRows = HopperForwardShape<D>::kRows;
  const long long num_q_tiles = (params.seq_len + kRows - 1) / kRows;
  const long long blocks = num_q_tiles * params.num_heads * params.batch;
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  HopperAttentionForwardKernel<D>
      <<<static_cast<unsigned>(blocks), HopperForwardShape<D>::kThreads, kShared, stream>>>(params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

// Where it measured faster than AttentionForwardKernel (H200, both kernels forced per workload in
// one call, fp16, CUDA-graph timing, head_dim 128, one warpgroup per block; 2026-12-03): from S =
// 128 on ((64,256) 224.3 vs 255.4 us, (16,256) 66.0 vs 71.8, (32,128) 55.5 vs 60.5, (4,128) 13.0 vs
// 13.6, (8,128) 18.9 vs 18.9, (2,2048) 197.6 vs 264.2); (1,128) takes the short-sequence forward
// before this (8.8 us, 10.1 here). AUTO still takes it from S = 512 only: routed from S = 128 in
// the whole pipeline it measured nothing (64x256 4492 vs 4485 us; there the forward overlaps the
// side stream's work). Shorter sequences were not timed. head_dim 256 follows the same rule (not
// timed separately).
bool HopperForwardPays(const AttentionProblem& problem) { return problem.seq_len >= 512; }

}  // namespace

bool HopperForwardApplies(const AttentionProblem& problem) {
  // scaling > 0: each row's max is taken on raw scores (the logit must grow with them).
  if (problem.operand != AttentionOperand::kFp16 || !(problem.scaling > 0.f) ||
      problem.forward_path == AttentionForwardPath::kPortable ||
      problem.forward_path == AttentionForwardPath::kShort) {
    return false;
  }
  if (problem.forward_path == AttentionForwardPath::kAuto && !HopperForwardPays(problem)) {
    return false;
  }
  return CurrentDeviceIsHopper();
}

attngrad_status LaunchHopperForward(const AttentionParams& params, cudaStream_t stream) {
  return params.head_dim == 256 ? LaunchHopperForwardFor<256>(params, stream)
                                : LaunchHopperForwardFor<128>(params, stream);
}

}  // namespace attngrad::cuda::attention_detail
