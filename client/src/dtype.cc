// Wire dtype conversions (fp32 / IEEE fp16 / bfloat16, little-endian) and v1.Tensor packing.
#include "dtype.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attngrad {
namespace {

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float BitsFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace

int64_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return 4;
    case v1::DTYPE_FLOAT16:
    case v1::DTYPE_BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

absl::string_view DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return "float32";
    case v1::DTYPE_FLOAT16:
      return "float16";
    case v1::DTYPE_BFLOAT16:
      return "bfloat16";
    default:
      return "unspecified";
  }
}

float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToHalf(float value) {
  const uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs_bits > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs_bits < 0x38800000u) {
    // Subnormal or zero in fp16: round |value| * 2^24 to nearest even.
    const float scaled = std::fabs(value) * 16777216.0f;
    const auto rounded = static_cast<uint16_t>(std::nearbyint(scaled));
    return static_cast<uint16_t>(sign | rounded);
  }
  // Normal: rebias exponent, round mantissa to 10 bits (nearest even).
  const uint32_t mantissa_round = abs_bits + 0x0fffu + ((abs_bits >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((mantissa_round - 0x38000000u) >> 13));
}

float BFloat16ToFloat(uint16_t value) { return BitsFloat(static_cast<uint32_t>(value) << 16); }

uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

void EncodeFloats(absl::Span<const float> values, v1::DType dtype, std::string* out) {
  const size_t start = out->size();
  if (dtype == v1::DTYPE_FLOAT16 || dtype == v1::DTYPE_BFLOAT16) {
    out->resize(start + values.size() * 2);
    char* dst = out->data() + start;
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t h =
          dtype == v1::DTYPE_FLOAT16 ? FloatToHalf(values[i]) : FloatToBFloat16(values[i]);
      dst[2 * i] = static_cast<char>(h & 0xff);
      dst[2 * i + 1] = static_cast<char>(h >> 8);
    }
    return;
  }
  // fp32: the host is little-endian (x86-64, aarch64), so the bytes are copied as they are.
  out->resize(start + values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(out->data() + start, values.data(), values.size() * sizeof(float));
}

absl::Status DecodeFloats(absl::string_view bytes, v1::DType dtype, absl::Span<float> out) {
  const int64_t element = DTypeSize(dtype);
  if (element == 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(dtype)));
  }
  if (static_cast<int64_t>(bytes.size()) != element * static_cast<int64_t>(out.size())) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", out.size(), " ", DTypeName(dtype),
                                                   " elements (", element * out.size(),
                                                   " bytes), got ", bytes.size(), " bytes"));
  }
  if (dtype == v1::DTYPE_FLOAT32) {
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return absl::OkStatus();
  }
  const auto* src = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < out.size(); ++i) {
    const auto h = static_cast<uint16_t>(src[2 * i] | (src[2 * i + 1] << 8));
    out[i] = dtype == v1::DTYPE_FLOAT16 ? HalfToFloat(h) : BFloat16ToFloat(h);
  }
  return absl::OkStatus();
}

v1::Tensor MakeTensor(absl::Span<const float> values, const std::vector<int64_t>& shape,
                      v1::DType dtype) {
  if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::DTYPE_FLOAT32;
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  for (int64_t d : shape) tensor.add_shape(d);
  EncodeFloats(values, dtype, tensor.mutable_raw_data());
  return tensor;
}

absl::Status ReadTensor(const v1::Tensor& tensor, const std::vector<int64_t>& expected_shape,
                        absl::string_view what, std::vector<float>* out) {
  const std::vector<int64_t> shape(tensor.shape().begin(), tensor.shape().end());
  if (shape != expected_shape) {
    return absl::InternalError(absl::StrCat("server sent ", what, " with shape ", ShapeString(shape),
                                            ", expected ", ShapeString(expected_shape)));
  }
  const v1::DType dtype =
      tensor.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : tensor.dtype();
  out->resize(static_cast<size_t>(NumElements(shape)));
  absl::Status status = DecodeFloats(tensor.raw_data(), dtype, absl::MakeSpan(*out));
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("server sent a bad ", what, ": ", status.message()));
  }
  return absl::OkStatus();
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace attngrad
