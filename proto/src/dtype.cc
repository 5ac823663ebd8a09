// Wire dtype sizes and names, and fp32 <-> fp16/bf16 by bit manipulation (dtype_bits.h: no
// compiler extensions, so that it builds and gives the same bits everywhere, the GPU included).
#include "attngrad/wire/dtype.h"

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "attngrad/wire/dtype_bits.h"

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

float HalfToFloat(std::uint16_t half) { return FloatOf(bits::HalfToFloatBits(half)); }

std::uint16_t FloatToHalf(float value) { return bits::FloatBitsToHalf(BitsOf(value)); }

float BFloat16ToFloat(std::uint16_t bfloat16) {
  return FloatOf(bits::BFloat16ToFloatBits(bfloat16));
}

std::uint16_t FloatToBFloat16(float value) { return bits::FloatBitsToBFloat16(BitsOf(value)); }

}  // namespace attngrad::wire
