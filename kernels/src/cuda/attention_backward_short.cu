// SPEC section 2 step 6 for short sequences (S <= 256, fp16 operands): the attention backward with
// the whole sequence of one head in one block, so that each S x S product is computed once (5
// products instead of the 7 of the tiled kernels in attention_backward.cu) and in one launch.
//
// One block of 8 warps per (batch, key-value head), looping over the 3 query heads of its group, or
// per (batch, query head) when that gives too few blocks ("split": dK/dV partials per query head,
// summed over the group in head order by attention_backward.cu's SumPartialsKernel). For each query
// head and each chunk of 128 queries:
//   phase 1 (warp = 16 queries): for each 128-key block at or before the chunk, S = Q K^T and
//     dP = dO V^T in registers, P = exp(c - lse), dS = P (dP - Delta) (1 - t^2) scaling; dQ += dS
//     K. P and dS (fp16) are then staged in shared memory over the V and K rows of that key block
//     (no longer needed by this chunk). dQ of the chunk is complete: written once.
//   phase 2 (warp = 16 keys): dV += P^T dO and dK += dS^T Q from the staged tiles (transposed with
//     ldmatrix.trans), added to the block's own rows of dK/dV in global memory in a fixed order
//     (query head, then chunk): deterministic, no atomics.
// With a sliding window, key blocks before a warp's window are not computed (P = dS = 0 staged) and
// key rows before a chunk's window are skipped in phase 2.
// Delta = rowsum(dO * O) comes from DeltaKernel, lse from the forward; dS carries the power-of-two
// scale of the FP16 mode (attention_params.cuh), removed from dK and dQ on output.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/attention.h"
#include "cuda/attention_common.cuh"

namespace attngrad::cuda::attention_detail {
namespace {

using Op = OpFp16;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16 * kWarps;  // queries per chunk (phase 1: one warp per 16)
constexpr int kKeyBlock = 128;       // keys per phase-1 product
constexpr int kPitch = Op::kPitch;
constexpr int kHeadDim = Op::kHeadDim;  // 128 only

// The tiles of ShortSequenceBackwardKernel in shared memory: one chunk of queries of q and dO, and
// every key and value of the sequence; after phase 1 of a chunk the key and value rows of each key
// block hold that block's dS and P instead.
struct ShortSequenceTile {
  static constexpr std::size_t kSharedBytes =
      static_cast<std::size_t>(2 * kChunk + 2 * kShortSequenceMaxLength) * kPitch * sizeof(__half);

  __half* queries;   // [kChunk][kPitch]
  __half* grad_out;  // [kChunk][kPitch]
  __half* keys;      // [256][kPitch]; then dS
  __half* values;    // [256][kPitch]; then P
  __device__ explicit ShortSequenceTile(unsigned char* shared)
      : queries(reinterpret_cast<__half*>(shared)),
        grad_out(queries + kChunk * kPitch),
        keys(grad_out + kChunk * kPitch),
        values(keys + kShortSequenceMaxLength * kPitch) {}
};
constexpr std::size_t kSharedBytes = ShortSequenceTile::kSharedBytes;

// A fragment of rows [row0, row0 + 16) and k-step k0 of A = T^T, where `tile` holds T stored
// [k][row] (the staged P or dS, [query][key], read as [key][query]).
__device__ __forceinline__ void LoadATransposed(std::uint32_t (&a)[4], const __half* tile, int row0,
                                                int k0) {
  const int lane = threadIdx.x & 31;
  const int mi = lane >> 3, r = lane & 7;
  const __half* address = tile + (k0 + (mi >> 1) * 8 + r) * kPitch + row0 + (mi & 1) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(SmemAddress(address)));
}

// Writes the 16 rows of a warp's A fragments (16 x 128, fp16) into a staging tile [row][col].
__device__ __forceinline__ void StoreFragments(const AccumulatorA<Op, 16>& a, __half* tile,
                                               int row0) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  __half* upper = tile + (row0 + g) * kPitch + 2 * t;
  __half* lower = upper + 8 * kPitch;
#pragma unroll
  for (int kk = 0; kk < AccumulatorA<Op, 16>::kSteps; ++kk) {
    *reinterpret_cast<std::uint32_t*>(upper + 16 * kk) = a.a[kk][0];
    *reinterpret_cast<std::uint32_t*>(lower + 16 * kk) = a.a[kk][1];
    *reinterpret_cast<std::uint32_t*>(upper + 16 * kk + 8) = a.a[kk][2];
    *reinterpret_cast<std::uint32_t*>(lower + 16 * kk + 8) = a.a[kk][3];
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    ShortSequenceBackwardKernel(const AttentionParams p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const ShortSequenceTile tile(shared_raw);
  __half* q_tile = tile.queries;
  __half* do_tile = tile.grad_out;
  __half* k_tile = tile.keys;
  __half* v_tile = tile.values;

  const int seq_len = p.seq_len;
  const int slots = p.kv_split ? p.num_heads : p.num_kv_heads;
  const int slot = static_cast<int>(blockIdx.x) % slots;
  const int batch = static_cast<int>(blockIdx.x) / slots;
  const int kv_head = p.kv_split ? slot / p.group : slot;
  const int first_head = p.kv_split ? slot : slot * p.group;
  const int block_heads = p.kv_split ? 1 : p.group;
  const long long token0 = static_cast<long long>(batch) * seq_len;
  const int num_chunks = (seq_len + kChunk - 1) / kChunk;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const float ds_factor = p.scaling * p.ds_scale;

  const int kv_ld = p.num_kv_heads * kHeadDim;
  float* grad_k = p.grad_k;
  float* grad_v = p.grad_v;
  if (p.kv_split) {
    const long long per_output = static_cast<long long>(p.batch) * seq_len * kv_ld;
    grad_k = p.partials + static_cast<long long>(slot % p.group) * 2 * per_output;
    grad_v = grad_k + per_output;
  }
  const __half* k_base = static_cast<const __half*>(p.k) + token0 * p.ldkv + kv_head * kHeadDim;
  const __half* v_base = static_cast<const __half*>(p.v) + token0 * p.ldkv + kv_head * kHeadDim;

  for (int head_index = 0; head_index < block_heads; ++head_index) {
    const int head = first_head + head_index;
    const __half* q_base = static_cast<const __half*>(p.q) + token0 * p.ldq + head * kHeadDim;
    const __half* do_base =
        static_cast<const __half*>(p.grad_out) + token0 * p.ldo + head * kHeadDim;
    const long long stat0 = (static_cast<long long>(batch) * p.num_heads + head) * seq_len;

    for (int chunk = 0; chunk < num_chunks; ++chunk) {
      const int q0 = chunk * kChunk;
      const int chunk_rows = min(kChunk, seq_len - q0);
      const int key_end = q0 + chunk_rows;  // keys [0, key_end) are visible to the chunk
      const int key_blocks = (key_end + kKeyBlock - 1) / kKeyBlock;

      // Every read of the previous chunk's tiles ended at its closing barrier.
      LoadTileAsync<Op, kChunk, kThreads>(q_tile, q_base, p.ldq, q0, seq_len);
      LoadTileAsync<Op, kChunk, kThreads>(do_tile, do_base, p.ldo, q0, seq_len);
      for (int block = 0; block < key_blocks; ++block) {
        LoadTileAsync<Op, kKeyBlock, kThreads>(k_tile + block * kKeyBlock * kPitch, k_base, p.ldkv,
                                               block * kKeyBlock, seq_len);
        LoadTileAsync<Op, kKeyBlock, kThreads>(v_tile + block * kKeyBlock * kPitch, v_base, p.ldkv,
                                               block * kKeyBlock, seq_len);
      }
      CpAsyncCommit();
      CpAsyncWait<0>();
      __syncthreads();

      // ---- Phase 1: this warp's 16 queries against every visible key block ----
      const int warp_row0 = warp * 16;  // within the chunk
      const int row_a = q0 + warp_row0 + g, row_b = row_a + 8;
      const RowStatistics rows = LoadRowStatistics(p, stat0, row_a, row_b);
      float acc_dq[16][4];
      ClearAccumulators(acc_dq);

      for (int block = 0; block < key_blocks; ++block) {
        const int key0 = block * kKeyBlock;
        __half* k_block = k_tile + block * kKeyBlock * kPitch;
        __half* v_block = v_tile + block * kKeyBlock * kPitch;
        // Keys of this block this warp's queries can see: [key0, q0 + warp_row0 + 16), and none
        // when the whole block precedes the window of the warp's first query. A block skipped
        // this way stages zeros (phase 2 adds nothing from it).
        const int visible = min(kKeyBlock, q0 + warp_row0 + 16 - key0);
        const bool active = warp_row0 < chunk_rows && visible > 0 &&
                            key0 + kKeyBlock - 1 >= FirstVisibleKey(p, q0 + warp_row0);
        AccumulatorA<Op, 16> prob_a, ds_a;
        if (active) {
          float s[16][4], dp[16][4];
          ClearAccumulators(s);
          ClearAccumulators(dp);
          WarpProductNk<Op, 16>(s, q_tile, warp_row0, k_block, visible);
          WarpProductNk<Op, 16>(dp, do_tile, warp_row0, v_block, visible);
#pragma unroll
          for (int n = 0; n < 16; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = key0 + n * 8 + 2 * t + (e & 1);
              const int row = e < 2 ? row_a : row_b;
              // key > row also masks every key >= seq_len of a valid row.
              float ds;
              s[n][e] = SoftmaxGradient<Op>(p, s[n][e], dp[n][e], e < 2 ? rows.lse_a : rows.lse_b,
                                            e < 2 ? rows.delta_a : rows.delta_b, ds_factor,
                                            IsMasked(p, key, row), ds);
              dp[n][e] = ds;
            }
          }
          AccumulatorToA<Op, 16>(s, 1.f, prob_a);
          AccumulatorToA<Op, 16>(dp, 1.f, ds_a);
          WarpProductKn<Op, 16>(acc_dq, ds_a, k_block, visible);
        } else {
          ClearOperand(prob_a);
          ClearOperand(ds_a);
        }
        __syncthreads();  // every warp is done with this block's K and V
        StoreFragments(prob_a, v_block, warp_row0);
        StoreFragments(ds_a, k_block, warp_row0);
      }
      // dQ of the chunk's rows is complete.
      StoreAccumulatorRows(acc_dq, p.grad_q, token0, p.num_heads * kHeadDim, head * kHeadDim, row_a,
                           seq_len, p.inv_ds_scale);
      __syncthreads();  // P and dS of every key block are staged

      // ---- Phase 2: 16 keys per warp, dV += P^T dO and dK += dS^T Q over the chunk's queries ----
      for (int key_group = warp; key_group * 16 < key_end; key_group += kWarps) {
        const int key_row0 = key_group * 16;
        // Keys before the window of every query of the chunk get nothing from it; never the first
        // contribution (that comes from the key's own chunk).
        if (key_row0 + 15 < FirstVisibleKey(p, q0)) continue;
        const int block = key_row0 / kKeyBlock;
        const int in_block = key_row0 % kKeyBlock;
        // Queries of the chunk at or after these keys: k-steps from the one holding key_row0.
        const int first_step = max(0, key_row0 - q0) / 16;
        const int steps = (chunk_rows + 15) / 16;
        // The first contribution to a key row: first query head of the block, the key's own chunk.
        const bool first = head_index == 0 && key_row0 >= q0;
#pragma unroll 1
        for (int which = 0; which < 2; ++which) {  // 0: dV from P and dO, 1: dK from dS and Q
          const __half* staged = (which == 0 ? v_tile : k_tile) + block * kKeyBlock * kPitch;
          const __half* b_tile = which == 0 ? do_tile : q_tile;
          float acc[16][4];
          ClearAccumulators(acc);
          for (int step = first_step; step < steps; ++step) {
            std::uint32_t a[4];
            LoadATransposed(a, staged, in_block, step * 16);
#pragma unroll
            for (int n = 0; n < 16; n += 2) {
              std::uint32_t b[2][2];
              LoadBkn2<Op>(b, b_tile, step * 16, n * 8);
              Mma<Op>(acc[n], a, b[0]);
              Mma<Op>(acc[n + 1], a, b[1]);
            }
          }
          StoreAccumulatorRows(acc, which == 0 ? grad_v : grad_k, token0, kv_ld, kv_head * kHeadDim,
                               key_row0 + g, seq_len, which == 0 ? 1.f : p.inv_ds_scale,
                               /*add=*/!first);
        }
      }
      __syncthreads();  // the next chunk's loads overwrite every tile
    }
  }
}

// ---- The grid form (AttentionTiles::kShortGrid): many small blocks instead of one per head ----
// At S <= 256 the whole-sequence kernel above leaves most SMs idle (24 blocks at 1 x 128 on 132
// SMs) and each block walks every product of a head. Here two kinds of blocks share one launch:
//   dK/dV block (32 keys, query head, batch): S^T = K Q^T and dP^T = V dO^T over the queries that
//     see its keys, dV += P^T dO, dK += dS^T Q (dK/dV of one query head: partials summed over the
//     group by SumPartialsKernel, or the output itself when the group is one head);
//   dQ block (32 queries, query head, batch): S, dP over its visible keys, dQ += dS K, written
//   once.
// 8 warps per block: 2 halves of 16 keys (queries) x 4 slots, slot s taking the 32-row steps s,
// s + 4, ... of the other operand; the 4 slots' accumulators are summed through shared memory in
// slot order (deterministic: the same order every run). The whole other operand (<= 256 rows of
// Q, dO or K, V) is loaded at once. 7 products (S and dP in both kinds of block), but the grid has
// 2 x B x H x ceil(S / 32) blocks of short serial chains.
constexpr int kGridWarps = 8;
constexpr int kGridThreads = kGridWarps * 32;
constexpr int kGridRows = 32;  // keys of a dK/dV block, queries of a dQ block; rows of a step
constexpr int kGridSlots = 4;  // warps over the same 16 rows, each taking every 4th step
constexpr int kGridScoreTiles = kGridRows / 8;
constexpr int kReducePitch = kHeadDim + 8;  // fp32 row pitch of the slot sums (no bank conflict)

// The block's 32 rows of its own operands, the other operands' rows (the whole sequence at most),
// and their row statistics (a dK/dV block's queries; log2 units). After the products the other
// operands' space holds every warp's accumulators for the slot sum: [output][slot][32][pitch].
struct GridTile {
  static constexpr std::size_t kOwnBytes =
      static_cast<std::size_t>(2 * kGridRows) * kPitch * sizeof(__half);
  static constexpr std::size_t kOtherBytes =
      static_cast<std::size_t>(2 * kShortSequenceMaxLength) * kPitch * sizeof(__half);
  static constexpr std::size_t kReduceBytes =
      static_cast<std::size_t>(2 * kGridSlots * kGridRows) * kReducePitch * sizeof(float);
  static_assert(kReduceBytes <= kOtherBytes, "the slot sums reuse the other operands' space");
  static constexpr std::size_t kSharedBytes =
      kOwnBytes + kOtherBytes + 2 * kShortSequenceMaxLength * sizeof(float);

  __half* own_a;    // K or Q [32][kPitch]
  __half* own_b;    // V or dO
  __half* other_a;  // Q or K [256][kPitch]
  __half* other_b;  // dO or V
  float* reduce;    // over other_a/other_b: [2][kGridSlots][32][kReducePitch]
  float* lse;       // [256]
  float* delta;     // [256]
  __device__ explicit GridTile(unsigned char* shared)
      : own_a(reinterpret_cast<__half*>(shared)),
        own_b(own_a + kGridRows * kPitch),
        other_a(own_b + kGridRows * kPitch),
        other_b(other_a + kShortSequenceMaxLength * kPitch),
        reduce(reinterpret_cast<float*>(other_a)),
        lse(reinterpret_cast<float*>(other_b + kShortSequenceMaxLength * kPitch)),
        delta(lse + kShortSequenceMaxLength) {}
};
constexpr std::size_t kGridSharedBytes = GridTile::kSharedBytes;

// Rows [row0, row0 + rows) of one head into `tile` (rows >= seq_len zero-filled), 16 bytes per
// cp.async.
__device__ __forceinline__ void LoadRowsAsync(__half* tile, const __half* head_base, int ld,
                                              int row0, int rows, int seq_len) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int c = threadIdx.x; c < rows * kChunksPerRow; c += kGridThreads) {
    const int r = c / kChunksPerRow, cc = c % kChunksPerRow;
    const int row = row0 + r;
    const bool valid = row < seq_len;
    const __half* source = head_base + static_cast<long long>(valid ? row : 0) * ld + cc * 8;
    CpAsync16(tile + r * kPitch + cc * 8, source, valid);
  }
}

// A warp's 16 x 128 accumulator into the slot-sum space (rows row0 + g, row0 + g + 8).
__device__ __forceinline__ void StageAccumulator(const float (&acc)[16][4], float* space,
                                                 int row0) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  float* upper = space + (row0 + g) * kReducePitch + 2 * t;
  float* lower = upper + 8 * kReducePitch;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    *reinterpret_cast<float2*>(upper + 8 * n) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(lower + 8 * n) = make_float2(acc[n][2], acc[n][3]);
  }
}

// out rows [row0, row0 + 32) (< seq_len) of `outputs` outputs: the sum over the slots, in slot
// order, times the output's scale; float4 per thread, a row's 128 columns by 32 threads.
__device__ __forceinline__ void StoreSlotSums(const float* reduce, int outputs, float* out0,
                                              float scale0, float* out1, float scale1,
                                              long long token0, int ld, int column0, int row0,
                                              int seq_len) {
  constexpr int kChunks = kHeadDim / 4;
  for (int c = threadIdx.x; c < outputs * kGridRows * kChunks; c += kGridThreads) {
    const int which = c / (kGridRows * kChunks);
    const int r = (c / kChunks) % kGridRows, cc = c % kChunks;
    if (row0 + r >= seq_len) continue;
    const float* source = reduce + (which * kGridSlots * kGridRows + r) * kReducePitch + cc * 4;
    float4 sum = *reinterpret_cast<const float4*>(source);
#pragma unroll
    for (int slot = 1; slot < kGridSlots; ++slot) {
      const float4 v = *reinterpret_cast<const float4*>(source + slot * kGridRows * kReducePitch);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    const float scale = which == 0 ? scale0 : scale1;
    sum.x *= scale;
    sum.y *= scale;
    sum.z *= scale;
    sum.w *= scale;
    float* out = which == 0 ? out0 : out1;
    *reinterpret_cast<float4*>(out + (token0 + row0 + r) * ld + column0 + cc * 4) = sum;
  }
}

__global__ void __launch_bounds__(kGridThreads, 1)
    ShortGridBackwardKernel(const AttentionParams p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const GridTile tile(shared_raw);
  const int seq_len = p.seq_len;
  const int num_tiles = (seq_len + kGridRows - 1) / kGridRows;
  // Block order: rank r (heaviest first), then both kinds of block of every (head, batch): the
  // dK/dV blocks of key tile r and the dQ blocks of query tile num_tiles - 1 - r.
  const int per_rank = 2 * p.num_heads * p.batch;
  const int rank = static_cast<int>(blockIdx.x) / per_rank;
  const int rest = static_cast<int>(blockIdx.x) % per_rank;
  const bool key_block = (rest & 1) == 0;
  const int head = (rest >> 1) % p.num_heads;
  const int batch = (rest >> 1) / p.num_heads;
  const int kv_head = head / p.group;
  const long long token0 = static_cast<long long>(batch) * seq_len;
  const long long stat0 = (static_cast<long long>(batch) * p.num_heads + head) * seq_len;

  const __half* q_base = static_cast<const __half*>(p.q) + token0 * p.ldq + head * kHeadDim;
  const __half* do_base = static_cast<const __half*>(p.grad_out) + token0 * p.ldo + head * kHeadDim;
  const __half* k_base = static_cast<const __half*>(p.k) + token0 * p.ldkv + kv_head * kHeadDim;
  const __half* v_base = static_cast<const __half*>(p.v) + token0 * p.ldkv + kv_head * kHeadDim;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int half_rows = 16 * (warp & 1);  // the warp's 16 rows of the block's 32
  const int slot = warp >> 1;
  const float ds_factor = p.scaling * p.ds_scale;

  if (key_block) {
    const int key0 = rank * kGridRows;
    // Queries that see a key of [key0, key0 + 32): [key0, key0 + 31 + window - 1], < seq_len.
    const int query_end = min(seq_len, key0 + kGridRows - 1 + p.window);
    const int steps = (query_end - key0 + kGridRows - 1) / kGridRows;
    LoadRowsAsync(tile.own_a, k_base, p.ldkv, key0, kGridRows, seq_len);
    LoadRowsAsync(tile.own_b, v_base, p.ldkv, key0, kGridRows, seq_len);
    LoadRowsAsync(tile.other_a, q_base, p.ldq, key0, steps * kGridRows, seq_len);
    LoadRowsAsync(tile.other_b, do_base, p.ldo, key0, steps * kGridRows, seq_len);
    CpAsyncCommit();
    for (int r = threadIdx.x; r < steps * kGridRows; r += kGridThreads) {
      const int row = key0 + r;
      tile.lse[r] = row < seq_len ? p.lse_in[stat0 + row] * kLog2e : INFINITY;
      tile.delta[r] = row < seq_len ? p.delta[stat0 + row] : 0.f;
    }
    CpAsyncWait<0>();
    __syncthreads();

    const int warp_key0 = key0 + half_rows;
    const int key_a = warp_key0 + g, key_b = key_a + 8;
    float acc_dk[16][4], acc_dv[16][4];
    ClearAccumulators(acc_dk);
    ClearAccumulators(acc_dv);
    for (int step = slot; step < steps; step += kGridSlots) {
      const int rows0 = step * kGridRows;  // within the other operands' tiles
      const int query0 = key0 + rows0;
      // Skip a step whose queries all precede the warp's keys, or see none of them (window).
      if (warp_key0 > query0 + kGridRows - 1 || warp_key0 + 15 < FirstVisibleKey(p, query0)) {
        continue;
      }
      const __half* q_step = tile.other_a + rows0 * kPitch;
      const __half* do_step = tile.other_b + rows0 * kPitch;
      float s[kGridScoreTiles][4], dp[kGridScoreTiles][4];
      ClearAccumulators(s);
      ClearAccumulators(dp);
      WarpProductNk<Op, kGridScoreTiles>(s, tile.own_a, half_rows, q_step);
      WarpProductNk<Op, kGridScoreTiles>(dp, tile.own_b, half_rows, do_step);
#pragma unroll
      for (int n = 0; n < kGridScoreTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int column = n * 8 + 2 * t + (e & 1);
          const int key = e < 2 ? key_a : key_b;
          float ds;
          s[n][e] = SoftmaxGradient<Op>(p, s[n][e], dp[n][e], tile.lse[rows0 + column],
                                        tile.delta[rows0 + column], ds_factor,
                                        IsMasked(p, key, query0 + column), ds);
          dp[n][e] = ds;
        }
      }
      AccumulatorA<Op, kGridScoreTiles> prob_a, ds_a;
      AccumulatorToA<Op, kGridScoreTiles>(s, 1.f, prob_a);
      AccumulatorToA<Op, kGridScoreTiles>(dp, 1.f, ds_a);
      WarpProductKn<Op, kGridScoreTiles>(acc_dv, prob_a, do_step);
      WarpProductKn<Op, kGridScoreTiles>(acc_dk, ds_a, q_step);
    }
    __syncthreads();  // every warp is done with the other operands: their space takes the sums
    StageAccumulator(acc_dk, tile.reduce + slot * kGridRows * kReducePitch, half_rows);
    StageAccumulator(acc_dv, tile.reduce + (kGridSlots + slot) * kGridRows * kReducePitch,
                     half_rows);
    __syncthreads();
    const int kv_ld = p.num_kv_heads * kHeadDim;
    float* grad_k = p.grad_k;
    float* grad_v = p.grad_v;
    if (p.kv_split) {
      const long long per_output = static_cast<long long>(p.batch) * seq_len * kv_ld;
      grad_k = p.partials + static_cast<long long>(head % p.group) * 2 * per_output;
      grad_v = grad_k + per_output;
    }
    StoreSlotSums(tile.reduce, 2, grad_k, p.inv_ds_scale, grad_v, 1.f, token0, kv_ld,
                  kv_head * kHeadDim, key0, seq_len);
  } else {
    const int query0 = (num_tiles - 1 - rank) * kGridRows;
    // Keys that a query of [query0, query0 + 32) sees: from the window's start of query0, in
    // whole 32-key steps, to query0 + 31 (< seq_len).
    const int first_key = FirstVisibleKey(p, query0) / kGridRows * kGridRows;
    const int key_end = min(seq_len, query0 + kGridRows);
    const int steps = (key_end - first_key + kGridRows - 1) / kGridRows;
    LoadRowsAsync(tile.own_a, q_base, p.ldq, query0, kGridRows, seq_len);
    LoadRowsAsync(tile.own_b, do_base, p.ldo, query0, kGridRows, seq_len);
    LoadRowsAsync(tile.other_a, k_base, p.ldkv, first_key, steps * kGridRows, seq_len);
    LoadRowsAsync(tile.other_b, v_base, p.ldkv, first_key, steps * kGridRows, seq_len);
    CpAsyncCommit();
    const int warp_row0 = query0 + half_rows;
    const int row_a = warp_row0 + g, row_b = row_a + 8;
    const RowStatistics rows = LoadRowStatistics(p, stat0, row_a, row_b);
    CpAsyncWait<0>();
    __syncthreads();

    float acc_dq[16][4];
    ClearAccumulators(acc_dq);
    for (int step = slot; step < steps; step += kGridSlots) {
      const int key0 = first_key + step * kGridRows;
      // Skip keys that all follow the warp's rows or all precede the window of its first row.
      if (key0 > warp_row0 + 15 || key0 + kGridRows - 1 < FirstVisibleKey(p, warp_row0)) continue;
      const __half* k_step = tile.other_a + step * kGridRows * kPitch;
      const __half* v_step = tile.other_b + step * kGridRows * kPitch;
      QueryGradientStep<Op, kGridScoreTiles>(p, tile.own_a, tile.own_b, half_rows, k_step, v_step,
                                             key0, row_a, row_b, t, rows, ds_factor, acc_dq);
    }
    __syncthreads();  // every warp is done with K and V: their space takes the sums
    StageAccumulator(acc_dq, tile.reduce + slot * kGridRows * kReducePitch, half_rows);
    __syncthreads();
    StoreSlotSums(tile.reduce, 1, p.grad_q, p.inv_ds_scale, nullptr, 1.f, token0,
                  p.num_heads * kHeadDim, head * kHeadDim, query0, seq_len);
  }
}

}  // namespace

bool ShortSequenceBackwardFitsDevice() {
  int device = 0, shared_per_block = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                device) == cudaSuccess &&
         static_cast<std::size_t>(shared_per_block) >= kSharedBytes;
}

attngrad_status LaunchShortSequenceBackward(const AttentionParams& params, cudaStream_t stream) {
  if (params.seq_len > kShortSequenceMaxLength) return ATTNGRAD_INTERNAL;
  if (cudaFuncSetAttribute(ShortSequenceBackwardKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kSharedBytes)) != cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  const long long blocks = static_cast<long long>(params.batch) *
                           (params.kv_split ? params.num_heads : params.num_kv_heads);
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  ShortSequenceBackwardKernel<<<static_cast<unsigned>(blocks), kThreads, kSharedBytes, stream>>>(
      params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

bool ShortGridBackwardFitsDevice() {
  int device = 0, shared_per_block = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                device) == cudaSuccess &&
         static_cast<std::size_t>(shared_per_block) >= kGridSharedBytes;
}

attngrad_status LaunchShortGridBackward(const AttentionParams& params, cudaStream_t stream) {
  if (params.seq_len > kShortSequenceMaxLength) return ATTNGRAD_INTERNAL;
  if (cudaFuncSetAttribute(ShortGridBackwardKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kGridSharedBytes)) != cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  const long long blocks =
      2LL * params.batch * params.num_heads * ((params.seq_len + kGridRows - 1) / kGridRows);
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  ShortGridBackwardKernel<<<static_cast<unsigned>(blocks), kGridThreads, kGridSharedBytes,
                            stream>>>(params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace attngrad::cuda::attention_detail
