// Building blocks shared by the flash-style attention kernels (attention_forward.cu, SPEC section 2
// step 4; attention_backward.cu, step 6): operand traits per AttentionOperand mode, warp-level
// tensor-core tile products on shared-memory tiles, the soft-cap, and the cp.async tile loads.
// Internal to kernels/.
//
// Warp tiles follow the mma.sync fragment layouts (sm_80+): a warp owns 16 rows; g = lane / 4 and
// t = lane % 4; an fp32 accumulator tile of 16 x 8 holds (row g, cols 2t, 2t+1) in c[0..1] and
// (row g + 8, same cols) in c[2..3].
//   kFp16: mma.m16n8k16 with fp16 operands (ldmatrix from padded shared memory), fp32 accumulation.
//   kTf32: mma.m16n8k8 with tf32 operands (tiles rounded to tf32 in shared memory), fp32
//   accumulation. kFp32: the same m16n8k8 fragments, the product done exactly with fp32 FMA through
//   warp shuffles.
// An A operand built from an accumulator tile (P, dS) keeps the accumulator's column order. For the
// 8-wide k-step of tf32/fp32 this permutes the k index (logical k = t <-> column 2t, k = t + 4 <->
// column 2t + 1); the B operand that pairs with such an A (always one stored [k][n] in shared
// memory) is loaded with the same permutation, so the product is unchanged.
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_COMMON_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_COMMON_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/attention.h"

namespace attngrad::cuda::attention_detail {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// ---- Operand traits ---------------------------------------------------------------------------
// One per operand mode and head dimension D (128 or 256): tiles are D columns wide, their rows
// padded so that fragment loads are free of bank conflicts (pitch D + 8 fp16 = an odd number of 16
// bytes for ldmatrix; D + 4 floats = 4 banks apart for scalar fragment loads).
template <int D>
struct Fp16Operand {
  using Elem = __half;
  static constexpr int kHeadDim = D;
  static constexpr int kK = 16;         // k per mma
  static constexpr int kPitch = D + 8;  // shared-memory row pitch in elements (272 bytes at 128)
  static constexpr bool kIsFp16 = true;
  static constexpr bool kRoundTf32 = false;
  static constexpr bool kEmulated = false;
  static constexpr bool kPreciseTanh = false;
};
template <int D>
struct Tf32Operand {
  using Elem = float;
  static constexpr int kHeadDim = D;
  static constexpr int kK = 8;
  static constexpr int kPitch = D + 4;  // 528 bytes at 128: conflict-free scalar fragment loads
  static constexpr bool kIsFp16 = false;
  static constexpr bool kRoundTf32 = true;
  static constexpr bool kEmulated = false;
  static constexpr bool kPreciseTanh = false;
};
template <int D>
struct Fp32Operand {
  using Elem = float;
  static constexpr int kHeadDim = D;
  static constexpr int kK = 8;
  static constexpr int kPitch = D + 4;
  static constexpr bool kIsFp16 = false;
  static constexpr bool kRoundTf32 = false;
  static constexpr bool kEmulated = true;
  static constexpr bool kPreciseTanh = true;
};
using OpFp16 = Fp16Operand<128>;
using OpTf32 = Tf32Operand<128>;
using OpFp32 = Fp32Operand<128>;

// Everything the kernels need, by value.
struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* grad_out = nullptr;
  int ldq = 0, ldkv = 0, ldo = 0;
  float* out = nullptr;
  __half* out_half = nullptr;
  float* lse = nullptr;
  const float* out_in = nullptr;
  const float* lse_in = nullptr;
  float* delta = nullptr;
  float* grad_q = nullptr;
  float* grad_k = nullptr;
  float* grad_v = nullptr;
  int batch = 0, seq_len = 0, num_heads = 0, num_kv_heads = 0, group = 1;
  int head_dim = 128;  // 128 or 256: the kernels' Op::kHeadDim
  // The effective sliding window, in [1, seq_len]: query i sees keys j with i - window < j <= i.
  // Full causal attention is window = seq_len (then no key of a valid row is cut off).
  int window = 0;
  float scaling = 0.f;
  bool has_cap = true;
  float score_scale =
      0.f;                // s * score_scale is tanh's argument (scaling / cap), or c*log2e (no cap)
  float cap_log2e = 0.f;  // cap * log2(e)
  bool kv_split = false;  // dK/dV per query head into `partials`, summed by a reduce kernel
  float* partials = nullptr;  // [group][2][B*S][num_kv_heads*head_dim]
  float ds_scale = 1.f;       // power of two applied to dS before it becomes an fp16 operand
  float inv_ds_scale = 1.f;
  // dS stored by the Hopper dK/dV kernel for the dQ kernel (AttentionScores::kStored): fp16 tiles
  // of 64 queries x 64 keys, ScoreTiles below; nullptr: not stored.
  __half* grad_scores = nullptr;
};

// Where the stored dS tiles lie. Tile (query tile qt, key tile kt) of a (batch, query head) holds
// dS^T, 64 keys x 64 queries, as the image of a 1024-byte aligned swizzled shared-memory tile
// (hopper_wgmma.cuh's SwizzledTile<64, 64>: key rows of 128 bytes), 4096 halves. A query tile's key
// tiles are kt = FirstKeyTile(qt) .. qt (the causal mask and the window; the tiles the dK/dV
// kernel computes); row qt starts at RowStart(qt) of its head's PerHead() tiles: qt (qt + 1) / 2
// under the causal mask, or qt * (the most key tiles a window covers) where a window makes that
// fewer (so a window never needs more tiles than the causal mask alone).
struct ScoreTiles {
  static constexpr int kRows = 64;
  static constexpr int kHalves = kRows * kRows;
  int query_tiles = 0;
  int window = 0;        // AttentionParams::window
  int row_capacity = 0;  // 0: causal rows (qt + 1 tiles); else the window's most tiles per row

  __host__ __device__ static ScoreTiles Of(int seq_len, int window) {
    ScoreTiles tiles;
    tiles.query_tiles = (seq_len + kRows - 1) / kRows;
    tiles.window = window;
    const int window_tiles = (window + kRows - 2) / kRows + 1;
    tiles.row_capacity =
        window < seq_len && 2 * window_tiles < tiles.query_tiles + 1 ? window_tiles : 0;
    return tiles;
  }
  __host__ __device__ int FirstKeyTile(int query_tile) const {
    const int first_key = query_tile * kRows - window + 1;
    return first_key > 0 ? first_key / kRows : 0;
  }
  __host__ __device__ long long RowStart(int query_tile) const {
    return row_capacity > 0 ? static_cast<long long>(query_tile) * row_capacity
                            : static_cast<long long>(query_tile) * (query_tile + 1) / 2;
  }
  __host__ __device__ long long PerHead() const { return RowStart(query_tiles); }
  // Halves from grad_scores to the tile (qt, kt) of `head` of `batch`.
  __host__ __device__ long long Offset(int batch, int head, int num_heads, int query_tile,
                                       int key_tile) const {
    return ((static_cast<long long>(batch) * num_heads + head) * PerHead() + RowStart(query_tile) +
            (key_tile - FirstKeyTile(query_tile))) *
           kHalves;
  }
};

// ---- Small device helpers ---------------------------------------------------------------------
__device__ __forceinline__ std::uint32_t SmemAddress(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ std::uint32_t RoundToTf32(float x) {
  std::uint32_t y;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(y) : "f"(x));
  return y;
}

// Two consecutive elements of dO as the backward's products see them (TF32: rounded the same way),
// so that Delta = rowsum(dO * O) cancels against dP = dO v^T.
template <class Op>
__device__ __forceinline__ float2 LoadGradOutPair(const typename Op::Elem* pointer) {
  if constexpr (Op::kIsFp16) {
    return __half22float2(*reinterpret_cast<const __half2*>(pointer));
  } else {
    float2 value = *reinterpret_cast<const float2*>(pointer);
    if constexpr (Op::kRoundTf32) {
      value.x = __uint_as_float(RoundToTf32(value.x));
      value.y = __uint_as_float(RoundToTf32(value.y));
    }
    return value;
  }
}

__device__ __forceinline__ std::uint32_t PackHalf2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&h);
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

// The causal and sliding-window mask: key j is hidden from query row i when j > i or j <= i -
// window.
__device__ __forceinline__ bool IsMasked(const AttentionParams& p, int key, int row) {
  return key > row || key <= row - p.window;
}

// First key a query row sees (rows past the sequence included: they are never stored).
__device__ __forceinline__ int FirstVisibleKey(const AttentionParams& p, int row) {
  return max(0, row - p.window + 1);
}

// ---- mma
// ------------------------------------------------------------------------------------------
template <class Op>
__device__ __forceinline__ void Mma(float (&c)[4], const std::uint32_t (&a)[4],
                                    const std::uint32_t (&b)[2]) {
  if constexpr (Op::kIsFp16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (!Op::kEmulated) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    // Exact fp32: C[g][2t+j] += sum_k A[g][k] B[k][2t+j] with the m16n8k8 fragment layout
    // (a: (g,t) (g+8,t) (g,t+4) (g+8,t+4); b: (k=t, n=g) (k=t+4, n=g)).
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int src_a = g * 4 + kk;
      const int src_b0 = (2 * t) * 4 + kk;
      const int src_b1 = (2 * t + 1) * 4 + kk;
      const float a0 = __uint_as_float(__shfl_sync(0xffffffffu, a[0], src_a));
      const float a1 = __uint_as_float(__shfl_sync(0xffffffffu, a[1], src_a));
      const float a2 = __uint_as_float(__shfl_sync(0xffffffffu, a[2], src_a));
      const float a3 = __uint_as_float(__shfl_sync(0xffffffffu, a[3], src_a));
      const float b00 = __uint_as_float(__shfl_sync(0xffffffffu, b[0], src_b0));
      const float b01 = __uint_as_float(__shfl_sync(0xffffffffu, b[1], src_b0));
      const float b10 = __uint_as_float(__shfl_sync(0xffffffffu, b[0], src_b1));
      const float b11 = __uint_as_float(__shfl_sync(0xffffffffu, b[1], src_b1));
      c[0] = fmaf(a2, b01, fmaf(a0, b00, c[0]));
      c[1] = fmaf(a2, b11, fmaf(a0, b10, c[1]));
      c[2] = fmaf(a3, b01, fmaf(a1, b00, c[2]));
      c[3] = fmaf(a3, b11, fmaf(a1, b10, c[3]));
    }
  }
}

// ---- Fragment loads from shared memory (tiles of Op::kHeadDim columns, row pitch Op::kPitch)
// ---------------- A: rows [row0, row0 + 16), k-step at k0, stored [row][k].
template <class Op>
__device__ __forceinline__ void LoadA(std::uint32_t (&a)[4], const typename Op::Elem* tile,
                                      int row0, int k0) {
  const int lane = threadIdx.x & 31;
  if constexpr (Op::kIsFp16) {
    const int mi = lane >> 3, r = lane & 7;
    const __half* address = tile + (row0 + (mi & 1) * 8 + r) * Op::kPitch + k0 + (mi >> 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(SmemAddress(address)));
  } else {
    const int g = lane >> 2, t = lane & 3;
    const float* base = tile + (row0 + g) * Op::kPitch + k0 + t;
    a[0] = __float_as_uint(base[0]);
    a[1] = __float_as_uint(base[8 * Op::kPitch]);
    a[2] = __float_as_uint(base[4]);
    a[3] = __float_as_uint(base[8 * Op::kPitch + 4]);
  }
}

// B for two n-tiles (n0, n0 + 8), k-step at k0, stored [n][k] (e.g. K for S = Q K^T).
template <class Op>
__device__ __forceinline__ void LoadBnk2(std::uint32_t (&b)[2][2], const typename Op::Elem* tile,
                                         int n0, int k0) {
  const int lane = threadIdx.x & 31;
  if constexpr (Op::kIsFp16) {
    const int mi = lane >> 3, r = lane & 7;
    const __half* address = tile + (n0 + (mi >> 1) * 8 + r) * Op::kPitch + k0 + (mi & 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0][0]), "=r"(b[0][1]), "=r"(b[1][0]), "=r"(b[1][1])
                 : "r"(SmemAddress(address)));
  } else {
    const int g = lane >> 2, t = lane & 3;
    const float* base = tile + (n0 + g) * Op::kPitch + k0 + t;
    b[0][0] = __float_as_uint(base[0]);
    b[0][1] = __float_as_uint(base[4]);
    b[1][0] = __float_as_uint(base[8 * Op::kPitch]);
    b[1][1] = __float_as_uint(base[8 * Op::kPitch + 4]);
  }
}

// B for two n-tiles (n0, n0 + 8), k-step at k0, stored [k][n] (e.g. V for O = P V). Pairs with an A
// made by AccumulatorToA (permuted k for the 8-wide steps, see the file comment).
template <class Op>
__device__ __forceinline__ void LoadBkn2(std::uint32_t (&b)[2][2], const typename Op::Elem* tile,
                                         int k0, int n0) {
  const int lane = threadIdx.x & 31;
  if constexpr (Op::kIsFp16) {
    const int mi = lane >> 3, r = lane & 7;
    const __half* address = tile + (k0 + (mi & 1) * 8 + r) * Op::kPitch + n0 + (mi >> 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0][0]), "=r"(b[0][1]), "=r"(b[1][0]), "=r"(b[1][1])
                 : "r"(SmemAddress(address)));
  } else {
    const int g = lane >> 2, t = lane & 3;
    const float* base = tile + (k0 + 2 * t) * Op::kPitch + n0 + g;
    b[0][0] = __float_as_uint(base[0]);
    b[0][1] = __float_as_uint(base[Op::kPitch]);
    b[1][0] = __float_as_uint(base[8]);
    b[1][1] = __float_as_uint(base[Op::kPitch + 8]);
  }
}

// A operand (k = the accumulator's columns) from kNT accumulator tiles, each value times `scale`.
template <class Op, int kNT>
struct AccumulatorA {
  static constexpr int kSteps = kNT * 8 / Op::kK;
  std::uint32_t a[kSteps][4];
};

template <class Op, int kNT>
__device__ __forceinline__ void AccumulatorToA(const float (&c)[kNT][4], float scale,
                                               AccumulatorA<Op, kNT>& out) {
  if constexpr (Op::kIsFp16) {
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
      out.a[kk][0] = PackHalf2(c[2 * kk][0] * scale, c[2 * kk][1] * scale);
      out.a[kk][1] = PackHalf2(c[2 * kk][2] * scale, c[2 * kk][3] * scale);
      out.a[kk][2] = PackHalf2(c[2 * kk + 1][0] * scale, c[2 * kk + 1][1] * scale);
      out.a[kk][3] = PackHalf2(c[2 * kk + 1][2] * scale, c[2 * kk + 1][3] * scale);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kNT; ++kk) {
      const float v0 = c[kk][0] * scale, v1 = c[kk][1] * scale;
      const float v2 = c[kk][2] * scale, v3 = c[kk][3] * scale;
      if constexpr (Op::kRoundTf32) {
        out.a[kk][0] = RoundToTf32(v0);
        out.a[kk][1] = RoundToTf32(v2);
        out.a[kk][2] = RoundToTf32(v1);
        out.a[kk][3] = RoundToTf32(v3);
      } else {
        out.a[kk][0] = __float_as_uint(v0);
        out.a[kk][1] = __float_as_uint(v2);
        out.a[kk][2] = __float_as_uint(v1);
        out.a[kk][3] = __float_as_uint(v3);
      }
    }
  }
}

// ---- Accumulator tiles: clearing and storing
// ------------------------------------------------------- Every kernel's fp32 accumulators (scores,
// dP, O, dQ, dK, dV) are arrays of 16 x 8 tiles in the mma layout above; these clear them, and
// store a warp's 16 x 128 output tile to global memory.
template <int kTiles>
__device__ __forceinline__ void ClearAccumulators(float (&acc)[kTiles][4]) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// Zeros as an A operand (a warp with nothing to add still stages its part of a tile).
template <class Op, int kNT>
__device__ __forceinline__ void ClearOperand(AccumulatorA<Op, kNT>& operand) {
#pragma unroll
  for (int kk = 0; kk < AccumulatorA<Op, kNT>::kSteps; ++kk) {
    operand.a[kk][0] = operand.a[kk][1] = operand.a[kk][2] = operand.a[kk][3] = 0u;
  }
}

// A warp's 16 x (8 * kTiles) fp32 tile of one head (the head's width: 16 tiles at head_dim 128),
// rows row_a and row_a + 8 for this thread (row_a = the warp's first row + g), into out[(token0 +
// row) * ld + column0 + column] times `scale`, added to what is there when `add`; rows at or past
// seq_len are skipped.
template <int kTiles>
__device__ __forceinline__ void StoreAccumulatorRows(const float (&acc)[kTiles][4], float* out,
                                                     long long token0, int ld, int column0,
                                                     int row_a, int seq_len, float scale,
                                                     bool add = false) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int half_rows = 0; half_rows < 2; ++half_rows) {
    const int row = row_a + 8 * half_rows;
    if (row >= seq_len) continue;
    float* out_row = out + (token0 + row) * ld + column0 + 2 * t;
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      float2 value = make_float2(acc[n][2 * half_rows] * scale, acc[n][2 * half_rows + 1] * scale);
      if (add) {
        const float2 previous = *reinterpret_cast<const float2*>(out_row + n * 8);
        value.x += previous.x;
        value.y += previous.y;
      }
      *reinterpret_cast<float2*>(out_row + n * 8) = value;
    }
  }
}

// Two tiles of the same rows in one pass, row by row (dK times `first_scale` and dV, unscaled, of
// the dK/dV kernel): the first into `first_out`, the second into `second_out`, same layout.
template <int kTiles>
__device__ __forceinline__ void StoreAccumulatorRowPairs(const float (&first)[kTiles][4],
                                                         float* first_out, float first_scale,
                                                         const float (&second)[kTiles][4],
                                                         float* second_out, long long token0,
                                                         int ld, int column0, int row_a,
                                                         int seq_len) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int half_rows = 0; half_rows < 2; ++half_rows) {
    const int row = row_a + 8 * half_rows;
    if (row >= seq_len) continue;
    const long long offset = (token0 + row) * ld + column0 + 2 * t;
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      *reinterpret_cast<float2*>(first_out + offset + n * 8) = make_float2(
          first[n][2 * half_rows] * first_scale, first[n][2 * half_rows + 1] * first_scale);
      *reinterpret_cast<float2*>(second_out + offset + n * 8) =
          make_float2(second[n][2 * half_rows], second[n][2 * half_rows + 1]);
    }
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

// ---- Warp tile products
// -------------------------------------------------------------------------- acc[16 x 8*kNT] +=
// A[16 x 128] B[8*kNT x 128]^T; A rows [a_row0, +16) of a_tile; B rows [0, 8*kNT). Only the columns
// of acc below n_limit (rounded up to 16) are computed, the rest left untouched (callers pass the
// causal limit: keys past a warp's last query).
template <class Op, int kNT>
__device__ __forceinline__ void WarpProductNk(float (&acc)[kNT][4], const typename Op::Elem* a_tile,
                                              int a_row0, const typename Op::Elem* b_tile,
                                              int n_limit = 8 * kNT) {
#pragma unroll
  for (int k0 = 0; k0 < Op::kHeadDim; k0 += Op::kK) {
    std::uint32_t a[4];
    LoadA<Op>(a, a_tile, a_row0, k0);
#pragma unroll
    for (int n = 0; n < kNT; n += 2) {
      if (n * 8 < n_limit) {
        std::uint32_t b[2][2];
        LoadBnk2<Op>(b, b_tile, n * 8, k0);
        Mma<Op>(acc[n], a, b[0]);
        Mma<Op>(acc[n + 1], a, b[1]);
      }
    }
  }
}

// acc[16 x 8*kOutTiles] += A[16 x 8*kNT] B[8*kNT x 8*kOutTiles]; A from AccumulatorToA, B stored
// [k][n] rows [0, 8*kNT) (kOutTiles = D / 8: the whole head). Only the k-steps below k_limit (A's
// columns past it must be zero).
template <class Op, int kNT, int kOutTiles>
__device__ __forceinline__ void WarpProductKn(float (&acc)[kOutTiles][4],
                                              const AccumulatorA<Op, kNT>& a,
                                              const typename Op::Elem* b_tile,
                                              int k_limit = 8 * kNT) {
#pragma unroll
  for (int ks = 0; ks < AccumulatorA<Op, kNT>::kSteps; ++ks) {
    if (ks * Op::kK < k_limit) {
#pragma unroll
      for (int n = 0; n < kOutTiles; n += 2) {
        std::uint32_t b[2][2];
        LoadBkn2<Op>(b, b_tile, ks * Op::kK, n * 8);
        Mma<Op>(acc[n], a.a[ks], b[0]);
        Mma<Op>(acc[n + 1], a.a[ks], b[1]);
      }
    }
  }
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

// ---- Tile loads (cp.async, 16 bytes per copy; rows >= seq_len are zero-filled)
// ---------------------
__device__ __forceinline__ void CpAsync16(void* shared_destination, const void* global_source,
                                          bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(shared_destination)),
      "l"(global_source), "r"(bytes));
}
// One 4-byte element (zero-filled when !valid), e.g. a row statistic whose address is not 16-byte
// aligned.
__device__ __forceinline__ void CpAsync4(void* shared_destination, const void* global_source,
                                         bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SmemAddress(shared_destination)),
      "l"(global_source), "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Rows [row0, row0 + kRows) of one head (Op::kHeadDim columns at `head_base`, row stride ld) into
// `tile`.
template <class Op, int kRows, int kThreads>
__device__ __forceinline__ void LoadTileAsync(typename Op::Elem* tile,
                                              const typename Op::Elem* head_base, int ld, int row0,
                                              int seq_len) {
  using Elem = typename Op::Elem;
  constexpr int kPerChunk = 16 / sizeof(Elem);
  constexpr int kChunksPerRow = Op::kHeadDim / kPerChunk;
#pragma unroll
  for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, cc = c % kChunksPerRow;
    const int row = row0 + r;
    const bool valid = row < seq_len;
    const Elem* source = head_base + static_cast<long long>(valid ? row : 0) * ld + cc * kPerChunk;
    CpAsync16(tile + r * Op::kPitch + cc * kPerChunk, source, valid);
  }
}

// TF32 mode: round the chunks this thread copied (after its cp.async group completed).
template <class Op, int kRows, int kThreads>
__device__ __forceinline__ void RoundTileTf32(typename Op::Elem* tile) {
  if constexpr (Op::kRoundTf32) {
    constexpr int kChunksPerRow = Op::kHeadDim / 4;
#pragma unroll
    for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, cc = c % kChunksPerRow;
      float4* address = reinterpret_cast<float4*>(tile + r * Op::kPitch + cc * 4);
      float4 v = *address;
      v.x = __uint_as_float(RoundToTf32(v.x));
      v.y = __uint_as_float(RoundToTf32(v.y));
      v.z = __uint_as_float(RoundToTf32(v.z));
      v.w = __uint_as_float(RoundToTf32(v.w));
      *address = v;
    }
  }
}

template <class Op>
__device__ __forceinline__ float ElemToFloat(typename Op::Elem x) {
  if constexpr (Op::kIsFp16) {
    return __half2float(x);
  } else {
    return x;
  }
}

// Work item of a 1-D grid of num_tiles * num_heads * batch blocks, heaviest tiles first (causal
// load balance): heavy_last means the last tile index has the most work.
struct WorkItem {
  int tile, head, batch;
};
__device__ __forceinline__ WorkItem DecodeBlock(int num_tiles, int num_heads, int batch,
                                                bool heavy_last) {
  const int per_rank = num_heads * batch;
  const int block = static_cast<int>(blockIdx.x);
  const int rank = block / per_rank, rest = block % per_rank;
  WorkItem item;
  item.head = rest % num_heads;
  item.batch = rest / num_heads;
  item.tile = heavy_last ? num_tiles - 1 - rank : rank;
  return item;
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

// ---- Host-side argument checks shared by the forward and the backward ---------------------------
inline bool Aligned16(const void* pointer) {
  return (reinterpret_cast<std::uintptr_t>(pointer) & 15u) == 0;
}

// AttentionParams::window of a problem: its sliding window, or seq_len for none (or one as long).
inline int EffectiveWindow(const AttentionProblem& problem) {
  return problem.sliding_window > 0 && problem.sliding_window < problem.seq_len
             ? problem.sliding_window
             : problem.seq_len;
}

inline int ElementBytes(AttentionOperand operand) {
  return operand == AttentionOperand::kFp16 ? 2 : 4;
}

// Checks the shape, the scalars and the q/k/v operands (non-null, 16-byte aligned, row strides that
// keep every row 16-byte aligned and wide enough), and fills the common part of the parameters.
inline attngrad_status MakeParams(const AttentionProblem& problem, const void* q, int ldq,
                                  const void* k, const void* v, int ldkv, AttentionParams* params) {
  if (problem.batch < 1 || problem.seq_len < 1 || problem.num_heads < 1 ||
      problem.num_kv_heads < 1 || problem.num_heads % problem.num_kv_heads != 0) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  if (!std::isfinite(problem.scaling) || !std::isfinite(problem.softcap) || problem.softcap < 0.f ||
      problem.sliding_window < 0) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  if (problem.head_dim != 128 && problem.head_dim != 256) return ATTNGRAD_UNSUPPORTED;
  if (problem.operand != AttentionOperand::kFp16 && problem.operand != AttentionOperand::kTf32 &&
      problem.operand != AttentionOperand::kFp32) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  const int per_16_bytes = 16 / ElementBytes(problem.operand);
  if (q == nullptr || k == nullptr || v == nullptr || !Aligned16(q) || !Aligned16(k) ||
      !Aligned16(v) || ldq < problem.num_heads * problem.head_dim ||
      ldkv < problem.num_kv_heads * problem.head_dim || ldq % per_16_bytes != 0 ||
      ldkv % per_16_bytes != 0) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  params->q = q;
  params->k = k;
  params->v = v;
  params->ldq = ldq;
  params->ldkv = ldkv;
  params->batch = problem.batch;
  params->seq_len = problem.seq_len;
  params->num_heads = problem.num_heads;
  params->num_kv_heads = problem.num_kv_heads;
  params->group = problem.num_heads / problem.num_kv_heads;
  params->head_dim = problem.head_dim;
  params->window = EffectiveWindow(problem);
  params->scaling = problem.scaling;
  params->has_cap = problem.softcap > 0.f;
  params->score_scale =
      params->has_cap ? problem.scaling / problem.softcap : problem.scaling * kLog2e;
  params->cap_log2e = params->has_cap ? problem.softcap * kLog2e : 0.f;
  return ATTNGRAD_OK;
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
