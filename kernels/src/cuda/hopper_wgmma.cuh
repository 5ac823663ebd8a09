// Hopper (sm_90a) building blocks of the attention kernels (SPEC section 2 steps 4 and 6):
// warpgroup matrix products (wgmma.mma_async) on fp16 operands with fp32 accumulators, the
// 128-byte-swizzled shared-memory tile layout they read and its cp.async writer, the 64-bit
// shared-memory matrix descriptor, the async-group fences, and the accumulator -> A-operand
// conversion (P or dS as an fp16 register operand). Internal to kernels/.
//
// Only the sm_90a device compilation has these instructions: device code that uses them is guarded
// by ATTNGRAD_HOPPER_WGMMA (defined below for that compilation alone; the sm_100a and compute_100a
// passes of the build see no wgmma and keep the mma.sync kernels). The layout helpers and the
// descriptor arithmetic compile everywhere.
//
// Swizzled tile (kRows x kCols fp16, kCols a multiple of 64; its base 1024-byte aligned): kCols /
// 64 column blocks ("atoms") stored one after another, each kRows rows of 128 bytes; the 16-byte
// chunk c (columns 8c..8c+7 of the atom) of row r sits at chunk position c ^ (r % 8). The same
// bytes serve as a K-major operand (rows = M or N, columns = K: Q, K, dO of S = Q K^T, dP = dO V^T)
// and as an MN-major one (rows = K, columns = N: V of O = P V, or any [k][n] row-major tile).
//
// Accumulator layout (fp32, m64nN): warp w of the warpgroup owns rows 16w..16w+15; with g = lane /
// 4 and t = lane % 4, d[n][0..1] = (row 16w + g, columns 8n + 2t, 8n + 2t + 1) and d[n][2..3] =
// (row 16w + g + 8, the same columns): the mma.sync m16n8 layout of attention_mma_fragments.cuh,
// per warp. The register A operand of m64nNk16 (4 x f16x2) has the mma.sync m16n8k16 A layout, per
// warp.
//
// Order of use (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): registers an
// in-flight wgmma reads or writes (its accumulators, its register A) are not touched before the
// WgmmaWait that retires it; WgmmaFence() before the first wgmma after such registers were written
// by other instructions; shared memory written by ordinary stores needs FenceProxyAsync() in the
// writing threads and a barrier before a wgmma reads it (cp.async writes are fenced the same way).
#ifndef ATTNGRAD_KERNELS_CUDA_HOPPER_WGMMA_CUH_
#define ATTNGRAD_KERNELS_CUDA_HOPPER_WGMMA_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNGRAD_HOPPER_WGMMA 1
#endif

namespace attngrad::cuda::hopper {

// ---- Swizzled tile layout
// ------------------------------------------------------------------------
template <int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "a swizzled tile is made of 64-column atoms");
  static_assert(kRows % 8 == 0, "a swizzled tile is made of 8-row groups");
  static constexpr int kAtoms = kCols / 64;
  static constexpr int kAtomBytes = kRows * 128;  // one 64-column block of all rows
  static constexpr int kBytes = kAtoms * kAtomBytes;
  static constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks

  // Byte offset of element (row, col) from the tile's base.
  __host__ __device__ static constexpr std::uint32_t Offset(int row, int col) {
    return static_cast<std::uint32_t>((col / 64) * kAtomBytes + row * 128 +
                                      ((((col % 64) / 8) ^ (row % 8)) * 16) + (col % 8) * 2);
  }
  // Byte offset of the 16-byte chunk `chunk` (columns 8 chunk .. 8 chunk + 7) of row `row`.
  __host__ __device__ static constexpr std::uint32_t ChunkOffset(int row, int chunk) {
    return static_cast<std::uint32_t>((chunk / 8) * kAtomBytes + row * 128 +
                                      (((chunk % 8) ^ (row % 8)) * 16));
  }
};

__device__ __forceinline__ std::uint32_t SharedAddress(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// Rows [row0, row0 + kRows) of a row-major fp16 matrix (kCols columns from `base`, row stride `ld`
// elements) into the swizzled tile at shared address `tile`, 16 bytes per cp.async by the kThreads
// threads of the block (thread = threadIdx.x); rows at or past `row_end` are zero-filled (row 0
// is named as their source, and not read). The caller commits and waits (CpAsyncCommit /
// CpAsyncWait of attention_tile_loads.cuh, or its own).
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void LoadSwizzledTileAsync(std::uint32_t tile, const __half* base,
                                                      long long ld, int row0, int row_end,
                                                      int thread) {
  using Tile = SwizzledTile<kRows, kCols>;
  constexpr int kChunks = kRows * Tile::kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int c = thread + i * kThreads;
    if (kChunks % kThreads != 0 && c >= kChunks) break;
    const int r = c / Tile::kChunksPerRow, chunk = c % Tile::kChunksPerRow;
    const int row = row0 + r;
    const bool valid = row < row_end;
    const __half* source = base + static_cast<long long>(valid ? row : 0) * ld + chunk * 8;
    asm volatile(
        "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tile + Tile::ChunkOffset(r, chunk)),
        "l"(source), "r"(valid ? 16 : 0)
        : "memory");
  }
}

// ---- Shared-memory matrix descriptor
// ------------------------------------------------------------- Bits 0-13: start address / 16;
// 16-29: leading-dimension byte offset / 16; 32-45: stride-dimension byte offset / 16; 62-63:
// swizzle mode (1 = 128-byte swizzle). The base offset (bits 49-51) stays 0: tiles are 1024-byte
// aligned and a descriptor's start moves only within that pattern's frame.
__host__ __device__ constexpr std::uint64_t MatrixDescriptor(std::uint32_t address,
                                                             std::uint32_t leading_bytes,
                                                             std::uint32_t stride_bytes) {
  return static_cast<std::uint64_t>((address & 0x3FFFF) >> 4) |
         (static_cast<std::uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<std::uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// K-major operand (a tile [rows][K]): the 16 columns of k-step `k_step` (K = 16 k_step ..), rows
// from `row0` (a multiple of 8; an A operand covers 64 rows, a B operand N rows). 8-row groups are
// 1024 bytes apart; the leading offset is unused with this swizzle (one k-step lies inside an
// atom).
template <int kRows, int kCols>
__host__ __device__ constexpr std::uint64_t KMajorDescriptor(std::uint32_t tile, int row0,
                                                             int k_step) {
  return MatrixDescriptor(
      tile + (k_step / 4) * SwizzledTile<kRows, kCols>::kAtomBytes + row0 * 128 + (k_step % 4) * 32,
      16, 1024);
}

// MN-major operand (a tile [K][N], row-major: V of O = P V, dO of dV = P^T dO): the 16 rows of
// k-step `k_step`, columns from `col0` (a multiple of 64). 64-column atoms are kAtomBytes apart
// (leading offset), 8-row groups along K 1024 bytes (stride offset). Use with kTrans = 1.
template <int kRows, int kCols>
__host__ __device__ constexpr std::uint64_t MnMajorDescriptor(std::uint32_t tile, int k_step,
                                                              int col0 = 0) {
  return MatrixDescriptor(
      tile + (col0 / 64) * SwizzledTile<kRows, kCols>::kAtomBytes + k_step * 16 * 128,
      SwizzledTile<kRows, kCols>::kAtomBytes, 1024);
}

// ---- Fences and async groups
// ---------------------------------------------------------------------
#if defined(ATTNGRAD_HOPPER_WGMMA)
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed groups of this warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written through the generic proxy (st.shared, cp.async) made visible to the async
// proxy (wgmma operands, bulk copies); each writing thread, before the barrier.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8 x 8 fp16 matrices from registers into shared memory (stmatrix .x4): register j of lane i
// holds row i / 4, columns 2 (i % 4) and + 1 of matrix j (the mma fragment layout); lanes 8 j ..
// 8 j + 7 give the shared addresses of matrix j's rows 0..7 (16 bytes each).
__device__ __forceinline__ void StoreMatrices(std::uint32_t row_address,
                                              const std::uint32_t (&registers)[4]) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_address),
      "r"(registers[0]), "r"(registers[1]), "r"(registers[2]), "r"(registers[3])
      : "memory");
}

// Bulk copies from shared to global memory (cp.async.bulk, one thread issues, `bytes` a multiple
// of 16, both addresses 16-byte aligned): the shared bytes are read by the async proxy (write them
// with FenceProxyAsync and a barrier before), and BulkWaitRead<n> returns once at most n of the
// issuing thread's committed groups still read their source; BulkWait<n> once at most n are
// unfinished (their global writes done).
__device__ __forceinline__ void BulkCopyToGlobal(void* global, std::uint32_t shared, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(global),
               "r"(shared), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BulkCommit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void BulkWait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
#endif  // ATTNGRAD_HOPPER_WGMMA

// Keeps the compiler from moving accumulator registers across an async wgmma (no instruction: an
// empty asm that claims to read and write each register).
template <int kTiles>
__device__ __forceinline__ void FenceAccumulators(float (&d)[kTiles][4]) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    asm volatile("" : "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])::"memory");
  }
}
template <int kSteps>
__device__ __forceinline__ void FenceOperand(std::uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    asm volatile("" : "+r"(a[k][0]), "+r"(a[k][1]), "+r"(a[k][2]), "+r"(a[k][3])::"memory");
  }
}

template <int kTiles>
__device__ __forceinline__ void ClearAccumulator(float (&d)[kTiles][4]) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
}

// The fp32 accumulator of 64 x (8 kTiles) (P, dS) as the fp16 register A operand of kTiles / 2
// k-steps, each pair of values packed by `pack` (low, high) -> 32 bits: a[k] feeds the product
// over columns 16k..16k+15 of the accumulator.
template <int kTiles, class Pack>
__device__ __forceinline__ void PackOperand(const float (&c)[kTiles][4],
                                            std::uint32_t (&a)[kTiles / 2][4], Pack pack) {
  static_assert(kTiles % 2 == 0, "k-steps of 16 columns");
#pragma unroll
  for (int k = 0; k < kTiles / 2; ++k) {
    a[k][0] = pack(c[2 * k][0], c[2 * k][1]);
    a[k][1] = pack(c[2 * k][2], c[2 * k][3]);
    a[k][2] = pack(c[2 * k + 1][0], c[2 * k + 1][1]);
    a[k][3] = pack(c[2 * k + 1][2], c[2 * k + 1][3]);
  }
}

// The accumulator times `scale`, rounded to nearest fp16.
template <int kTiles>
__device__ __forceinline__ void AccumulatorToOperand(const float (&c)[kTiles][4], float scale,
                                                     std::uint32_t (&a)[kTiles / 2][4]) {
  PackOperand(c, a, [scale](float low, float high) {
    const __half2 h = __floats2half2_rn(low * scale, high * scale);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  });
}

// The accumulator without a scale, each value rounded to fp16 and saturated to its finite range by
// the conversion itself (cvt.rn.satfinite.f16x2.f32: beyond +-65504, infinities included, gives
// +-65504; NaN stays NaN): dS as an operand with attention_softmax.cuh's ClampGradient folded into
// the conversion instead of two instructions per element before it.
template <int kTiles>
__device__ __forceinline__ void AccumulatorToSaturatedOperand(const float (&c)[kTiles][4],
                                                              std::uint32_t (&a)[kTiles / 2][4]) {
  PackOperand(c, a, [](float low, float high) {
    std::uint32_t packed;  // `high` goes to the upper half
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
  });
}

// ---- wgmma.mma_async m64nNk16, fp16 x fp16 -> fp32
// ----------------------------------------------- Wgmma<N>::SharedShared<kTransA, kTransB>(d,
// desc_a, desc_b, accumulate): d[64 x N] (+)= A[64 x 16] B[16 x N], A and B from shared memory
// through descriptors (kTrans = 0: K-major, 1: MN-major). Wgmma<N>::RegisterShared<kTransB>(d, a,
// desc_b, accumulate): A from registers (AccumulatorToOperand or a fragment load). accumulate = 0
// overwrites d (d = A B). Issued by all 128 threads of a warpgroup (4 consecutive warps from a warp
// index divisible by 4); asynchronous: WgmmaCommit, then WgmmaWait before d is read. N = 16, 32,
// 64, 96, 128, 192 or 256 (one ATTNGRAD_DEFINE_WGMMA line each below).
template <int N>
struct Wgmma;

#if defined(ATTNGRAD_HOPPER_WGMMA)
// The accumulator operands of one thread: rows i, i + 1, ... of d, four floats each.
#define ATTNGRAD_WGMMA_ROW(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define ATTNGRAD_WGMMA_ROWS2(d, i) ATTNGRAD_WGMMA_ROW(d, i), ATTNGRAD_WGMMA_ROW(d, i + 1)
#define ATTNGRAD_WGMMA_ROWS4(d, i) ATTNGRAD_WGMMA_ROWS2(d, i), ATTNGRAD_WGMMA_ROWS2(d, i + 2)
#define ATTNGRAD_WGMMA_ROWS8(d, i) ATTNGRAD_WGMMA_ROWS4(d, i), ATTNGRAD_WGMMA_ROWS4(d, i + 4)
#define ATTNGRAD_WGMMA_ROWS16(d, i) ATTNGRAD_WGMMA_ROWS8(d, i), ATTNGRAD_WGMMA_ROWS8(d, i + 8)
#define ATTNGRAD_WGMMA_ROWS32(d, i) ATTNGRAD_WGMMA_ROWS16(d, i), ATTNGRAD_WGMMA_ROWS16(d, i + 16)
#define ATTNGRAD_WGMMA_STRING(x) #x

// Wgmma<N> for one N: kRows = N / 8 accumulator rows of 4 per thread, REGISTERS the PTX list of
// the N / 2 accumulator operands ("{%0, ..., %(N/2 - 1)}"), C = N / 2 the number of the first
// operand after them (SharedShared: desc_a C, desc_b C + 1, accumulate C + 2, the transposes C + 3
// and C + 4; RegisterShared: a C..C + 3, desc_b C + 4, accumulate C + 5, kTransB C + 6: written
// out as C0..C6), then the operand list of d.
#define ATTNGRAD_DEFINE_WGMMA(N, ROWS, REGISTERS, C0, C1, C2, C3, C4, C5, C6, ...)                     \
  template <>                                                                                          \
  struct Wgmma<N> {                                                                                    \
    template <int kTransA, int kTransB>                                                                \
    __device__ __forceinline__ static void SharedShared(float (&d)[ROWS][4], std::uint64_t desc_a,     \
                                                        std::uint64_t desc_b, int accumulate) {        \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ATTNGRAD_WGMMA_STRING(C2) ", 0;\n"           \
                   "wgmma.mma_async.sync.aligned.m64n" ATTNGRAD_WGMMA_STRING(N) "k16.f32.f16.f16 "    \
                   REGISTERS ", %" ATTNGRAD_WGMMA_STRING(C0) ", %" ATTNGRAD_WGMMA_STRING(C1)        \
                   ", p, 1, 1, %" ATTNGRAD_WGMMA_STRING(C3) ", %" ATTNGRAD_WGMMA_STRING(C4) ";\n}\n" \
                   : __VA_ARGS__                                                                  \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB)); \
    }                                                                                                  \
    template <int kTransB>                                                                             \
    __device__ __forceinline__ static void RegisterShared(float (&d)[ROWS][4],                         \
                                                          const std::uint32_t (&a)[4],                 \
                                                          std::uint64_t desc_b, int accumulate) {      \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ATTNGRAD_WGMMA_STRING(C5) ", 0;\n"           \
                   "wgmma.mma_async.sync.aligned.m64n" ATTNGRAD_WGMMA_STRING(N) "k16.f32.f16.f16 "    \
                   REGISTERS ", {%" ATTNGRAD_WGMMA_STRING(C0) ", %" ATTNGRAD_WGMMA_STRING(C1)       \
                   ", %" ATTNGRAD_WGMMA_STRING(C2) ", %" ATTNGRAD_WGMMA_STRING(C3) "}, %"           \
                   ATTNGRAD_WGMMA_STRING(C4) ", p, 1, 1, %" ATTNGRAD_WGMMA_STRING(C6) ";\n}\n"      \
                   : __VA_ARGS__                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate),     \
                     "n"(kTransB)); \
    }                                                                                                  \
  };

ATTNGRAD_DEFINE_WGMMA(16, 2, "{%0, %1, %2, %3, %4, %5, %6, %7}", 8, 9, 10, 11, 12, 13, 14,
                      ATTNGRAD_WGMMA_ROWS2(d, 0))
ATTNGRAD_DEFINE_WGMMA(32, 4,
                      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}", 16,
                      17, 18, 19, 20, 21, 22, ATTNGRAD_WGMMA_ROWS4(d, 0))
ATTNGRAD_DEFINE_WGMMA(
    64, 8,
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}",
    32, 33, 34, 35, 36, 37, 38, ATTNGRAD_WGMMA_ROWS8(d, 0))
ATTNGRAD_DEFINE_WGMMA(
    96, 12,
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}",
    48, 49, 50, 51, 52, 53, 54, ATTNGRAD_WGMMA_ROWS8(d, 0), ATTNGRAD_WGMMA_ROWS4(d, 8))
ATTNGRAD_DEFINE_WGMMA(
    128, 16,
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}",
    64, 65, 66, 67, 68, 69, 70, ATTNGRAD_WGMMA_ROWS16(d, 0))
ATTNGRAD_DEFINE_WGMMA(
    192, 24,
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, "
    "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}",
    96, 97, 98, 99, 100, 101, 102, ATTNGRAD_WGMMA_ROWS16(d, 0), ATTNGRAD_WGMMA_ROWS8(d, 16))
ATTNGRAD_DEFINE_WGMMA(
    256, 32,
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, "
    "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, "
    "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "
    "%125, %126, %127}",
    128, 129, 130, 131, 132, 133, 134, ATTNGRAD_WGMMA_ROWS32(d, 0))

#undef ATTNGRAD_DEFINE_WGMMA
#undef ATTNGRAD_WGMMA_STRING
#undef ATTNGRAD_WGMMA_ROWS32
#undef ATTNGRAD_WGMMA_ROWS16
#undef ATTNGRAD_WGMMA_ROWS8
#undef ATTNGRAD_WGMMA_ROWS4
#undef ATTNGRAD_WGMMA_ROWS2
#undef ATTNGRAD_WGMMA_ROW

#endif  // ATTNGRAD_HOPPER_WGMMA

}  // namespace attngrad::cuda::hopper

#endif  // ATTNGRAD_KERNELS_CUDA_HOPPER_WGMMA_CUH_
