// SPEC section 2 step 4 for short sequences (S <= 256, fp16 operands, head_dim 128): the attention
// forward of attention_forward.cu (same contract, same soft-cap, mask and online-softmax
// arithmetic) with a block's keys split over its warps, so that a block's serial chain is one or
// two 32-key steps instead of every key tile of its rows. At S <= 256 the forward is pure latency:
// the tiled kernels give 1 x 128 48 blocks whose warps each walk up to 2 tiles of 64 keys.
//
// One block of 8 warps per (32-query tile, query head, batch), heaviest tiles first: 2 halves of
// 16 query rows x 4 slots; slot s takes the 32-key steps s, s + 4, ... of the keys the tile sees
// (causal, within the sliding window), each with its own running max, row sums and O. The whole
// visible key/value range (<= 256 rows) is loaded at once. After the products the slots' partial
// results go through shared memory and slot 0 of each half combines them in slot order (O = sum
// of 2^(m_s - m) O_s, the same for the row sums: deterministic) and runs the forward's shared
// epilogue (StoreForwardRows: O, lse, the fused Delta).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/attention.h"
#include "cuda/attention_common.cuh"

namespace attngrad::cuda::attention_detail {
namespace {

using Op = OpFp16;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 32;  // queries per block; keys per step
constexpr int kSlots = 4;  // warps over the same 16 rows, each taking every 4th key step
constexpr int kScoreTiles = kRows / 8;
constexpr int kHeadDim = Op::kHeadDim;
constexpr int kOutTiles = kHeadDim / 8;
constexpr int kPitch = Op::kPitch;
constexpr int kStagePitch = kHeadDim + 8;  // fp32 row pitch of the staged partial O

// Shared memory: Q [32][kPitch], then K and V [rows][kPitch] each (rows = the visible key range
// rounded up to 32, <= 256), whose space then holds every warp's partial O [8][16][kStagePitch]
// and its per-thread statistics [8][32] (max_a, max_b, sum_a, sum_b).
constexpr std::size_t kQueryBytes = static_cast<std::size_t>(kRows) * kPitch * sizeof(__half);
constexpr std::size_t kStageBytes =
    static_cast<std::size_t>(kWarps) * 16 * kStagePitch * sizeof(float) +
    static_cast<std::size_t>(kWarps) * 32 * sizeof(float4);
std::size_t ShortForwardSharedBytes(int key_rows) {
  const std::size_t key_value = 2 * static_cast<std::size_t>(key_rows) * kPitch * sizeof(__half);
  return kQueryBytes + std::max(key_value, kStageBytes);
}
constexpr std::size_t kMaxSharedBytes =
    kQueryBytes + 2 * static_cast<std::size_t>(kShortSequenceMaxLength) * kPitch * sizeof(__half);
static_assert(kMaxSharedBytes >= kQueryBytes + kStageBytes, "the largest layout bounds both");

// Rows [row0, row0 + rows) of one head into `tile` (rows >= seq_len zero-filled).
__device__ __forceinline__ void LoadRows(__half* tile, const __half* head_base, int ld, int row0,
                                         int rows, int seq_len) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int c = threadIdx.x; c < rows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, cc = c % kChunksPerRow;
    const int row = row0 + r;
    const bool valid = row < seq_len;
    const __half* source = head_base + static_cast<long long>(valid ? row : 0) * ld + cc * 8;
    CpAsync16(tile + r * kPitch + cc * 8, source, valid);
  }
}

__global__ void __launch_bounds__(kThreads, 2) ShortForwardKernel(const AttentionParams p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  __half* q_tile = reinterpret_cast<__half*>(shared_raw);
  unsigned char* key_space = shared_raw + kQueryBytes;

  const int seq_len = p.seq_len;
  const int num_tiles = (seq_len + kRows - 1) / kRows;
  const WorkItem item = DecodeBlock(num_tiles, p.num_heads, p.batch, /*heavy_last=*/true);
  const int q0 = item.tile * kRows;
  const int kv_head = item.head / p.group;
  const long long token0 = static_cast<long long>(item.batch) * seq_len;
  const __half* q_base = static_cast<const __half*>(p.q) + token0 * p.ldq + item.head * kHeadDim;
  const __half* k_base = static_cast<const __half*>(p.k) + token0 * p.ldkv + kv_head * kHeadDim;
  const __half* v_base = static_cast<const __half*>(p.v) + token0 * p.ldkv + kv_head * kHeadDim;

  // Keys (q0 - window, q0 + 32) can be visible to the tile: whole 32-key steps from the window's
  // start of its first row.
  const int first_key = FirstVisibleKey(p, q0) / kRows * kRows;
  const int key_end = min(seq_len, q0 + kRows);
  const int steps = (key_end - first_key + kRows - 1) / kRows;
  __half* k_tile = reinterpret_cast<__half*>(key_space);
  __half* v_tile = k_tile + steps * kRows * kPitch;
  LoadRows(q_tile, q_base, p.ldq, q0, kRows, seq_len);
  LoadRows(k_tile, k_base, p.ldkv, first_key, steps * kRows, seq_len);
  LoadRows(v_tile, v_base, p.ldkv, first_key, steps * kRows, seq_len);
  CpAsyncCommit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int half_rows = 16 * (warp & 1);
  const int slot = warp >> 1;
  const int warp_row0 = q0 + half_rows;
  const int row_a = warp_row0 + g, row_b = row_a + 8;

  float acc_o[kOutTiles][4];
  ClearAccumulators(acc_o);
  float max_a = -INFINITY, max_b = -INFINITY;  // running max of c*log2e
  float sum_a = 0.f, sum_b = 0.f;              // this thread's part of the row sums
  CpAsyncWait<0>();
  __syncthreads();

  for (int step = slot; step < steps; step += kSlots) {
    const int key0 = first_key + step * kRows;
    // Keys that all follow the warp's rows, or all precede the window of its first row.
    if (key0 > warp_row0 + 15 || key0 + kRows - 1 < FirstVisibleKey(p, warp_row0)) continue;
    const __half* k_step = k_tile + step * kRows * kPitch;
    const __half* v_step = v_tile + step * kRows * kPitch;
    float s[kScoreTiles][4];
    ClearAccumulators(s);
    WarpProductNk<Op, kScoreTiles>(s, q_tile, half_rows, k_step);
    const bool needs_mask = key0 + kRows - 1 > warp_row0 || key0 + kRows > seq_len ||
                            key0 < FirstVisibleKey(p, warp_row0 + 15);
    OnlineSoftmaxStep<Op>(p, s, acc_o, needs_mask, key0, seq_len, row_a, row_b, t, max_a, max_b,
                          sum_a, sum_b);
    AccumulatorA<Op, kScoreTiles> prob;
    AccumulatorToA<Op, kScoreTiles>(s, 1.f, prob);
    WarpProductKn<Op, kScoreTiles>(acc_o, prob, v_step);
  }

  // The slots' partial results through shared memory (the keys' space: every warp is done with it).
  __syncthreads();
  float* stage = reinterpret_cast<float*>(key_space);
  float4* statistics = reinterpret_cast<float4*>(stage + kWarps * 16 * kStagePitch);
  if (slot != 0) {
    float* upper = stage + (warp * 16 + g) * kStagePitch + 2 * t;
    float* lower = upper + 8 * kStagePitch;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      *reinterpret_cast<float2*>(upper + 8 * n) = make_float2(acc_o[n][0], acc_o[n][1]);
      *reinterpret_cast<float2*>(lower + 8 * n) = make_float2(acc_o[n][2], acc_o[n][3]);
    }
    statistics[warp * 32 + lane] = make_float4(max_a, max_b, sum_a, sum_b);
  }
  __syncthreads();
  if (slot != 0) return;

  // Slot 0 of each half: the row maxima over the slots, then every part rescaled to them and
  // added in slot order.
  float total_max_a = max_a, total_max_b = max_b;
#pragma unroll
  for (int other = 1; other < kSlots; ++other) {
    const float4 part = statistics[(other * 2 + (warp & 1)) * 32 + lane];
    total_max_a = fmaxf(total_max_a, part.x);
    total_max_b = fmaxf(total_max_b, part.y);
  }
  const float base_a = total_max_a == -INFINITY ? 0.f : total_max_a;
  const float base_b = total_max_b == -INFINITY ? 0.f : total_max_b;
  const float own_a = FastExp2(max_a - base_a), own_b = FastExp2(max_b - base_b);
  sum_a *= own_a;
  sum_b *= own_b;
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n) {
    acc_o[n][0] *= own_a;
    acc_o[n][1] *= own_a;
    acc_o[n][2] *= own_b;
    acc_o[n][3] *= own_b;
  }
#pragma unroll
  for (int other = 1; other < kSlots; ++other) {
    const int other_warp = other * 2 + (warp & 1);
    const float4 part = statistics[other_warp * 32 + lane];
    const float factor_a = FastExp2(part.x - base_a);
    const float factor_b = FastExp2(part.y - base_b);
    sum_a = fmaf(part.z, factor_a, sum_a);
    sum_b = fmaf(part.w, factor_b, sum_b);
    const float* upper = stage + (other_warp * 16 + g) * kStagePitch + 2 * t;
    const float* lower = upper + 8 * kStagePitch;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      const float2 u = *reinterpret_cast<const float2*>(upper + 8 * n);
      const float2 l = *reinterpret_cast<const float2*>(lower + 8 * n);
      acc_o[n][0] = fmaf(u.x, factor_a, acc_o[n][0]);
      acc_o[n][1] = fmaf(u.y, factor_a, acc_o[n][1]);
      acc_o[n][2] = fmaf(l.x, factor_b, acc_o[n][2]);
      acc_o[n][3] = fmaf(l.y, factor_b, acc_o[n][3]);
    }
  }
  StoreForwardRows<Op>(p, acc_o, total_max_a, total_max_b, sum_a, sum_b, row_a, row_b, t, token0,
                       item);
}

}  // namespace

bool ShortForwardApplies(const AttentionProblem& problem) {
  if (problem.operand != AttentionOperand::kFp16 || problem.head_dim != 128 ||
      problem.seq_len > kShortSequenceMaxLength) {
    return false;
  }
  if (problem.forward_path == AttentionForwardPath::kAuto) {
    if (!ShortGridPays(problem)) return false;
  } else if (problem.forward_path != AttentionForwardPath::kShort) {
    return false;
  }
  int device = 0, shared_per_block = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                device) == cudaSuccess &&
         static_cast<std::size_t>(shared_per_block) >= kMaxSharedBytes;
}

attngrad_status LaunchShortForward(const AttentionParams& params, cudaStream_t stream) {
  if (params.seq_len > kShortSequenceMaxLength) return ATTNGRAD_INTERNAL;
  // The largest block's key range: the whole sequence, or the window plus a tile, in 32-key steps.
  const int key_rows =
      std::min((params.seq_len + kRows - 1) / kRows, (params.window + 2 * kRows - 2) / kRows + 1) *
      kRows;
  const std::size_t shared = ShortForwardSharedBytes(key_rows);
  if (cudaFuncSetAttribute(ShortForwardKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kMaxSharedBytes)) != cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  const long long blocks = static_cast<long long>((params.seq_len + kRows - 1) / kRows) *
                           params.num_heads * params.batch;
  if (blocks > 0x7fffffffLL) return ATTNGRAD_UNSUPPORTED;
  ShortForwardKernel<<<static_cast<unsigned>(blocks), kThreads, shared, stream>>>(params);
  return cudaGetLastError() == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
}

}  // namespace attngrad::cuda::attention_detail
