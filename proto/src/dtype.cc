// Wire dtype sizes and names, and fp32 <-> fp16/bf16 by bit manipulation (no compiler extensions,
// so that it builds and gives the same bits everywhere).
#include "attngrad/wire/dtype.h"

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace attngrad::wire {
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

// value >> shift (shift in 1..31), rounded to nearest, ties to even. A carry out of the kept bits
// moves into the exponent field above them, which is what makes the largest finite values round
// to infinity and the largest subnormals to the smallest normal.
std::uint32_t ShiftRightRoundingToEven(std::uint32_t value, int shift) {
  const std::uint32_t kept = value >> shift;
  const std::uint32_t remainder = value & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1);
  const bool round_up = remainder > halfway || (remainder == halfway && (kept & 1u) != 0);
  return kept + (round_up ? 1u : 0u);
}

constexpr std::uint32_t kFloatExponentMask = 0x7f800000u;  // also +Inf
constexpr std::uint32_t kHalfInfinity = 0x7c00u;
constexpr std::uint32_t kHalfQuietBit = 0x0200u;
constexpr std::uint32_t kBFloat16QuietBit = 0x0040u;

}  // namespace

std::size_t DTypeSize(int dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return 4;
    case v1::DTYPE_FLOAT16:
    case v1::DTYPE_BFLOAT16: return 2;
    default: return 0;
  }
}

bool IsSupportedDType(int dtype) { return DTypeSize(dtype) != 0; }

std::string DTypeName(int dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return "float32";
    case v1::DTYPE_FLOAT16: return "float16";
    case v1::DTYPE_BFLOAT16: return "bfloat16";
    case v1::DTYPE_UNSPECIFIED: return "unspecified";
    default: return absl::StrCat("dtype ", dtype);
  }
}

absl::StatusOr<v1::DType> ParseDTypeName(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "float32" || lower == "fp32") return v1::DTYPE_FLOAT32;
  if (lower == "float16" || lower == "fp16") return v1::DTYPE_FLOAT16;
  if (lower == "bfloat16" || lower == "bf16") return v1::DTYPE_BFLOAT16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype must be float32, float16 or bfloat16, got '", name, "'"));
}

float HalfToFloat(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return FloatOf(sign | kFloatExponentMask | (mantissa << 13));  // Inf, NaN
  if (exponent != 0) return FloatOf(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return FloatOf(sign);  // +-0
  // Subnormal (mantissa * 2^-24): shift the leading one into the implicit bit.
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
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t magnitude = bits & 0x7fffffffu;
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

float BFloat16ToFloat(std::uint16_t bits) {
  return FloatOf(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t FloatToBFloat16(float value) {
  const std::uint32_t bits = BitsOf(value);
  if ((bits & 0x7fffffffu) > kFloatExponentMask) {  // NaN: the payload's top bits, made quiet
    return static_cast<std::uint16_t>((bits >> 16) | kBFloat16QuietBit);
  }
  return static_cast<std::uint16_t>(ShiftRightRoundingToEven(bits, 16));
}

}  // namespace attngrad::wire
