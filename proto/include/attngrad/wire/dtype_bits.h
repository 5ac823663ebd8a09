// fp32 <-> fp16/bf16 on bit patterns, written once for the host (attngrad/wire/dtype.h's
// HalfToFloat, FloatToHalf, BFloat16ToFloat, FloatToBFloat16) and for CUDA device code (the
// server's GPU worker converts wire tensors on the device with these same functions, so an answer
// has the same bits whichever backend encoded it). Round to nearest, ties to even; overflow to
// +-Inf; Inf kept; a NaN stays a quiet NaN of the same sign with the payload's top bits; fp16
// subnormals exact. Header-only, no dependencies.
#ifndef ATTNGRAD_WIRE_DTYPE_BITS_H_
#define ATTNGRAD_WIRE_DTYPE_BITS_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ATTNGRAD_WIRE_HOST_DEVICE __host__ __device__
#else
#define ATTNGRAD_WIRE_HOST_DEVICE
#endif

namespace attngrad::wire::bits {

constexpr std::uint32_t kFloatExponentMask = 0x7f800000u;  // also +Inf
constexpr std::uint32_t kHalfInfinity = 0x7c00u;
constexpr std::uint32_t kHalfQuietBit = 0x0200u;
constexpr std::uint32_t kBFloat16QuietBit = 0x0040u;

// value >> shift (shift in 1..31), rounded to nearest, ties to even. A carry out of the kept bits
// moves into the exponent field above them, which is what makes the largest finite values round
// to infinity and the largest subnormals to the smallest normal.
ATTNGRAD_WIRE_HOST_DEVICE inline std::uint32_t ShiftRightRoundingToEven(std::uint32_t value,
                                                                        int shift) {
  const std::uint32_t kept = value >> shift;
  const std::uint32_t remainder = value & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1);
  const bool round_up = remainder > halfway || (remainder == halfway && (kept & 1u) != 0);
  return kept + (round_up ? 1u : 0u);
}

// binary16 bits -> binary32 bits (exact).
ATTNGRAD_WIRE_HOST_DEVICE inline std::uint32_t HalfToFloatBits(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1fu;
  std::uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) return sign | kFloatExponentMask | (mantissa << 13);  // Inf, NaN
  if (exponent != 0) return sign | ((exponent + 112) << 23) | (mantissa << 13);
  if (mantissa == 0) return sign;  // +-0
  // Subnormal (mantissa * 2^-24): shift the leading one into the implicit bit.
  int shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= 0x3ffu;
  return sign | (static_cast<std::uint32_t>(113 - shift) << 23) | (mantissa << 13);
}

// binary32 bits -> binary16 bits.
ATTNGRAD_WIRE_HOST_DEVICE inline std::uint16_t FloatBitsToHalf(std::uint32_t value) {
  const std::uint32_t sign = (value >> 16) & 0x8000u;
  const std::uint32_t magnitude = value & 0x7fffffffu;
  std::uint32_t result;
  if (magnitude > kFloatExponentMask) {  // NaN: the payload's top bits, made quiet
    result = kHalfInfinity | kHalfQuietBit | ((magnitude >> 13) & 0x3ffu);
  } else if (magnitude >= 0x47800000u) {  // >= 2^16 (and Inf): beyond any rounding to 65504
    result = kHalfInfinity;
  } else if (magnitude >= 0x38800000u) {  // normal half (>= 2^-14): rebias the exponent by -112
    result = ShiftRightRoundingToEven(magnitude - 0x38000000u, 13);
  } else if (magnitude >= 0x33000000u) {             // subnormal half: units of 2^-24
    const std::uint32_t exponent = magnitude >> 23;  // 102..112
    const std::uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
    result = ShiftRightRoundingToEven(significand, static_cast<int>(126 - exponent));
  } else {  // at most half the smallest subnormal: rounds to zero
    result = 0;
  }
  return static_cast<std::uint16_t>(sign | result);
}

// bfloat16 bits (the top half of a binary32) -> binary32 bits (exact).
ATTNGRAD_WIRE_HOST_DEVICE inline std::uint32_t BFloat16ToFloatBits(std::uint16_t bfloat16) {
  return static_cast<std::uint32_t>(bfloat16) << 16;
}

// binary32 bits -> bfloat16 bits.
// Branch-free (both results computed, one selected), so that a loop of it vectorizes on the host:
// the client's bf16 requests go through it. Adding 0x7fff plus the lowest kept bit and shifting is
// ShiftRightRoundingToEven(value, 16).
ATTNGRAD_WIRE_HOST_DEVICE inline std::uint16_t FloatBitsToBFloat16(std::uint32_t value) {
  const std::uint32_t rounded = (value + 0x7fffu + ((value >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (value >> 16) | kBFloat16QuietBit;  // the payload's top bits
  const bool nan = (value & 0x7fffffffu) > kFloatExponentMask;
  return static_cast<std::uint16_t>(nan ? quiet_nan : rounded);
}

// The bits of an fp32 value and back (host).
inline std::uint32_t BitsOfFloat(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float FloatOfBits(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace attngrad::wire::bits

#endif  // ATTNGRAD_WIRE_DTYPE_BITS_H_
