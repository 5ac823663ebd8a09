// SPEC section 2 step 6 (the attention backward) on Hopper's warpgroup MMA (sm_90a `wgmma`), for
// fp16 operands at head_dim 128 on a compute-capability-9.0 GPU, every product on wgmma, in one of
// two forms (AttentionScores): 5 products, the dK/dV kernel storing dS (fp16 64 x 64 tiles in the
// workspace, attention_block_range.cuh's ScoreTiles) and HopperQueryFromScoresKernel computing dQ =
// dS K from them; or 7, the two kernels of the mma.sync path of attention_backward.cu (S and dP
// computed in both). attention_backward.cu dispatches here (HopperBackwardApplies) and keeps
// DeltaKernel, the split partials' sum and every other mode/GPU.
//   HopperKeyValueKernel: one block of kGroups warpgroups per (64 * kGroups keys, key-value head,
//     batch) or, split, per (keys, query head); warpgroup w owns 64 keys and keeps their dK, dV
//     (64 x 128 fp32 each) in registers. Per step of 64 query rows (double-buffered with cp.async):
//     S^T = K Q^T and dP^T = V dO^T (wgmma, both operands in shared memory), P^T and dS^T in
//     registers, then dV += P^T dO and dK += dS^T Q (wgmma, A from registers: the accumulator
//     layout of S^T is the A-fragment layout of the next product).
//     With dS stored, each warpgroup also writes its dS^T (the fp16 register operand of dK +=
//     dS^T Q) to the workspace.
//   HopperQueryKernel (7 products): one block of kGroups warpgroups per (64 * kGroups queries,
//     query head, batch); per step of 64 keys: S = Q K^T, dP = dO V^T, dS in registers, dQ += dS K.
//   HopperQueryFromScoresKernel (5 products): per (128 queries, query head, batch), per step of 64
//     keys dQ += dS K with dS read back (below).
// Overlap: one warpgroup per block and two blocks per SM (the element-wise work of one runs while
// the other's products do), and inside a warpgroup the products are committed as separate groups
// so that P is computed while dP runs and dS while dV runs (ProbabilityAndWeight, then
// ScaledGradient: attention_softmax.cuh's SoftmaxGradient split at dP).
// Shared-memory tiles are 128 columns of fp16 stored as two 64-column halves of 128-byte rows with
// the 128-byte swizzle (hopper_wgmma.cuh), so one tile serves as a K-major operand (Q K^T) and as
// an MN-major one (dS K). Deterministic: every dK, dV, dQ element is summed in one fixed order (no
// atomics). Soft-cap (branch-free, attention_softmax.cuh's CappedLog2), the sliding window, the
// fp16 dS scale and the statistics are those of the mma.sync kernels (attention_softmax.cuh); the
// causal/window mask is applied only where a warp's 16 keys (dK/dV; rows in dQ) and the step's 64
// queries (keys) cross it, a warp-uniform branch.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention.h"
#include "cuda/attention_common.cuh"
#include "cuda/hopper_wgmma.cuh"

namespace attngrad::cuda::attention_detail {
namespace {

using Op = OpFp16;
constexpr int kHeadDim = 128;
constexpr int kGroupRows = 64;  // rows of a warpgroup's wgmma (M)
constexpr int kStepRows = 64;   // query rows (dK/dV) or keys (dQ) per step: the score tile's N
// Bytes of a tile of `rows` rows x 128 columns.
constexpr int TileBytes(int rows) { return rows * kHeadDim * 2; }

#ifdef ATTNGRAD_HOPPER_WGMMA
constexpr int kScoreTiles = kStepRows / 8;  // 8-column tiles of a score accumulator

// One warpgroup's score-like product: acc[64 x 64] = A[64 x 128] B[64 x 128]^T, A the 64 rows from
// a_row0 of a tile of kARows rows, B a whole 64-row tile, both K-major.
template <int kARows>
__device__ __forceinline__ void ScoreProduct(float (&acc)[kScoreTiles][4], std::uint32_t a_tile,
                                             int a_row0, std::uint32_t b_tile) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    hopper::Wgmma<kStepRows>::SharedShared<0, 0>(
        acc, hopper::KMajorDescriptor<kARows, kHeadDim>(a_tile, a_row0, ks),
        hopper::KMajorDescriptor<kStepRows, kHeadDim>(b_tile, 0, ks), ks > 0 ? 1 : 0);
  }
}

// acc[64 x 128] += A[64 x 64] B[64 x 128]: A the fp16 operand of a 64 x 64 accumulator tile (k =
// its columns), B a 64-row tile [k][n] read MN-major.
__device__ __forceinline__ void OutputProduct(float (&acc)[kHeadDim / 8][4],
                                              const std::uint32_t (&a)[kScoreTiles / 2][4],
                                              std::uint32_t b_tile) {
#pragma unroll
  for (int ks = 0; ks < kStepRows / 16; ++ks) {
    hopper::Wgmma<kHeadDim>::RegisterShared<1>(
        acc, a[ks], hopper::MnMajorDescriptor<kStepRows, kHeadDim>(b_tile, ks), 1);
  }
}

// A warpgroup's dS^T (64 keys x 64 queries, the fp16 register operand of dK += dS^T Q) into the
// swizzled 64 x 64 shared-memory tile at `tile` (ScoreTiles' image): a[k] holds the four 8 x 8
// matrices of key rows 16 warp + (0..7, 8..15) and query columns 16 k + (0..7, 8..15), in the order
// (rows 0-7, columns 0-7), (rows 8-15, columns 0-7), (rows 0-7, columns 8-15), (rows 8-15, 8-15).
__device__ __forceinline__ void StoreScoreTile(const std::uint32_t (&a)[kScoreTiles / 2][4],
                                               std::uint32_t tile) {
  using Tile = hopper::SwizzledTile<ScoreTiles::kRows, ScoreTiles::kRows>;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), column = 8 * (lane >> 4);
#pragma unroll
  for (int k = 0; k < kScoreTiles / 2; ++k) {
    hopper::StoreMatrices(tile + Tile::Offset(row, 16 * k + column), a[k]);
  }
}
#endif  // ATTNGRAD_HOPPER_WGMMA

// Shared memory of HopperKeyValueKernel (byte offsets from a 1024-byte aligned base).
template <int kGroups>
struct HopperKeyValueLayout {
  static constexpr int kKeys = kGroupRows * kGroups;
  static constexpr int kKeysOffset = 0;
  static constexpr int kValuesOffset = kKeysOffset + TileBytes(kKeys);
  static constexpr int kQueriesOffset = kValuesOffset + TileBytes(kKeys);           // [2]
  static constexpr int kGradOutOffset = kQueriesOffset + 2 * TileBytes(kStepRows);  // [2]
  static constexpr int kLseOffset = kGradOutOffset + 2 * TileBytes(kStepRows);      // [2][64]
  static constexpr int kDeltaOffset = kLseOffset + 2 * kStepRows * 4;               // [2][64]
  // dS^T of the last step on its way to the workspace (AttentionScores::kStored).
  static constexpr int kScoresOffset = kDeltaOffset + 2 * kStepRows * 4;
  static constexpr int kBytes = kScoresOffset + ScoreTiles::kHalves * 2;
  static constexpr std::size_t kSharedBytes = kBytes + 1024;  // room to align the base
};

// Shared memory of HopperQueryKernel.
template <int kGroups>
struct HopperQueryLayout {
  static constexpr int kQueries = kGroupRows * kGroups;
  static constexpr int kQueriesOffset = 0;
  static constexpr int kGradOutOffset = kQueriesOffset + TileBytes(kQueries);
  static constexpr int kKeysOffset = kGradOutOffset + TileBytes(kQueries);      // [2]
  static constexpr int kValuesOffset = kKeysOffset + 2 * TileBytes(kStepRows);  // [2]
  static constexpr int kBytes = kValuesOffset + 2 * TileBytes(kStepRows);
  static constexpr std::size_t kSharedBytes = kBytes + 1024;
};

// Shared memory of HopperQueryFromScoresKernel: per stage one key tile and each warpgroup's dS
// tile.
template <int kGroups>
struct HopperScoresQueryLayout {
  static constexpr int kQueries = kGroupRows * kGroups;
  static constexpr int kStages = 2;
  static constexpr int kScoreTileBytes = ScoreTiles::kHalves * 2;
  static constexpr int kKeysOffset = 0;  // [stage]
  static constexpr int kScoresOffset =
      kKeysOffset + kStages * TileBytes(kStepRows);  // [stage][group]
  static constexpr int kBytes = kScoresOffset + kStages * kGroups * kScoreTileBytes;
  static constexpr std::size_t kSharedBytes = kBytes + 1024;
};

#ifdef ATTNGRAD_HOPPER_WGMMA
// The dynamic shared memory's 1024-byte aligned base (the swizzle pattern is anchored there).
__device__ __forceinline__ unsigned char* AlignedShared(unsigned char* raw) {
  const std::uint32_t address = SmemAddress(raw);
  return raw + ((1024u - (address & 1023u)) & 1023u);
}
#endif

template <int kGroups>
__global__ void __launch_bounds__(kGroups * 128, 2 / kGroups)
    HopperKeyValueKernel(const AttentionParams p) {
#ifdef ATTNGRAD_HOPPER_WGMMA
  using Layout = HopperKeyValueLayout<kGroups>;
  constexpr int kThreads = kGroups * 128;
  constexpr int kKeys = Layout::kKeys;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* shared = AlignedShared(shared_raw);
  const std::uint32_t base = SmemAddress(shared);
  const std::uint32_t k_tile = base + Layout::kKeysOffset;
  const std::uint32_t v_tile = base + Layout::kValuesOffset;
  const std::uint32_t q_tiles = base + Layout::kQueriesOffset;
  const std::uint32_t do_tiles = base + Layout::kGradOutOffset;
  float* lse_tiles = reinterpret_cast<float*>(shared + Layout::kLseOffset);
  float* delta_tiles = reinterpret_cast<float*>(shared + Layout::kDeltaOffset);
  // dS^T goes through one staging tile per block, guarded by block barriers inside the step's
  // block-uniform branch: one warpgroup per block.
  static_assert(kGroups == 1, "the dS staging tile and its barriers assume one warpgroup");
  const std::uint32_t score_tile = base + Layout::kScoresOffset;
  __half* stored_scores = nullptr;  // where score_tile goes next (thread 0 copies it)

  const int seq_len = p.seq_len;
  const int num_kv_tiles = (seq_len + kKeys - 1) / kKeys;
  const WorkItem item = DecodeBlock(num_kv_tiles, p.kv_split ? p.num_heads : p.num_kv_heads,
                                    p.batch, /*heavy_last=*/false);
  const int key0 = item.tile * kKeys;
  const int kv_head = p.kv_split ? item.head / p.group : item.head;
  const int first_head = p.kv_split ? item.head : kv_head * p.group;
  const int num_block_heads = p.kv_split ? 1 : p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;

  const __half* k_base = static_cast<const __half*>(p.k) + token0 * p.ldkv + kv_head * kHeadDim;
  const __half* v_base = static_cast<const __half*>(p.v) + token0 * p.ldkv + kv_head * kHeadDim;
  const __half* q_base0 = static_cast<const __half*>(p.q) + token0 * p.ldq;
  const __half* do_base0 = static_cast<const __half*>(p.grad_out) + token0 * p.ldo;

  // The query tiles that can see this block's keys, of each query head of the block.
  const TileRange query_tiles = BlockRange<kStepRows, kKeys>::QueryTiles(key0, seq_len, p.window);
  const int first_q_tile = query_tiles.first;
  const int q_tiles_per_head = query_tiles.Count();
  const int steps = num_block_heads * q_tiles_per_head;

  auto load_step = [&](int step, int stage) {
    const int head = first_head + step / q_tiles_per_head;
    const int q0 = (first_q_tile + step % q_tiles_per_head) * kStepRows;
    hopper::LoadSwizzledTileAsync<kStepRows, kHeadDim, kThreads>(
        q_tiles + stage * TileBytes(kStepRows), q_base0 + head * kHeadDim, p.ldq, q0, seq_len,
        threadIdx.x);
    hopper::LoadSwizzledTileAsync<kStepRows, kHeadDim, kThreads>(
        do_tiles + stage * TileBytes(kStepRows), do_base0 + head * kHeadDim, p.ldo, q0, seq_len,
        threadIdx.x);
    // lse (natural log) and Delta of the step's rows; rows past the sequence get 0 and 0 (their
    // q and dO rows are zero too, so P^T dO and dS^T Q gain nothing from them).
    if (threadIdx.x < 2 * kStepRows) {
      const int index = threadIdx.x % kStepRows;
      const int row = q0 + index;
      const long long stat = (static_cast<long long>(item.batch) * p.num_heads + head) * seq_len +
                             (row < seq_len ? row : 0);
      if (threadIdx.x < kStepRows) {
        CpAsync4(lse_tiles + stage * kStepRows + index, p.lse_in + stat, row < seq_len);
      } else {
        CpAsync4(delta_tiles + stage * kStepRows + index, p.delta + stat, row < seq_len);
      }
    }
  };

  hopper::LoadSwizzledTileAsync<kKeys, kHeadDim, kThreads>(k_tile, k_base, p.ldkv, key0, seq_len,
                                                           threadIdx.x);
  hopper::LoadSwizzledTileAsync<kKeys, kHeadDim, kThreads>(v_tile, v_base, p.ldkv, key0, seq_len,
                                                           threadIdx.x);
  load_step(0, 0);
  CpAsyncCommit();

  const int group = threadIdx.x >> 7;  // warpgroup: keys [key0 + 64 group, +64)
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int group_key0 = key0 + group * kGroupRows;
  const int key_a = group_key0 + warp * 16 + g, key_b = key_a + 8;
  const float ds_factor = p.scaling * p.ds_scale;
  const ScoreTiles score_tiles = ScoreTiles::Of(seq_len, p.window);

  float acc_dk[kHeadDim / 8][4], acc_dv[kHeadDim / 8][4];
  ClearAccumulators(acc_dk);
  ClearAccumulators(acc_dv);

  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    if (step + 1 < steps) load_step(step + 1, stage ^ 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    hopper::FenceProxyAsync();  // cp.async wrote the tiles the tensor cores read next
    __syncthreads();

    const std::uint32_t q_tile = q_tiles + stage * TileBytes(kStepRows);
    const std::uint32_t do_tile = do_tiles + stage * TileBytes(kStepRows);
    const int q0 = (first_q_tile + step % q_tiles_per_head) * kStepRows;
    // Skip a warpgroup whose keys all follow this tile's queries, or all precede the window of
    // its first query.
    if (q0 + kStepRows - 1 >= group_key0 && group_key0 + kGroupRows - 1 >= FirstVisibleKey(p, q0)) {
      // Four groups in flight in turn: S^T, dP^T (P^T computed while dP^T runs), dV += P^T dO
      // (dS^T computed while it runs), dK += dS^T Q.
      float s[kScoreTiles][4], dp[kScoreTiles][4];
      hopper::WgmmaFence();
      ScoreProduct<kKeys>(s, k_tile, group * kGroupRows, q_tile);
      hopper::WgmmaCommit();
      ScoreProduct<kKeys>(dp, v_tile, group * kGroupRows, do_tile);
      hopper::WgmmaCommit();
      hopper::WgmmaWait<1>();
      hopper::FenceAccumulators(s);

      const float* lse_tile = lse_tiles + stage * kStepRows;
      const float* delta_tile = delta_tiles + stage * kStepRows;
      std::uint32_t prob_a[kScoreTiles / 2][4], ds_a[kScoreTiles / 2][4];
      {
        float prob[kScoreTiles][4];
#pragma unroll
        for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int column = n * 8 + 2 * t + (e & 1);
            prob[n][e] = ProbabilityAndWeight<Op>(p, s[n][e], lse_tile[column] * kLog2e, ds_factor,
                                                  /*masked=*/false, s[n][e]);
          }
        }
        // The mask only where it hides some (key, query) pair of this warp's 16 keys and the
        // tile's queries (warp-uniform): P and the weight of a masked pair become 0 (whatever
        // P was computed from its score, inf included).
        const int warp_key0 = group_key0 + warp * 16;
        if (warp_key0 + 15 > q0 || warp_key0 <= q0 + kStepRows - 1 - p.window) {
#pragma unroll
          for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int column = n * 8 + 2 * t + (e & 1);
              if (IsMasked(p, e < 2 ? key_a : key_b, q0 + column)) {
                prob[n][e] = 0.f;
                s[n][e] = 0.f;
              }
            }
          }
        }
        hopper::AccumulatorToOperand(prob, 1.f, prob_a);
      }
      hopper::FenceAccumulators(acc_dv);
      hopper::WgmmaFence();
      OutputProduct(acc_dv, prob_a, do_tile);
      hopper::WgmmaCommit();
      hopper::WgmmaWait<1>();  // dP^T done (dV may still run)
      hopper::FenceAccumulators(dp);
#pragma unroll
      for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dp[n][e] = ScaledGradient<Op, /*kClamp=*/false>(s[n][e], dp[n][e],
                                                          delta_tile[n * 8 + 2 * t + (e & 1)]);
        }
      }
      hopper::AccumulatorToSaturatedOperand(dp, ds_a);  // the fp16 clamp
      if (p.grad_scores != nullptr) {
        // The previous tile's copy has read score_tile (issued a step ago: no wait in practice).
        if (threadIdx.x == 0) hopper::BulkWaitRead<0>();
        __syncthreads();
        StoreScoreTile(ds_a, score_tile);
        hopper::FenceProxyAsync();
        const int head = first_head + step / q_tiles_per_head;
        stored_scores = p.grad_scores + score_tiles.Offset(item.batch, head, p.num_heads,
                                                           q0 / kStepRows, group_key0 / kStepRows);
      }
      hopper::FenceAccumulators(acc_dk);
      hopper::WgmmaFence();
      OutputProduct(acc_dk, ds_a, q_tile);
      hopper::WgmmaCommit();
      hopper::WgmmaWait<0>();
      hopper::FenceOperand(prob_a);
      hopper::FenceOperand(ds_a);
      hopper::FenceAccumulators(acc_dv);
      hopper::FenceAccumulators(acc_dk);
    }
    __syncthreads();  // the stage is free for the load of step + 2
    if (threadIdx.x == 0 && stored_scores != nullptr) {  // this step's dS^T tile, whole
      hopper::BulkCopyToGlobal(stored_scores, score_tile, ScoreTiles::kHalves * 2);
      hopper::BulkCommit();
      stored_scores = nullptr;
    }
  }
  if (threadIdx.x == 0) hopper::BulkWait<0>();

  const int out_ld = p.num_kv_heads * kHeadDim;
  float* grad_k = p.grad_k;
  float* grad_v = p.grad_v;
  if (p.kv_split) {
    const long long per_output = static_cast<long long>(p.batch) * seq_len * out_ld;
    grad_k = p.partials + (static_cast<long long>(item.head % p.group) * 2) * per_output;
    grad_v = grad_k + per_output;
  }
  StoreAccumulatorRowPairs(acc_dk, grad_k, p.inv_ds_scale, acc_dv, grad_v, token0, out_ld,
                           kv_head * kHeadDim, key_a, seq_len);
#else
  __trap();  // launched only on compute capability 9.0, whose code is the sm_90a build
#endif
}

template <int kGroups>
__global__ void __launch_bounds__(kGroups * 128, 2 / kGroups)
    HopperQueryKernel(const AttentionParams p) {
#ifdef ATTNGRAD_HOPPER_WGMMA
  using Layout = HopperQueryLayout<kGroups>;
  constexpr int kThreads = kGroups * 128;
  constexpr int kQueries = Layout::kQueries;
  extern __shared__ unsigned char shared_raw[];
  const std::uint32_t base = SmemAddress(AlignedShared(shared_raw));
  const std::uint32_t q_tile = base + Layout::kQueriesOffset;
  const std::uint32_t do_tile = base + Layout::kGradOutOffset;
  const std::uint32_t k_tiles = base + Layout::kKeysOffset;
  const std::uint32_t v_tiles = base + Layout::kValuesOffset;

  const int seq_len = p.seq_len;
  const int num_q_tiles = (seq_len + kQueries - 1) / kQueries;
  const WorkItem item = DecodeBlock(num_q_tiles, p.num_heads, p.batch, /*heavy_last=*/true);
  const int q0 = item.tile * kQueries;
  const int kv_head = item.head / p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;

  const __half* q_base = static_cast<const __half*>(p.q) + token0 * p.ldq + item.head * kHeadDim;
  const __half* do_base =
      static_cast<const __half*>(p.grad_out) + token0 * p.ldo + item.head * kHeadDim;
  const __half* k_base = static_cast<const __half*>(p.k) + token0 * p.ldkv + kv_head * kHeadDim;
  const __half* v_base = static_cast<const __half*>(p.v) + token0 * p.ldkv + kv_head * kHeadDim;

  // The key tiles the block's queries can see.
  const TileRange key_tiles = BlockRange<kQueries, kStepRows>::KeyTiles(q0, seq_len, p.window);
  const int first_kv_tile = key_tiles.first;
  const int num_kv_tiles = key_tiles.Count();

  hopper::LoadSwizzledTileAsync<kQueries, kHeadDim, kThreads>(q_tile, q_base, p.ldq, q0, seq_len,
                                                              threadIdx.x);
  hopper::LoadSwizzledTileAsync<kQueries, kHeadDim, kThreads>(do_tile, do_base, p.ldo, q0, seq_len,
                                                              threadIdx.x);
  hopper::LoadSwizzledTileAsync<kStepRows, kHeadDim, kThreads>(
      k_tiles, k_base, p.ldkv, first_kv_tile * kStepRows, seq_len, threadIdx.x);
  hopper::LoadSwizzledTileAsync<kStepRows, kHeadDim, kThreads>(
      v_tiles, v_base, p.ldkv, first_kv_tile * kStepRows, seq_len, threadIdx.x);
  CpAsyncCommit();

  const int group = threadIdx.x >> 7;  // warpgroup: queries [q0 + 64 group, +64)
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int group_q0 = q0 + group * kGroupRows;
  const int row_a = group_q0 + warp * 16 + g, row_b = row_a + 8;
  const long long stat0 = (static_cast<long long>(item.batch) * p.num_heads + item.head) * seq_len;
  const RowStatistics rows = LoadRowStatistics(p, stat0, row_a, row_b);
  const float ds_factor = p.scaling * p.ds_scale;

  float acc_dq[kHeadDim / 8][4];
  ClearAccumulators(acc_dq);

  for (int j = 0; j < num_kv_tiles; ++j) {
    const int stage = j & 1;
    if (j + 1 < num_kv_tiles) {
      const int next_key0 = (first_kv_tile + j + 1) * kStepRows;
      hopper::LoadSwizzledTileAsync<kStepRows, kHeadDim, kThreads>(
          k_tiles + (stage ^ 1) * TileBytes(kStepRows), k_base, p.ldkv, next_key0, seq_len,
          threadIdx.x);
      hopper::LoadSwizzledTileAsync<kStepRows, kHeadDim, kThreads>(
          v_tiles + (stage ^ 1) * TileBytes(kStepRows), v_base, p.ldkv, next_key0, seq_len,
          threadIdx.x);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    hopper::FenceProxyAsync();
    __syncthreads();

    const std::uint32_t k_tile = k_tiles + stage * TileBytes(kStepRows);
    const std::uint32_t v_tile = v_tiles + stage * TileBytes(kStepRows);
    const int key0 = (first_kv_tile + j) * kStepRows;
    if (key0 <= group_q0 + kGroupRows - 1 && key0 + kStepRows - 1 >= FirstVisibleKey(p, group_q0)) {
      // S, then dP (the weights w computed from S while dP runs), then dQ += dS K.
      float s[kScoreTiles][4], dp[kScoreTiles][4];
      hopper::WgmmaFence();
      ScoreProduct<kQueries>(s, q_tile, group * kGroupRows, k_tile);
      hopper::WgmmaCommit();
      ScoreProduct<kQueries>(dp, do_tile, group * kGroupRows, v_tile);
      hopper::WgmmaCommit();
      hopper::WgmmaWait<1>();
      hopper::FenceAccumulators(s);
#pragma unroll
      for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ProbabilityAndWeight<Op>(p, s[n][e], e < 2 ? rows.lse_a : rows.lse_b, ds_factor,
                                   /*masked=*/false, s[n][e]);
        }
      }
      // The mask (weight 0) only where it hides some (row, key) pair of this warp's 16 rows and
      // the tile's keys (warp-uniform); keys past the sequence follow every valid row.
      const int warp_row0 = group_q0 + warp * 16;
      if (key0 + kStepRows - 1 > warp_row0 || key0 <= warp_row0 + 15 - p.window) {
#pragma unroll
        for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (IsMasked(p, key0 + n * 8 + 2 * t + (e & 1), e < 2 ? row_a : row_b)) s[n][e] = 0.f;
          }
        }
      }
      hopper::WgmmaWait<0>();
      hopper::FenceAccumulators(dp);
#pragma unroll
      for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dp[n][e] = ScaledGradient<Op, /*kClamp=*/false>(s[n][e], dp[n][e],
                                                          e < 2 ? rows.delta_a : rows.delta_b);
        }
      }
      std::uint32_t ds_a[kScoreTiles / 2][4];
      hopper::AccumulatorToSaturatedOperand(dp, ds_a);  // the fp16 clamp
      hopper::FenceAccumulators(acc_dq);
      hopper::WgmmaFence();
      OutputProduct(acc_dq, ds_a, k_tile);
      hopper::WgmmaCommit();
      hopper::WgmmaWait<0>();
      hopper::FenceOperand(ds_a);
      hopper::FenceAccumulators(acc_dq);
    }
    __syncthreads();
  }

  StoreAccumulatorRows(acc_dq, p.grad_q, token0, p.num_heads * kHeadDim, item.head * kHeadDim,
                       row_a, seq_len, p.inv_ds_scale);
#else
  __trap();
#endif
}

// dQ = dS K from the dS tiles HopperKeyValueKernel stored (AttentionScores::kStored): one block of
// kGroups warpgroups per (64 * kGroups queries, query head, batch); per step of 64 keys the key
// tile and each warpgroup's dS tile (a straight copy of its swizzled image) are loaded with
// cp.async, double-buffered, and dQ += dS K runs on wgmma with both operands MN-major in shared
// memory (dS^T [keys][queries], K [keys][head dim]). Each dQ element is summed in key order.
template <int kGroups>
__global__ void __launch_bounds__(kGroups * 128)
    HopperQueryFromScoresKernel(const AttentionParams p) {
#ifdef ATTNGRAD_HOPPER_WGMMA
  using Layout = HopperScoresQueryLayout<kGroups>;
  constexpr int kThreads = kGroups * 128;
  constexpr int kQueries = Layout::kQueries;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* shared = AlignedShared(shared_raw);
  const std::uint32_t k_tiles = SmemAddress(shared) + Layout::kKeysOffset;
  unsigned char* score_tiles_shared = shared + Layout::kScoresOffset;

  const int seq_len = p.seq_len;
  const int num_q_tiles = (seq_len + kQueries - 1) / kQueries;
  const WorkItem item = DecodeBlock(num_q_tiles, p.num_heads, p.batch, /*heavy_last=*/true);
  const int q0 = item.tile * kQueries;
  const int kv_head = item.head / p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;
  const __half* k_base = static_cast<const __half*>(p.k) + token0 * p.ldkv + kv_head * kHeadDim;
  const ScoreTiles tiles = ScoreTiles::Of(seq_len, p.window);

  const int group = threadIdx.x >> 7;  // warpgroup: queries [q0 + 64 group, +64)
  const int group_thread = threadIdx.x & 127;
  const int group_q_tile = q0 / kStepRows + group;
  const bool group_valid = group_q_tile < tiles.query_tiles;
  const int group_first_tile = tiles.FirstKeyTile(group_q_tile);
  // Key tiles [first_kv_tile, last_kv_tile] cover every warpgroup's.
  const int first_kv_tile = tiles.FirstKeyTile(q0 / kStepRows);
  const int last_kv_tile = min(q0 / kStepRows + kGroups, tiles.query_tiles) - 1;
  const int num_kv_tiles = last_kv_tile - first_kv_tile + 1;
  const __half* group_scores =
      group_valid ? p.grad_scores + tiles.Offset(item.batch, item.head, p.num_heads, group_q_tile,
                                                 group_first_tile)
                  : nullptr;
  auto has_tile = [&](int key_tile) {
    return group_valid && key_tile >= group_first_tile && key_tile <= group_q_tile;
  };
  auto load_step = [&](int j, int stage) {
    const int key_tile = first_kv_tile + j;
    hopper::LoadSwizzledTileAsync<kStepRows, kHeadDim, kThreads>(
        k_tiles + stage * TileBytes(kStepRows), k_base, p.ldkv, key_tile * kStepRows, seq_len,
        threadIdx.x);
    if (has_tile(key_tile)) {  // the image as it is: 16 bytes per cp.async, 4 per thread
      unsigned char* destination =
          score_tiles_shared + (stage * kGroups + group) * Layout::kScoreTileBytes;
      const __half* source =
          group_scores + static_cast<long long>(key_tile - group_first_tile) * ScoreTiles::kHalves;
#pragma unroll
      for (int i = 0; i < Layout::kScoreTileBytes / 16 / 128; ++i) {
        const int chunk = group_thread + i * 128;
        CpAsync16(destination + chunk * 16, source + chunk * 8, true);
      }
    }
  };

  load_step(0, 0);
  CpAsyncCommit();
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row_a = q0 + group * kGroupRows + warp * 16 + (lane >> 2);
  float acc_dq[kHeadDim / 8][4];
  ClearAccumulators(acc_dq);

  for (int j = 0; j < num_kv_tiles; ++j) {
    const int stage = j & 1;
    if (j + 1 < num_kv_tiles) load_step(j + 1, stage ^ 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    hopper::FenceProxyAsync();
    __syncthreads();
    if (has_tile(first_kv_tile + j)) {
      const std::uint32_t k_tile = k_tiles + stage * TileBytes(kStepRows);
      const std::uint32_t ds_tile =
          SmemAddress(score_tiles_shared) + (stage * kGroups + group) * Layout::kScoreTileBytes;
      hopper::FenceAccumulators(acc_dq);
      hopper::WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kStepRows / 16; ++ks) {
        hopper::Wgmma<kHeadDim>::SharedShared<1, 1>(
            acc_dq, hopper::MnMajorDescriptor<kStepRows, ScoreTiles::kRows>(ds_tile, ks),
            hopper::MnMajorDescriptor<kStepRows, kHeadDim>(k_tile, ks), 1);
      }
      hopper::WgmmaCommit();
      hopper::WgmmaWait<0>();
      hopper::FenceAccumulators(acc_dq);
    }
    __syncthreads();  // the stage is free for the load of step j + 2
  }

  StoreAccumulatorRows(acc_dq, p.grad_q, token0, p.num_heads * kHeadDim, item.head * kHeadDim,
                       row_a, seq_len, p.inv_ds_scale);
#else
  __trap();
#endif
}

// Warpgroups per block (measured on the H200: bench/history/ATTENTION_NOTES-log.md): one, so that
// two independent blocks share an SM and one's element-wise work overlaps the other's products.
constexpr int kKeyValueGroups = 1;
constexpr int kQueryGroups = 1;
// HopperQueryFromScoresKernel: two warpgroups share each key tile they load.
constexpr int kScoresQueryGroups = 2;

template <class Kernel>
attngrad_status Launch(Kernel kernel, std::size_t shared_bytes, long long blocks, int threads,
                       const AttentionParams& params, cudaStream_t stream) {
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(shared_bytes)) != cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  kernel<<<static_cast<unsigned>(blocks), threads, shared_bytes, stream>>>(params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace

bool CurrentDeviceIsHopper() {
  int device = 0, major = 0, minor = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
         major == 9 && minor == 0;
}

attngrad_status LaunchHopperKeyValue(const AttentionParams& params, cudaStream_t stream) {
  constexpr int kKeys = HopperKeyValueLayout<kKeyValueGroups>::kKeys;
  const long long blocks = static_cast<long long>((params.seq_len + kKeys - 1) / kKeys) *
                           (params.kv_split ? params.num_heads : params.num_kv_heads) *
                           params.batch;
  return Launch(HopperKeyValueKernel<kKeyValueGroups>,
                HopperKeyValueLayout<kKeyValueGroups>::kSharedBytes, blocks, kKeyValueGroups * 128,
                params, stream);
}

attngrad_status LaunchHopperQuery(const AttentionParams& params, cudaStream_t stream) {
  if (params.grad_scores != nullptr) {
    using Layout = HopperScoresQueryLayout<kScoresQueryGroups>;
    const long long blocks =
        static_cast<long long>((params.seq_len + Layout::kQueries - 1) / Layout::kQueries) *
        params.num_heads * params.batch;
    return Launch(HopperQueryFromScoresKernel<kScoresQueryGroups>, Layout::kSharedBytes, blocks,
                  kScoresQueryGroups * 128, params, stream);
  }
  constexpr int kQueries = HopperQueryLayout<kQueryGroups>::kQueries;
  const long long blocks = static_cast<long long>((params.seq_len + kQueries - 1) / kQueries) *
                           params.num_heads * params.batch;
  return Launch(HopperQueryKernel<kQueryGroups>, HopperQueryLayout<kQueryGroups>::kSharedBytes,
                blocks, kQueryGroups * 128, params, stream);
}

}  // namespace attngrad::cuda::attention_detail
