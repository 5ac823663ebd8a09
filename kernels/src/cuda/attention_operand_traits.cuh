// Operand traits of the flash-style attention kernels (attention_forward*.cu,
// attention_backward*.cu): one per AttentionOperand mode and head dimension (element type, k per
// tensor-core step, shared-memory row pitch, rounding and soft-cap arithmetic), and the element
// conversions that go with them. Internal to kernels/.
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_OPERAND_TRAITS_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_OPERAND_TRAITS_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace attngrad::cuda::attention_detail {

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

// Shared-memory address of a generic pointer into shared memory (what ldmatrix and cp.async take).
__device__ __forceinline__ std::uint32_t SmemAddress(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// fp32 -> tf32 (round to nearest, ties away), as the TF32 tensor cores would read it.
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

// Two floats as one fp16x2 register (round to nearest).
__device__ __forceinline__ std::uint32_t PackHalf2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&h);
}

// One element of an operand tile as fp32.
template <class Op>
__device__ __forceinline__ float ElemToFloat(typename Op::Elem x) {
  if constexpr (Op::kIsFp16) {
    return __half2float(x);
  } else {
    return x;
  }
}

}  // namespace attngrad::cuda::attention_detail

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_OPERAND_TRAITS_CUH_
