// SPEC section 2 step 4: the attention forward, flash style. Per query head, scores s = q' k'^T *
// scaling, soft-cap c = cap * tanh(s / cap), causal mask, P = softmax(c), O = P v; writes O (= A,
// fp32 and optionally fp16) and the log-sum-exp of every row, never materialising S x S. One block
// per (64-query tile, query head, batch); key/value tiles of 64 stream through shared memory with
// cp.async (keys double-buffered, values single-buffered: the next value tile loads while the next
// scores are computed, and the smaller footprint lets 3 fp16 blocks share an SM instead of 2;
// 64-key tiles at head_dim 128, 32-key tiles at 256, where a warp's 16 x 256 output takes 128
// registers and the fp32 tiles 166 KB of shared memory),
// fully masked tiles (after the diagonal, or before a sliding window) are never loaded; online
// softmax in registers.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/attention.h"
#include "cuda/attention_common.cuh"

namespace attngrad::cuda {
namespace attention_detail {
namespace {

// Keys per tile: 64 at head_dim 128, 32 at 256.
template <class Op>
constexpr int ForwardBlockN() {
  return Op::kHeadDim == 128 ? 64 : 32;
}
// Warps of 16 query rows per block. 8 (128-row tiles) measured ~10% slower on the H200 than 4: with
// ~170 registers only one 8-warp block fits per SM and its barrier waits are not covered.
constexpr int kForwardWarps = 4;

// The tiles of AttentionForwardKernel in shared memory: the block's query rows (16 per warp), two
// key tiles (double-buffered) and one value tile of ForwardBlockN keys.
template <class Op, int kWarps>
struct ForwardTile {
  using Elem = typename Op::Elem;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kQueries = 16 * kWarps;
  static constexpr int kKeys = ForwardBlockN<Op>();
  static constexpr int kScoreTiles = kKeys / 8;  // score n-tiles per warp
  static constexpr std::size_t kSharedBytes =
      static_cast<std::size_t>(kQueries + 3 * kKeys) * Op::kPitch * sizeof(Elem);

  Elem* queries;  // [kQueries][kPitch]
  Elem* keys;     // [2][kKeys][kPitch]
  Elem* values;   // [kKeys][kPitch]
  __device__ explicit ForwardTile(unsigned char* shared)
      : queries(reinterpret_cast<Elem*>(shared)),
        keys(queries + kQueries * Op::kPitch),
        values(keys + 2 * kKeys * Op::kPitch) {}
};

// fp16 at head_dim 128: 69.6 KB of shared memory per block, so 3 blocks per SM when registers stay
// <= 168.
template <class Op>
constexpr int ForwardMinBlocksPerSm() {
  return Op::kIsFp16 && Op::kHeadDim == 128 ? 3 : 1;
}

template <class Op, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, ForwardMinBlocksPerSm<Op>())
    AttentionForwardKernel(const AttentionParams p) {
  using Elem = typename Op::Elem;
  using Tile = ForwardTile<Op, kWarps>;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kBM = Tile::kQueries, kBN = Tile::kKeys, kP = Op::kPitch;
  constexpr int kNT = Tile::kScoreTiles;
  constexpr int kD = Op::kHeadDim;
  constexpr int kOutTiles = kD / 8;  // of a warp's 16 output rows

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const Tile tile(shared_raw);
  Elem* q_tile = tile.queries;
  Elem* k_tiles = tile.keys;
  Elem* v_tile = tile.values;

  const int seq_len = p.seq_len;
  const int num_q_tiles = (seq_len + kBM - 1) / kBM;
  const WorkItem item = DecodeBlock(num_q_tiles, p.num_heads, p.batch, /*heavy_last=*/true);
  const int q0 = item.tile * kBM;
  const int kv_head = item.head / p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;

  // Written out here (as in QueryGradientKernel): a shared helper for this prologue made ptxas
  // spill 8 bytes in the fp16 instance, which must fit 168 registers (3 blocks per SM).
  const Elem* q_base = static_cast<const Elem*>(p.q) + token0 * p.ldq + item.head * kD;
  const Elem* k_base = static_cast<const Elem*>(p.k) + token0 * p.ldkv + kv_head * kD;
  const Elem* v_base = static_cast<const Elem*>(p.v) + token0 * p.ldkv + kv_head * kD;

  // The key tiles this tile's rows can see; the ones wholly before the window are never loaded.
  const TileRange key_tiles = BlockRange<kBM, kBN>::KeyTiles(q0, seq_len, p.window);
  const int first_kv_tile = key_tiles.first;
  const int num_kv_tiles = key_tiles.Count();

  // cp.async groups, in commit order: {Q, K0}, {V0}, then per iteration j: {K(j+1)} at its start
  // and {V(j+1)} at its end (empty groups past the last tile keep the counting uniform).
  LoadTileAsync<Op, kBM, kThreads>(q_tile, q_base, p.ldq, q0, seq_len);
  LoadTileAsync<Op, kBN, kThreads>(k_tiles, k_base, p.ldkv, first_kv_tile * kBN, seq_len);
  CpAsyncCommit();
  LoadTileAsync<Op, kBN, kThreads>(v_tile, v_base, p.ldkv, first_kv_tile * kBN, seq_len);
  CpAsyncCommit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;

  float acc_o[kOutTiles][4];
  ClearAccumulators(acc_o);
  float max_a = -INFINITY, max_b = -INFINITY;  // running max of c*log2e
  float sum_a = 0.f, sum_b = 0.f;              // this thread's part of the row sums

  for (int j = 0; j < num_kv_tiles; ++j) {
    const int stage = j & 1;
    // The other key buffer was last read in iteration j - 1, before its closing barrier.
    if (j + 1 < num_kv_tiles) {
      LoadTileAsync<Op, kBN, kThreads>(k_tiles + (stage ^ 1) * kBN * kP, k_base, p.ldkv,
                                       (first_kv_tile + j + 1) * kBN, seq_len);
    }
    CpAsyncCommit();
    CpAsyncWait<2>();  // K(j) has landed; V(j) and K(j+1) may still be in flight
    Elem* k_tile = k_tiles + stage * kBN * kP;
    if (j == 0) RoundTileTf32<Op, kBM, kThreads>(q_tile);
    RoundTileTf32<Op, kBN, kThreads>(k_tile);
    __syncthreads();

    const int key0 = (first_kv_tile + j) * kBN;
    const int warp_row0 = q0 + warp * 16;
    // A warp whose 16 rows all precede this tile's keys (diagonal tiles), or whose windows all
    // start after its last key, has nothing to add.
    const bool active = key0 <= warp_row0 + 15 && key0 + kBN - 1 >= FirstVisibleKey(p, warp_row0);
    float s[kNT][4];
    if (active) {
      ClearAccumulators(s);
      WarpProductNk<Op, kNT>(s, q_tile, warp * 16, k_tile);

      const bool needs_mask = key0 + kBN - 1 > warp_row0 || key0 + kBN > seq_len ||
                              key0 < FirstVisibleKey(p, warp_row0 + 15);
      OnlineSoftmaxStep<Op>(p, s, acc_o, needs_mask, key0, seq_len, row_a, row_b, t, max_a, max_b,
                            sum_a, sum_b);
    }
    CpAsyncWait<1>();  // V(j) has landed; K(j+1) may still be in flight
    RoundTileTf32<Op, kBN, kThreads>(v_tile);
    __syncthreads();
    if (active) {
      AccumulatorA<Op, kNT> prob;
      AccumulatorToA<Op, kNT>(s, 1.f, prob);
      WarpProductKn<Op, kNT>(acc_o, prob, v_tile);
    }
    __syncthreads();  // every warp is done with V(j) (and K(j)) before they are overwritten
    if (j + 1 < num_kv_tiles) {
      LoadTileAsync<Op, kBN, kThreads>(v_tile, v_base, p.ldkv, (first_kv_tile + j + 1) * kBN,
                                       seq_len);
    }
    CpAsyncCommit();
  }

  StoreForwardRows<Op>(p, acc_o, max_a, max_b, sum_a, sum_b, row_a, row_b, t, token0, item);
}

template <class Op, int kWarps>
attngrad_status LaunchForward(const AttentionParams& params, cudaStream_t stream) {
  constexpr std::size_t kShared = ForwardTile<Op, kWarps>::kSharedBytes;
  cudaError_t error =
      cudaFuncSetAttribute(AttentionForwardKernel<Op, kWarps>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kShared));
  if (error != cudaSuccess) return ATTNGRAD_CUDA_ERROR;
  const long long num_q_tiles = (params.seq_len + 16 * kWarps - 1) / (16 * kWarps);
  const long long blocks = num_q_tiles * params.num_heads * params.batch;
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  AttentionForwardKernel<Op, kWarps>
      <<<static_cast<unsigned>(blocks), kWarps * 32, kShared, stream>>>(params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace
}  // namespace attention_detail

attngrad_status AttentionForward(const AttentionProblem& problem, const void* q, int ldq,
                                 const void* k, const void* v, int ldkv, float* out, void* out_half,
                                 float* lse, cudaStream_t stream, const FusedDelta* fused_delta) {
  using namespace attention_detail;
  AttentionParams params;
  attngrad_status status = MakeParams(problem, q, ldq, k, v, ldkv, &params);
  if (status != ATTNGRAD_OK) return status;
  if ((out == nullptr && out_half == nullptr) || lse == nullptr || !Aligned16(out) ||
      !Aligned16(out_half)) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  if (fused_delta != nullptr) {
    const int per_16_bytes = 16 / ElementBytes(problem.operand);
    if (fused_delta->grad_out == nullptr || fused_delta->backward_workspace == nullptr ||
        !Aligned16(fused_delta->grad_out) || !Aligned16(fused_delta->backward_workspace) ||
        fused_delta->ldo < problem.num_heads * problem.head_dim ||
        fused_delta->ldo % per_16_bytes != 0) {
      return ATTNGRAD_INVALID_ARGUMENT;
    }
    params.grad_out = fused_delta->grad_out;
    params.ldo = fused_delta->ldo;
    params.delta = static_cast<float*>(fused_delta->backward_workspace);  // Delta comes first there
  }
  params.out = out;
  params.out_half = static_cast<__half*>(out_half);
  params.lse = lse;
  if (ShortForwardApplies(problem)) return LaunchShortForward(params, stream);
  if (HopperForwardApplies(problem)) return LaunchHopperForward(params, stream);
  const bool wide = problem.head_dim == 256;
  switch (problem.operand) {
    case AttentionOperand::kFp16:
      return wide ? LaunchForward<Fp16Operand<256>, kForwardWarps>(params, stream)
                  : LaunchForward<OpFp16, kForwardWarps>(params, stream);
    case AttentionOperand::kTf32:
      return wide ? LaunchForward<Tf32Operand<256>, kForwardWarps>(params, stream)
                  : LaunchForward<OpTf32, kForwardWarps>(params, stream);
    case AttentionOperand::kFp32:
      return wide ? LaunchForward<Fp32Operand<256>, kForwardWarps>(params, stream)
                  : LaunchForward<OpFp32, kForwardWarps>(params, stream);
  }
  return ATTNGRAD_INVALID_ARGUMENT;
}

}  // namespace attngrad::cuda
