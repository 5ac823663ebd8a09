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
// scale of the FP16 mode (attention_common.cuh), removed from dK and dQ on output.
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

}  // namespace attngrad::cuda::attention_detail
