// SPEC section 2 step 6: the attention backward, flash style and deterministic (no atomics).
//   1. DeltaKernel: Delta = rowsum(dO * O) per row and query head (into the workspace).
//   2. KeyValueGradientKernel: one block per (64-key tile, key-value head, batch) keeps dK and dV
//   of
//      its keys in registers and loops over the query heads of its group and the 32-row query tiles
//      that can see those keys (after the keys, within the sliding window), recomputing S^T = K Q^T
//      and dP^T = V dO^T on tensor cores: dV += P^T dO, dK += dS^T Q. Each dK/dV element is summed
//      in one fixed order.
//   3. QueryGradientKernel: one block per (64-query tile, query head, batch) loops over the visible
//      key tiles (causal, and within the sliding window): dQ += dS K.
// At head_dim 256 a warp's dK and dV (16 keys x 256 each) would take 256 registers per thread, so
// the dK/dV kernel runs as two passes over the same query tiles: dV += P^T dO (from S alone) and
// dK += dS^T Q (from S and dP), each with one 128-register accumulator; both kernels take 32-key
// (dQ) / 32-query (dK/dV) steps, and in the fp32 modes 2-warp blocks, so that the 256-wide fp32
// tiles fit in shared memory (tile sizes: BackwardTiling).
// P = exp(c - lse), dS = P (dP - Delta) (1 - t^2) scaling with t = tanh(s / cap) from the unmasked
// score (masked entries get P = 0, so dS = 0 and nothing is NaN). In the FP16 mode dS is multiplied
// by a power of two (2^ceil(log2 S), sigma) before it is rounded to fp16, and dK, dQ are divided by
// it at the end (exact).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/attention.h"
#include "cuda/attention_common.cuh"

namespace attngrad::cuda {
namespace attention_detail {
namespace {

// Key-value kernel: kWarps warps of 16 keys, 32 query rows per step. Query kernel: kWarps warps of
// 16 query rows, 64 keys per step. 4 warps: 8 warps (one block per SM at ~245 registers) measured
// 10-15% slower on the H200.
// head_dim 256: the tile sizes of the header comment.
constexpr int kBackwardWarps = 4;
constexpr int kKvBlockM = 32;
constexpr int kQBlockN = 64;

template <class Op>
struct BackwardTiling {
  static constexpr bool kWide = Op::kHeadDim > 128;
  static constexpr int kKeyValueWarps = kWide && !Op::kIsFp16 ? 2 : kBackwardWarps;
  static constexpr int kKeyValueQueries = kKvBlockM;
  static constexpr int kQueryWarps = kWide && !Op::kIsFp16 ? 2 : kBackwardWarps;
  static constexpr int kQueryKeys = kWide ? 32 : kQBlockN;
};

// Bytes of the dS tiles the Hopper backward stores (AttentionScores), 0 where it recomputes dS.
// kAuto decides by the causal mask's count, so that a workspace sized without a window (as the
// pipeline's is) serves every window (which never needs more).
std::size_t StoredScoreBytes(const AttentionProblem& problem) {
  if (!HopperBackwardApplies(problem) || IsWholeSequence(ChooseKeyValueTiling(problem)) ||
      problem.scores == AttentionScores::kRecomputed) {
    return 0;
  }
  const auto bytes_with_window = [&problem](int window) {
    return static_cast<std::size_t>(problem.batch) * problem.num_heads *
           ScoreTiles::Of(problem.seq_len, window).PerHead() * ScoreTiles::kHalves * sizeof(__half);
  };
  if (problem.scores == AttentionScores::kAuto &&
      bytes_with_window(problem.seq_len) > kMaxStoredScoreBytes) {
    return 0;
  }
  return bytes_with_window(EffectiveWindow(problem));
}

// Which gradients a dK/dV kernel computes: both (head_dim 128), or one of the two passes (256).
enum class KeyValuePass { kBoth, kValue, kKey };

std::size_t RoundUp256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

std::size_t DeltaBytes(const AttentionProblem& problem) {
  return RoundUp256(static_cast<std::size_t>(problem.batch) * problem.num_heads * problem.seq_len *
                    sizeof(float));
}

std::size_t PartialBytes(const AttentionProblem& problem) {
  if (!IsSplit(ChooseKeyValueTiling(problem))) return 0;
  const int group = problem.num_heads / problem.num_kv_heads;
  return RoundUp256(static_cast<std::size_t>(group) * 2 * problem.batch * problem.seq_len *
                    problem.num_kv_heads * problem.head_dim * sizeof(float));
}

// The tiles of KeyValueGradientKernel in shared memory: the block's keys and values (16 rows per
// warp, held for the whole block), and per step kQueryRows query rows of q and dO with their lse
// and Delta, double-buffered.
template <class Op, int kWarps, int kQueryRows>
struct KeyValueTile {
  using Elem = typename Op::Elem;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeys = 16 * kWarps;
  static constexpr int kQueries = kQueryRows;
  static constexpr int kScoreTiles = kQueries / 8;  // n-tiles (queries) of S^T per warp
  static constexpr std::size_t kSharedBytes =
      static_cast<std::size_t>(2 * kKeys + 4 * kQueries) * Op::kPitch * sizeof(Elem) +
      4 * kQueries * sizeof(float);

  Elem* keys;      // [kKeys][kPitch]
  Elem* values;    // [kKeys][kPitch]
  Elem* queries;   // [2][kQueries][kPitch]
  Elem* grad_out;  // [2][kQueries][kPitch]
  float* lse;      // [2][kQueries], log2 units
  float* delta;    // [2][kQueries]
  __device__ explicit KeyValueTile(unsigned char* shared)
      : keys(reinterpret_cast<Elem*>(shared)),
        values(keys + kKeys * Op::kPitch),
        queries(values + kKeys * Op::kPitch),
        grad_out(queries + 2 * kQueries * Op::kPitch),
        lse(reinterpret_cast<float*>(grad_out + 2 * kQueries * Op::kPitch)),
        delta(lse + 2 * kQueries) {}
};

// The tiles of QueryGradientKernel in shared memory: the block's query rows of q and dO (16 per
// warp), and kKeyRows keys and values per step, double-buffered.
template <class Op, int kWarps, int kKeyRows>
struct QueryTile {
  using Elem = typename Op::Elem;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kQueries = 16 * kWarps;
  static constexpr int kKeys = kKeyRows;
  static constexpr int kScoreTiles = kKeys / 8;  // n-tiles (keys) of S per warp
  static constexpr std::size_t kSharedBytes =
      static_cast<std::size_t>(2 * kQueries + 4 * kKeys) * Op::kPitch * sizeof(Elem);

  Elem* queries;   // [kQueries][kPitch]
  Elem* grad_out;  // [kQueries][kPitch]
  Elem* keys;      // [2][kKeys][kPitch]
  Elem* values;    // [2][kKeys][kPitch]
  __device__ explicit QueryTile(unsigned char* shared)
      : queries(reinterpret_cast<Elem*>(shared)),
        grad_out(queries + kQueries * Op::kPitch),
        keys(grad_out + kQueries * Op::kPitch),
        values(keys + 2 * kKeys * Op::kPitch) {}
};

// Split mode: dK, dV = the sum over the query heads of each group of the partials, in head order.
__global__ void __launch_bounds__(256) SumPartialsKernel(const AttentionParams p) {
  const long long per_output =
      static_cast<long long>(p.batch) * p.seq_len * p.num_kv_heads * p.head_dim / 4;  // float4s
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= 2 * per_output) return;
  const int which = static_cast<int>(index / per_output);  // 0: dK, 1: dV
  const long long element = index % per_output;
  const float4* partials = reinterpret_cast<const float4*>(p.partials);
  float4 sum = partials[(0 * 2 + which) * per_output + element];
  for (int r = 1; r < p.group; ++r) {
    const float4 v = partials[(static_cast<long long>(r) * 2 + which) * per_output + element];
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  reinterpret_cast<float4*>(which == 0 ? p.grad_k : p.grad_v)[element] = sum;
}

// One warp per (token, query head); lane l holds elements 4l..4l+3 of each 128 columns.
template <class Op>
__global__ void __launch_bounds__(256) DeltaKernel(const AttentionParams p) {
  using Elem = typename Op::Elem;
  constexpr int kD = Op::kHeadDim;
  const long long warp_index = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long total = static_cast<long long>(p.batch) * p.seq_len * p.num_heads;
  if (warp_index >= total) return;
  const int lane = threadIdx.x & 31;
  const long long token = warp_index / p.num_heads;
  const int head = static_cast<int>(warp_index % p.num_heads);
  const Elem* grad_out =
      static_cast<const Elem*>(p.grad_out) + token * p.ldo + head * kD + lane * 4;
  const float* out = p.out_in + token * (p.num_heads * kD) + head * kD + lane * 4;
  float sum = 0.f;
#pragma unroll
  for (int chunk = 0; chunk < kD / 128; ++chunk) {
    const float4 o = *reinterpret_cast<const float4*>(out + chunk * 128);
    const float2 low = LoadGradOutPair<Op>(grad_out + chunk * 128);
    const float2 high = LoadGradOutPair<Op>(grad_out + chunk * 128 + 2);
    const float d0 = low.x, d1 = low.y, d2 = high.x, d3 = high.y;
    const float part = fmaf(d0, o.x, fmaf(d1, o.y, fmaf(d2, o.z, d3 * o.w)));
    sum = chunk == 0 ? part : sum + part;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    const long long batch = token / p.seq_len, position = token % p.seq_len;
    p.delta[(batch * p.num_heads + head) * p.seq_len + position] = sum;
  }
}

template <class Op, int kWarps, int kQueryRows, KeyValuePass kPass>
__global__ void __launch_bounds__(kWarps * 32) KeyValueGradientKernel(const AttentionParams p) {
  using Elem = typename Op::Elem;
  using Tile = KeyValueTile<Op, kWarps, kQueryRows>;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kBN = Tile::kKeys, kBM = Tile::kQueries, kP = Op::kPitch;
  constexpr int kNT = Tile::kScoreTiles;
  constexpr int kD = Op::kHeadDim;
  constexpr bool kWantKey = kPass != KeyValuePass::kValue;  // dK (needs dP: V and dO)
  constexpr bool kWantValue = kPass != KeyValuePass::kKey;  // dV
  constexpr int kKeyTiles = kWantKey ? kD / 8 : 1;          // accumulator tiles (1: unused)
  constexpr int kValueTiles = kWantValue ? kD / 8 : 1;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const Tile tile(shared_raw);
  Elem* k_tile = tile.keys;
  Elem* v_tile = tile.values;
  Elem* q_tiles = tile.queries;
  Elem* do_tiles = tile.grad_out;
  float* lse_tiles = tile.lse;
  float* delta_tiles = tile.delta;

  const int seq_len = p.seq_len;
  const int num_kv_tiles = (seq_len + kBN - 1) / kBN;
  // Split mode: one block per (key tile, query head); else per (key tile, key-value head).
  const WorkItem item = DecodeBlock(num_kv_tiles, p.kv_split ? p.num_heads : p.num_kv_heads,
                                    p.batch, /*heavy_last=*/false);
  const int key0 = item.tile * kBN;
  const int kv_head = p.kv_split ? item.head / p.group : item.head;
  const int first_head = p.kv_split ? item.head : kv_head * p.group;
  const int num_block_heads = p.kv_split ? 1 : p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;

  const Elem* k_base = static_cast<const Elem*>(p.k) + token0 * p.ldkv + kv_head * kD;
  const Elem* v_base = static_cast<const Elem*>(p.v) + token0 * p.ldkv + kv_head * kD;
  const Elem* q_base0 = static_cast<const Elem*>(p.q) + token0 * p.ldq;
  const Elem* do_base0 = static_cast<const Elem*>(p.grad_out) + token0 * p.ldo;

  // The query tiles that can see this block's keys (up to the sliding window's end; seq_len for
  // full causal attention).
  const TileRange query_tiles = BlockRange<kBM, kBN>::QueryTiles(key0, seq_len, p.window);
  const int first_q_tile = query_tiles.first;
  const int q_tiles_per_head = query_tiles.Count();
  const int steps = num_block_heads * q_tiles_per_head;

  auto load_step = [&](int step, int stage) {
    const int head = first_head + step / q_tiles_per_head;
    const int q0 = (first_q_tile + step % q_tiles_per_head) * kBM;
    LoadTileAsync<Op, kBM, kThreads>(q_tiles + stage * kBM * kP, q_base0 + head * kD, p.ldq, q0,
                                     seq_len);
    LoadTileAsync<Op, kBM, kThreads>(do_tiles + stage * kBM * kP, do_base0 + head * kD, p.ldo, q0,
                                     seq_len);
    if (threadIdx.x < kBM) {
      const int row = q0 + threadIdx.x;
      const long long stat =
          (static_cast<long long>(item.batch) * p.num_heads + head) * seq_len + row;
      lse_tiles[stage * kBM + threadIdx.x] = row < seq_len ? p.lse_in[stat] * kLog2e : INFINITY;
      delta_tiles[stage * kBM + threadIdx.x] = row < seq_len ? p.delta[stat] : 0.f;
    }
  };

  LoadTileAsync<Op, kBN, kThreads>(k_tile, k_base, p.ldkv, key0, seq_len);
  if constexpr (kWantKey) LoadTileAsync<Op, kBN, kThreads>(v_tile, v_base, p.ldkv, key0, seq_len);
  load_step(0, 0);
  CpAsyncCommit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int key_a = key0 + warp * 16 + g, key_b = key_a + 8;
  const float ds_factor = p.scaling * p.ds_scale;

  float acc_dk[kKeyTiles][4], acc_dv[kValueTiles][4];
  ClearAccumulators(acc_dk);
  ClearAccumulators(acc_dv);

  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    if (step + 1 < steps) load_step(step + 1, stage ^ 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    Elem* q_tile = q_tiles + stage * kBM * kP;
    Elem* do_tile = do_tiles + stage * kBM * kP;
    if (step == 0) {
      RoundTileTf32<Op, kBN, kThreads>(k_tile);
      if constexpr (kWantKey) RoundTileTf32<Op, kBN, kThreads>(v_tile);
    }
    RoundTileTf32<Op, kBM, kThreads>(q_tile);
    RoundTileTf32<Op, kBM, kThreads>(do_tile);
    __syncthreads();

    const int q0 = (first_q_tile + step % q_tiles_per_head) * kBM;
    // Skip a warp whose keys all follow this tile's queries, or whose keys are all before the
    // window of the tile's first query (fully masked for it).
    if (q0 + kBM - 1 >= key0 + warp * 16 && key0 + warp * 16 + 15 >= FirstVisibleKey(p, q0)) {
      float s[kNT][4], dp[kNT][4];
      ClearAccumulators(s);
      ClearAccumulators(dp);
      WarpProductNk<Op, kNT>(s, k_tile, warp * 16, q_tile);
      if constexpr (kWantKey) WarpProductNk<Op, kNT>(dp, v_tile, warp * 16, do_tile);
      const float* lse_tile = lse_tiles + stage * kBM;
      const float* delta_tile = delta_tiles + stage * kBM;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int column = n * 8 + 2 * t + (e & 1);
          const int key = e < 2 ? key_a : key_b;
          float ds;
          s[n][e] = SoftmaxGradient<Op>(p, s[n][e], dp[n][e], lse_tile[column], delta_tile[column],
                                        ds_factor, IsMasked(p, key, q0 + column), ds);
          dp[n][e] = ds;
        }
      }
      if constexpr (kPass == KeyValuePass::kBoth) {
        AccumulatorA<Op, kNT> prob_a, ds_a;
        AccumulatorToA<Op, kNT>(s, 1.f, prob_a);
        AccumulatorToA<Op, kNT>(dp, 1.f, ds_a);
        WarpProductKn<Op, kNT>(acc_dv, prob_a, do_tile);
        WarpProductKn<Op, kNT>(acc_dk, ds_a, q_tile);
      } else if constexpr (kPass == KeyValuePass::kValue) {
        AccumulatorA<Op, kNT> prob_a;
        AccumulatorToA<Op, kNT>(s, 1.f, prob_a);
        WarpProductKn<Op, kNT>(acc_dv, prob_a, do_tile);
      } else {
        AccumulatorA<Op, kNT> ds_a;
        AccumulatorToA<Op, kNT>(dp, 1.f, ds_a);
        WarpProductKn<Op, kNT>(acc_dk, ds_a, q_tile);
      }
    }
    __syncthreads();
  }

  const int out_ld = p.num_kv_heads * kD;
  float* grad_k = p.grad_k;
  float* grad_v = p.grad_v;
  if (p.kv_split) {
    const long long per_output = static_cast<long long>(p.batch) * seq_len * out_ld;
    grad_k = p.partials + (static_cast<long long>(item.head % p.group) * 2) * per_output;
    grad_v = grad_k + per_output;
  }
  if constexpr (kPass == KeyValuePass::kBoth) {
    StoreAccumulatorRowPairs(acc_dk, grad_k, p.inv_ds_scale, acc_dv, grad_v, token0, out_ld,
                             kv_head * kD, key_a, seq_len);
  } else if constexpr (kPass == KeyValuePass::kValue) {
    StoreAccumulatorRows(acc_dv, grad_v, token0, out_ld, kv_head * kD, key_a, seq_len, 1.f);
  } else {
    StoreAccumulatorRows(acc_dk, grad_k, token0, out_ld, kv_head * kD, key_a, seq_len,
                         p.inv_ds_scale);
  }
}

template <class Op, int kWarps, int kKeyRows>
__global__ void __launch_bounds__(kWarps * 32) QueryGradientKernel(const AttentionParams p) {
  using Elem = typename Op::Elem;
  using Tile = QueryTile<Op, kWarps, kKeyRows>;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kBM = Tile::kQueries, kBN = Tile::kKeys, kP = Op::kPitch;
  constexpr int kNT = Tile::kScoreTiles;
  constexpr int kD = Op::kHeadDim;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const Tile tile(shared_raw);
  Elem* q_tile = tile.queries;
  Elem* do_tile = tile.grad_out;
  Elem* k_tiles = tile.keys;
  Elem* v_tiles = tile.values;

  const int seq_len = p.seq_len;
  const int num_q_tiles = (seq_len + kBM - 1) / kBM;
  const WorkItem item = DecodeBlock(num_q_tiles, p.num_heads, p.batch, /*heavy_last=*/true);
  const int q0 = item.tile * kBM;
  const int kv_head = item.head / p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;

  const Elem* q_base = static_cast<const Elem*>(p.q) + token0 * p.ldq + item.head * kD;
  const Elem* do_base = static_cast<const Elem*>(p.grad_out) + token0 * p.ldo + item.head * kD;
  const Elem* k_base = static_cast<const Elem*>(p.k) + token0 * p.ldkv + kv_head * kD;
  const Elem* v_base = static_cast<const Elem*>(p.v) + token0 * p.ldkv + kv_head * kD;

  // The key tiles this tile's rows can see.
  const TileRange key_tiles = BlockRange<kBM, kBN>::KeyTiles(q0, seq_len, p.window);
  const int first_kv_tile = key_tiles.first;
  const int num_kv_tiles = key_tiles.Count();

  LoadTileAsync<Op, kBM, kThreads>(q_tile, q_base, p.ldq, q0, seq_len);
  LoadTileAsync<Op, kBM, kThreads>(do_tile, do_base, p.ldo, q0, seq_len);
  LoadTileAsync<Op, kBN, kThreads>(k_tiles, k_base, p.ldkv, first_kv_tile * kBN, seq_len);
  LoadTileAsync<Op, kBN, kThreads>(v_tiles, v_base, p.ldkv, first_kv_tile * kBN, seq_len);
  CpAsyncCommit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const long long stat0 = (static_cast<long long>(item.batch) * p.num_heads + item.head) * seq_len;
  const RowStatistics rows = LoadRowStatistics(p, stat0, row_a, row_b);
  const float ds_factor = p.scaling * p.ds_scale;

  float acc_dq[kD / 8][4];
  ClearAccumulators(acc_dq);

  for (int j = 0; j < num_kv_tiles; ++j) {
    const int stage = j & 1;
    if (j + 1 < num_kv_tiles) {
      const int next_key0 = (first_kv_tile + j + 1) * kBN;
      LoadTileAsync<Op, kBN, kThreads>(k_tiles + (stage ^ 1) * kBN * kP, k_base, p.ldkv, next_key0,
                                       seq_len);
      LoadTileAsync<Op, kBN, kThreads>(v_tiles + (stage ^ 1) * kBN * kP, v_base, p.ldkv, next_key0,
                                       seq_len);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    Elem* k_tile = k_tiles + stage * kBN * kP;
    Elem* v_tile = v_tiles + stage * kBN * kP;
    if (j == 0) {
      RoundTileTf32<Op, kBM, kThreads>(q_tile);
      RoundTileTf32<Op, kBM, kThreads>(do_tile);
    }
    RoundTileTf32<Op, kBN, kThreads>(k_tile);
    RoundTileTf32<Op, kBN, kThreads>(v_tile);
    __syncthreads();

    const int key0 = (first_kv_tile + j) * kBN;
    if (key0 <= q0 + warp * 16 + 15 && key0 + kBN - 1 >= FirstVisibleKey(p, q0 + warp * 16)) {
      QueryGradientStep<Op, kNT>(p, q_tile, do_tile, warp * 16, k_tile, v_tile, key0, row_a, row_b,
                                 t, rows, ds_factor, acc_dq);
    }
    __syncthreads();
  }

  StoreAccumulatorRows(acc_dq, p.grad_q, token0, p.num_heads * kD, item.head * kD, row_a, seq_len,
                       p.inv_ds_scale);
}

template <class Kernel>
attngrad_status SetSharedBytes(Kernel kernel, std::size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes)) == cudaSuccess
             ? ATTNGRAD_OK
             : ATTNGRAD_CUDA_ERROR;
}

template <class Op, int kWarps, int kQueryRows, KeyValuePass kPass>
attngrad_status LaunchKeyValue(const AttentionParams& params, cudaStream_t stream) {
  constexpr std::size_t kShared = KeyValueTile<Op, kWarps, kQueryRows>::kSharedBytes;
  const auto kernel = KeyValueGradientKernel<Op, kWarps, kQueryRows, kPass>;
  if (SetSharedBytes(kernel, kShared) != ATTNGRAD_OK) {
    return ATTNGRAD_CUDA_ERROR;
  }
  const long long blocks =
      static_cast<long long>((params.seq_len + 16 * kWarps - 1) / (16 * kWarps)) *
      (params.kv_split ? params.num_heads : params.num_kv_heads) * params.batch;
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  kernel<<<static_cast<unsigned>(blocks), kWarps * 32, kShared, stream>>>(params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

template <class Op, int kWarps, int kKeyRows>
attngrad_status LaunchQuery(const AttentionParams& params, cudaStream_t stream) {
  constexpr std::size_t kShared = QueryTile<Op, kWarps, kKeyRows>::kSharedBytes;
  const auto kernel = QueryGradientKernel<Op, kWarps, kKeyRows>;
  if (SetSharedBytes(kernel, kShared) != ATTNGRAD_OK) {
    return ATTNGRAD_CUDA_ERROR;
  }
  const long long blocks =
      static_cast<long long>((params.seq_len + 16 * kWarps - 1) / (16 * kWarps)) *
      params.num_heads * params.batch;
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  kernel<<<static_cast<unsigned>(blocks), kWarps * 32, kShared, stream>>>(params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

// hopper: the dK/dV and dQ kernels of attention_backward_hopper.cu (wgmma) instead of these.
// short_sequence: the short-sequence kernel (its grid form when `grid`) writes dQ, dK and dV.
template <class Op>
attngrad_status LaunchBackward(const AttentionParams& params, bool short_sequence, bool delta_ready,
                               AttentionBackwardPart part, cudaStream_t stream, bool hopper = false,
                               bool grid = false) {
  const long long rows = static_cast<long long>(params.batch) * params.seq_len * params.num_heads;
  const long long delta_blocks = (rows * 32 + 255) / 256;
  const long long sum_float4s = 2 * static_cast<long long>(params.batch) * params.seq_len *
                                params.num_kv_heads * (Op::kHeadDim / 4);
  const long long sum_blocks = (sum_float4s + 255) / 256;
  if (delta_blocks > 0x7fffffffLL || sum_blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  if (part != AttentionBackwardPart::kQuery) {
    if (!delta_ready) {
      DeltaKernel<Op><<<static_cast<unsigned>(delta_blocks), 256, 0, stream>>>(params);
      if (cudaGetLastError() != cudaSuccess) return ATTNGRAD_CUDA_ERROR;
    }
    using Tiling = BackwardTiling<Op>;
    constexpr int kWarps = Tiling::kKeyValueWarps, kRows = Tiling::kKeyValueQueries;
    attngrad_status status = ATTNGRAD_OK;
    if (short_sequence) {
      status = grid ? LaunchShortGridBackward(params, stream)
                    : LaunchShortSequenceBackward(params, stream);
    } else if (hopper) {
      status = LaunchHopperKeyValue(params, stream);
      // dQ from the dS the dK/dV kernel just stored belongs to this half.
      if (status == ATTNGRAD_OK && params.grad_scores != nullptr) {
        status = LaunchHopperQuery(params, stream);
      }
    } else if constexpr (Tiling::kWide) {
      status = LaunchKeyValue<Op, kWarps, kRows, KeyValuePass::kValue>(params, stream);
      if (status == ATTNGRAD_OK) {
        status = LaunchKeyValue<Op, kWarps, kRows, KeyValuePass::kKey>(params, stream);
      }
    } else {
      status = LaunchKeyValue<Op, kWarps, kRows, KeyValuePass::kBoth>(params, stream);
    }
    if (status != ATTNGRAD_OK) return status;
    if (params.kv_split) {
      SumPartialsKernel<<<static_cast<unsigned>(sum_blocks), 256, 0, stream>>>(params);
      if (cudaGetLastError() != cudaSuccess) return ATTNGRAD_CUDA_ERROR;
    }
  }
  // The short-sequence kernel wrote dQ too, and so did the dK/dV half with dS stored.
  if (short_sequence || part == AttentionBackwardPart::kKeyValue ||
      (hopper && params.grad_scores != nullptr)) {
    return ATTNGRAD_OK;
  }
  if (hopper) return LaunchHopperQuery(params, stream);
  return LaunchQuery<Op, BackwardTiling<Op>::kQueryWarps, BackwardTiling<Op>::kQueryKeys>(params,
                                                                                          stream);
}

}  // namespace
}  // namespace attention_detail

std::size_t AttentionBackwardWorkspaceSize(const AttentionProblem& problem) {
  if (problem.batch < 1 || problem.seq_len < 1 || problem.num_heads < 1) return 0;
  if (problem.num_kv_heads < 1 || problem.num_heads % problem.num_kv_heads != 0) return 0;
  if (problem.head_dim != 128 && problem.head_dim != 256) return 0;
  return attention_detail::DeltaBytes(problem) + attention_detail::PartialBytes(problem) +
         attention_detail::StoredScoreBytes(problem);
}

attngrad_status AttentionBackward(const AttentionProblem& problem, const void* q, int ldq,
                                  const void* k, const void* v, int ldkv, const float* out,
                                  const void* grad_out, int ldo, const float* lse, float* grad_q,
                                  float* grad_k, float* grad_v, void* workspace,
                                  std::size_t workspace_size, cudaStream_t stream, bool delta_ready,
                                  AttentionBackwardPart part) {
  using namespace attention_detail;
  AttentionParams params;
  attngrad_status status = MakeParams(problem, q, ldq, k, v, ldkv, &params);
  if (status != ATTNGRAD_OK) return status;
  const int per_16_bytes = 16 / ElementBytes(problem.operand);
  if ((out == nullptr && !delta_ready) || lse == nullptr || grad_out == nullptr ||
      grad_q == nullptr || grad_k == nullptr || grad_v == nullptr || !Aligned16(out) ||
      !Aligned16(grad_out) || !Aligned16(grad_q) || !Aligned16(grad_k) || !Aligned16(grad_v) ||
      ldo < problem.num_heads * problem.head_dim || ldo % per_16_bytes != 0) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  const std::size_t score_bytes = StoredScoreBytes(problem);
  if (workspace_size < DeltaBytes(problem) + PartialBytes(problem) + score_bytes) {
    return ATTNGRAD_WORKSPACE_TOO_SMALL;
  }
  if (workspace == nullptr || !Aligned16(workspace)) return ATTNGRAD_INVALID_ARGUMENT;
  if (part == AttentionBackwardPart::kQuery && !delta_ready) return ATTNGRAD_INVALID_ARGUMENT;
  params.grad_out = grad_out;
  params.ldo = ldo;
  params.out_in = out;
  params.lse_in = lse;
  params.delta =
      static_cast<float*>(workspace);  // first in the workspace (FusedDelta relies on it)
  params.grad_q = grad_q;
  params.grad_k = grad_k;
  params.grad_v = grad_v;
  const KeyValueTiling tiling = ChooseKeyValueTiling(problem);
  params.kv_split = IsSplit(tiling);
  const bool short_sequence = IsWholeSequence(tiling);
  const bool grid = tiling == KeyValueTiling::kGrid || tiling == KeyValueTiling::kGridSplit;
  if (params.kv_split) {
    params.partials =
        reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + DeltaBytes(problem));
  }
  if (score_bytes > 0) {
    params.grad_scores = reinterpret_cast<__half*>(static_cast<unsigned char*>(workspace) +
                                                   DeltaBytes(problem) + PartialBytes(problem));
  }
  if (problem.operand == AttentionOperand::kFp16) {
    int exponent = 0;
    while ((1 << exponent) < problem.seq_len && exponent < 30) ++exponent;
    params.ds_scale = std::ldexp(1.f, exponent);
    params.inv_ds_scale = std::ldexp(1.f, -exponent);
  }
  const bool wide = problem.head_dim == 256;  // the short-sequence kernel is 128-only
  switch (problem.operand) {
    case AttentionOperand::kFp16:
      return wide ? LaunchBackward<Fp16Operand<256>>(params, false, delta_ready, part, stream)
                  : LaunchBackward<OpFp16>(params, short_sequence, delta_ready, part, stream,
                                           !short_sequence && HopperBackwardApplies(problem), grid);
    case AttentionOperand::kTf32:
      return wide ? LaunchBackward<Tf32Operand<256>>(params, false, delta_ready, part, stream)
                  : LaunchBackward<OpTf32>(params, false, delta_ready, part, stream);
    case AttentionOperand::kFp32:
      return wide ? LaunchBackward<Fp32Operand<256>>(params, false, delta_ready, part, stream)
                  : LaunchBackward<OpFp32>(params, false, delta_ready, part, stream);
  }
  return ATTNGRAD_INVALID_ARGUMENT;
}

}  // namespace attngrad::cuda
