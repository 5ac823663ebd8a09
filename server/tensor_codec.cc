// Wire tensor validation and fp32 <-> FLOAT32/FLOAT16/BFLOAT16 conversion (little-endian hosts).
#include "tensor_codec.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "half_float.h"

namespace attngrad::server {

static_assert(sizeof(float) == 4, "fp32 is 4 bytes");

std::size_t DTypeSize(int dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return 4;
    case v1::DTYPE_FLOAT16: return 2;
    case v1::DTYPE_BFLOAT16: return 2;
    default: return 0;
  }
}

std::string DTypeName(int dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return "FLOAT32";
    case v1::DTYPE_FLOAT16: return "FLOAT16";
    case v1::DTYPE_BFLOAT16: return "BFLOAT16";
    case v1::DTYPE_UNSPECIFIED: return "UNSPECIFIED";
    default: return absl::StrCat("dtype ", dtype);
  }
}

bool IsSupportedWireDType(int dtype) { return DTypeSize(dtype) != 0; }

std::string ShapeString(absl::Span<const std::int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::StatusOr<std::int64_t> ElementCount(absl::Span<const std::int64_t> shape,
                                          const std::string& field) {
  std::int64_t count = 1;
  for (std::int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape ", ShapeString(shape), " has a negative dimension"));
    }
    if (dim != 0 && count > std::numeric_limits<std::int64_t>::max() / 8 / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape ", ShapeString(shape), " has too many elements"));
    }
    count *= dim;
  }
  return count;
}

absl::StatusOr<std::vector<std::int64_t>> CheckTensor(const v1::Tensor& tensor,
                                                      const std::string& field,
                                                      absl::Span<const std::int64_t> expected) {
  std::vector<std::string> expected_dims;
  for (std::int64_t dim : expected) expected_dims.push_back(dim < 0 ? "*" : absl::StrCat(dim));
  const std::string expected_text = absl::StrCat("[", absl::StrJoin(expected_dims, ","), "]");
  if (!IsSupportedWireDType(tensor.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype: ", DTypeName(tensor.dtype()),
                     " is not supported; expected FLOAT32, FLOAT16 or BFLOAT16"));
  }
  std::vector<std::int64_t> shape(tensor.shape().begin(), tensor.shape().end());
  if (shape.size() != expected.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: got ", ShapeString(shape),
                                                   " (rank ", shape.size(), "), expected ",
                                                   expected_text));
  }
  for (std::size_t i = 0; i < shape.size(); ++i) {
    const bool ok = expected[i] < 0 ? shape[i] >= 1 : shape[i] == expected[i];
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape: got ", ShapeString(shape),
                                                     ", expected ", expected_text,
                                                     " (every dimension >= 1)"));
    }
  }
  absl::StatusOr<std::int64_t> count = ElementCount(shape, field);
  if (!count.ok()) return count.status();
  const std::size_t element_size = DTypeSize(tensor.dtype());
  const std::uint64_t expected_bytes = static_cast<std::uint64_t>(*count) * element_size;
  if (tensor.raw_data().size() != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".raw_data: got ", tensor.raw_data().size(), " bytes, expected ", expected_bytes,
        " (", *count, " elements of ", DTypeName(tensor.dtype()), " for shape ",
        ShapeString(shape), ")"));
  }
  return shape;
}

absl::Status DecodeToFloat(const std::string& raw, int dtype, const std::string& field,
                           bool require_finite, absl::Span<float> out) {
  const std::size_t element_size = DTypeSize(dtype);
  if (element_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: ", DTypeName(dtype),
                                                   " is not supported"));
  }
  if (raw.size() != out.size() * element_size) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": got ", raw.size(), " bytes, expected ",
                                                   out.size() * element_size));
  }
  const char* bytes = raw.data();
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      std::memcpy(out.data(), bytes, raw.size());
      break;
    case v1::DTYPE_FLOAT16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, 2);
        out[i] = HalfToFloat(bits);
      }
      break;
    case v1::DTYPE_BFLOAT16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, 2);
        out[i] = BFloat16ToFloat(bits);
      }
      break;
  }
  if (require_finite) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(out[i])) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": element ", i, " is not finite (", out[i], "); every value must be finite"));
      }
    }
  }
  return absl::OkStatus();
}

void EncodeFromFloat(absl::Span<const float> values, int dtype, std::string* raw) {
  const std::size_t start = raw->size();
  const std::size_t element_size = DTypeSize(dtype);
  raw->resize(start + values.size() * element_size);
  char* bytes = raw->data() + start;
  switch (dtype) {
    case v1::DTYPE_FLOAT16:
      for (std::size_t i = 0; i < values.size(); ++i) {
        const std::uint16_t bits = FloatToHalf(values[i]);
        std::memcpy(bytes + 2 * i, &bits, 2);
      }
      break;
    case v1::DTYPE_BFLOAT16:
      for (std::size_t i = 0; i < values.size(); ++i) {
        const std::uint16_t bits = FloatToBFloat16(values[i]);
        std::memcpy(bytes + 2 * i, &bits, 2);
      }
      break;
    default:
      std::memcpy(bytes, values.data(), values.size() * sizeof(float));
      break;
  }
}

void EncodeTensor(absl::Span<const float> values, absl::Span<const std::int64_t> shape, int dtype,
                  v1::Tensor* tensor) {
  if (!IsSupportedWireDType(dtype)) dtype = v1::DTYPE_FLOAT32;
  tensor->set_dtype(static_cast<v1::DType>(dtype));
  tensor->clear_shape();
  for (std::int64_t dim : shape) tensor->add_shape(dim);
  std::string* raw = tensor->mutable_raw_data();
  raw->clear();
  EncodeFromFloat(values, dtype, raw);
}

}  // namespace attngrad::server
