// Tile loads of the mma.sync attention kernels: cp.async copies of 16 (or 4) bytes, their groups,
// a head's rows into a padded shared-memory tile (rows at or past seq_len zero-filled), and the
// TF32 mode's rounding of a loaded tile. Internal to kernels/.
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_TILE_LOADS_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_TILE_LOADS_CUH_

#include <cuda_runtime.h>

#include "cuda/attention_operand_traits.cuh"

namespace attngrad::cuda::attention_detail {

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

}  // namespace attngrad::cuda::attention_detail

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_TILE_LOADS_CUH_
