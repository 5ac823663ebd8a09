// Warp-level tensor-core building blocks of the mma.sync attention kernels: fragment loads from
// padded shared-memory tiles, the mma itself per operand mode, accumulator tiles (clearing,
// conversion to an A operand, stores to global memory) and the warp tile products. Internal to
// kernels/.
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
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_MMA_FRAGMENTS_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_MMA_FRAGMENTS_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention_operand_traits.cuh"

namespace attngrad::cuda::attention_detail {

// ---- mma ----------------------------------------------------------------------------------------
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

// ---- Fragment loads from shared memory (tiles of Op::kHeadDim columns, row pitch Op::kPitch) ---
// A: rows [row0, row0 + 16), k-step at k0, stored [row][k].
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

// ---- Accumulator tiles: clearing and storing ----------------------------------------------------
// Every kernel's fp32 accumulators (scores, dP, O, dQ, dK, dV) are arrays of 16 x 8 tiles in the
// mma layout above; these clear them, and store a warp's 16 x 128 output tile to global memory.
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

// ---- Warp tile products ------------------------------------------------------------------------
// acc[16 x 8*kNT] += A[16 x 128] B[8*kNT x 128]^T; A rows [a_row0, +16) of a_tile; B rows
// [0, 8*kNT). Only the columns of acc below n_limit (rounded up to 16) are computed, the rest left
// untouched (callers pass the causal limit: keys past a warp's last query).
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

}  // namespace attngrad::cuda::attention_detail

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_MMA_FRAGMENTS_CUH_
