// fp16/bf16 <-> fp32 by bit manipulation (no compiler extensions, so it builds everywhere).
#include "half_float.h"

#include <cstring>

namespace attngrad::server {
namespace {

std::uint32_t BitsOf(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float FloatOf(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace

float HalfToFloat(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1fu;
  std::uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) return FloatOf(sign | 0x7f800000u | (mantissa << 13));  // Inf / NaN
  if (exponent != 0) return FloatOf(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return FloatOf(sign);  // +-0
  // Subnormal: normalise.
  int shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= 0x3ffu;
  return FloatOf(sign | (static_cast<std::uint32_t>(113 - shift) << 23) | (mantissa << 13));
}

std::uint16_t FloatToHalf(float value) {
  const std::uint32_t bits = BitsOf(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) {  // Inf or NaN (keep NaN quiet and non-zero)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs_bits > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs_bits >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow
  if (abs_bits < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (abs_bits < 0x33000000u) return sign;  // below half of the smallest subnormal: +-0
    const std::uint32_t exponent = abs_bits >> 23;
    const std::uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(exponent);  // 14..24
    std::uint32_t result = mantissa >> shift;
    const std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  // Normal: rebias the exponent, round the mantissa to 10 bits (carry may bump the exponent).
  std::uint32_t result = ((abs_bits - 0x38000000u) >> 13);
  const std::uint32_t remainder = abs_bits & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return static_cast<std::uint16_t>(sign | result);
}

float BFloat16ToFloat(std::uint16_t bits) { return FloatOf(static_cast<std::uint32_t>(bits) << 16); }

std::uint16_t FloatToBFloat16(float value) {
  const std::uint32_t bits = BitsOf(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

}  // namespace attngrad::server
