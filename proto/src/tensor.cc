// Wire tensor checks and fp32 <-> FLOAT32/FLOAT16/BFLOAT16 conversion (little-endian hosts).
#include "attngrad/wire/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/dtype_bits.h"
#include "attngrad/wire/status_macros.h"

namespace attngrad::wire {
namespace {

static_assert(sizeof(float) == 4, "fp32 is 4 bytes");

constexpr std::int64_t kMaxElements = std::numeric_limits<std::int64_t>::max() / 8;

std::string ExpectedShapeString(absl::Span<const std::int64_t> expected) {
  std::vector<std::string> dimensions;
  dimensions.reserve(expected.size());
  for (std::int64_t dimension : expected) {
    dimensions.push_back(dimension < 0 ? "*" : absl::StrCat(dimension));
  }
  return absl::StrCat("[", absl::StrJoin(dimensions, ","), "]");
}

std::uint16_t LoadBits16(const char* bytes) {
  std::uint16_t bits;
  std::memcpy(&bits, bytes, sizeof bits);
  return bits;
}

void StoreBits16(std::uint16_t bits, char* bytes) { std::memcpy(bytes, &bits, sizeof bits); }

}  // namespace

std::string ShapeString(absl::Span<const std::int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

std::int64_t NumElements(absl::Span<const std::int64_t> shape) {
  std::int64_t count = 1;
  for (std::int64_t dimension : shape) {
    if (dimension < 0) return -1;
    if (dimension != 0 && count > kMaxElements / dimension) return -1;
    count *= dimension;
  }
  return count;
}

absl::StatusOr<std::int64_t> ElementCount(absl::Span<const std::int64_t> shape,
                                          absl::string_view field) {
  const std::int64_t count = NumElements(shape);
  if (count >= 0) return count;
  for (std::int64_t dimension : shape) {
    if (dimension < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape ", ShapeString(shape), " has a negative dimension"));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": shape ", ShapeString(shape), " has too many elements"));
}

absl::Status CheckShape(absl::Span<const std::int64_t> shape, absl::string_view field,
                        absl::Span<const std::int64_t> expected) {
  if (shape.size() != expected.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: got ", ShapeString(shape),
                                                   " (rank ", shape.size(), "), expected ",
                                                   ExpectedShapeString(expected)));
  }
  for (std::size_t i = 0; i < shape.size(); ++i) {
    const bool matches = expected[i] < 0 ? shape[i] >= 1 : shape[i] == expected[i];
    if (!matches) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape: got ", ShapeString(shape),
                                                     ", expected ", ExpectedShapeString(expected),
                                                     " (every dimension >= 1)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::int64_t>> CheckTensor(const v1::Tensor& tensor,
                                                      absl::string_view field,
                                                      absl::Span<const std::int64_t> expected) {
  return CheckTensor(tensor.dtype(), tensor.shape(), tensor.raw_data().size(), field, expected);
}

absl::StatusOr<std::vector<std::int64_t>> CheckTensor(int dtype,
                                                      absl::Span<const std::int64_t> shape_in,
                                                      std::size_t raw_bytes,
                                                      absl::string_view field,
                                                      absl::Span<const std::int64_t> expected) {
  if (!IsSupportedDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype: ", DTypeName(dtype),
                     " is not supported; expected float32, float16 or bfloat16"));
  }
  std::vector<std::int64_t> shape(shape_in.begin(), shape_in.end());
  ATTNGRAD_RETURN_IF_ERROR(CheckShape(shape, field, expected));
  ATTNGRAD_ASSIGN_OR_RETURN(const std::int64_t count, ElementCount(shape, field));
  const std::size_t element_size = DTypeSize(dtype);
  const std::uint64_t expected_bytes = static_cast<std::uint64_t>(count) * element_size;
  if (raw_bytes != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".raw_data: got ", raw_bytes, " bytes, expected ", expected_bytes, " (", count,
        " elements of ", DTypeName(dtype), " for shape ", ShapeString(shape), ")"));
  }
  return shape;
}

namespace {

// INVALID_ARGUMENT unless `bytes` are `elements` elements of a supported `dtype`.
absl::Status CheckRawSize(std::size_t bytes, int dtype, absl::string_view field,
                          std::size_t elements) {
  const std::size_t element_size = DTypeSize(dtype);
  if (element_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype: ", DTypeName(dtype), " is not supported"));
  }
  if (bytes != elements * element_size) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": got ", bytes, " bytes, expected ",
                                                   elements * element_size, " (", elements,
                                                   " elements of ", DTypeName(dtype), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeToFloat(absl::string_view raw, int dtype, absl::string_view field,
                           absl::Span<float> out) {
  ATTNGRAD_RETURN_IF_ERROR(CheckRawSize(raw.size(), dtype, field, out.size()));
  const char* bytes = raw.data();
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      if (!raw.empty()) std::memcpy(out.data(), bytes, raw.size());
      break;
    // dtype_bits.h's conversions inlined here (HalfToFloat and BFloat16ToFloat are the same
    // functions out of line): these loops are the client's and the CPU backend's wire codec.
    case v1::DTYPE_FLOAT16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        out[i] = bits::FloatOfBits(bits::HalfToFloatBits(LoadBits16(bytes + 2 * i)));
      }
      break;
    case v1::DTYPE_BFLOAT16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        out[i] = bits::FloatOfBits(bits::BFloat16ToFloatBits(LoadBits16(bytes + 2 * i)));
      }
      break;
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(absl::Span<const float> values, absl::string_view field,
                         std::size_t first_index) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": element ", first_index + i,
                                                     " is not finite (", values[i],
                                                     "); every value must be finite"));
    }
  }
  return absl::OkStatus();
}

namespace {

// Whether any of `count` elements of `Bits` has every exponent bit of `exponent_mask` set (Inf or
// NaN); a branch-free pass that vectorizes, the first offender is looked for only when there is
// one.
template <typename Bits>
bool AnyNotFinite(const char* bytes, std::size_t count, Bits exponent_mask) {
  Bits any = 0;
  for (std::size_t i = 0; i < count; ++i) {
    Bits bits;
    std::memcpy(&bits, bytes + i * sizeof(Bits), sizeof(Bits));
    any |= static_cast<Bits>((bits & exponent_mask) == exponent_mask);
  }
  return any != 0;
}

}  // namespace

absl::Status CheckFiniteRaw(absl::string_view raw, int dtype, absl::string_view field,
                            std::size_t first_index) {
  const std::size_t element_size = DTypeSize(dtype);
  if (element_size == 0) return absl::OkStatus();
  const std::size_t count = raw.size() / element_size;
  bool any = false;
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      any = AnyNotFinite<std::uint32_t>(raw.data(), count, 0x7f800000u);
      break;
    case v1::DTYPE_FLOAT16: any = AnyNotFinite<std::uint16_t>(raw.data(), count, 0x7c00u); break;
    case v1::DTYPE_BFLOAT16: any = AnyNotFinite<std::uint16_t>(raw.data(), count, 0x7f80u); break;
  }
  if (!any) return absl::OkStatus();
  // Decode in blocks to name the first offender exactly as CheckFinite does.
  constexpr std::size_t kBlock = 4096;
  std::vector<float> values(kBlock);
  for (std::size_t first = 0; first < count; first += kBlock) {
    const std::size_t n = std::min(kBlock, count - first);
    const absl::Span<float> block = absl::MakeSpan(values.data(), n);
    ATTNGRAD_RETURN_IF_ERROR(
        DecodeToFloat(raw.substr(first * element_size, n * element_size), dtype, field, block));
    ATTNGRAD_RETURN_IF_ERROR(CheckFinite(block, field, first_index + first));
  }
  return absl::OkStatus();
}

absl::Status DecodeTensor(const v1::Tensor& tensor, absl::string_view field,
                          absl::Span<const std::int64_t> expected, std::vector<float>* out) {
  ATTNGRAD_ASSIGN_OR_RETURN(const std::vector<std::int64_t> shape,
                            CheckTensor(tensor, field, expected));
  out->resize(static_cast<std::size_t>(NumElements(shape)));
  return DecodeToFloat(tensor.raw_data(), tensor.dtype(), field, absl::MakeSpan(*out));
}

absl::Status DecodePiecesToFloat(absl::Span<const absl::string_view> pieces, int dtype,
                                 absl::string_view field, absl::Span<float> out) {
  std::size_t bytes = 0;
  for (absl::string_view piece : pieces) bytes += piece.size();
  ATTNGRAD_RETURN_IF_ERROR(CheckRawSize(bytes, dtype, field, out.size()));
  const std::size_t element_size = DTypeSize(dtype);
  std::size_t done = 0;  // elements decoded
  char carry[sizeof(float)];
  std::size_t carried = 0;  // bytes of a straddling element held in `carry`
  for (absl::string_view piece : pieces) {
    if (carried > 0) {
      const std::size_t take = std::min(element_size - carried, piece.size());
      std::memcpy(carry + carried, piece.data(), take);
      carried += take;
      piece.remove_prefix(take);
      if (carried < element_size) continue;
      ATTNGRAD_RETURN_IF_ERROR(DecodeToFloat(absl::string_view(carry, element_size), dtype, field,
                                             out.subspan(done, 1)));
      ++done;
      carried = 0;
    }
    const std::size_t whole = piece.size() / element_size;
    ATTNGRAD_RETURN_IF_ERROR(DecodeToFloat(piece.substr(0, whole * element_size), dtype, field,
                                           out.subspan(done, whole)));
    done += whole;
    piece.remove_prefix(whole * element_size);
    std::memcpy(carry, piece.data(), piece.size());
    carried = piece.size();
  }
  return absl::OkStatus();
}

std::vector<absl::string_view> PiecesRange(absl::Span<const absl::string_view> pieces,
                                           std::size_t offset, std::size_t size) {
  std::vector<absl::string_view> range;
  for (absl::string_view piece : pieces) {
    if (size == 0) break;
    if (offset >= piece.size()) {
      offset -= piece.size();
      continue;
    }
    piece.remove_prefix(offset);
    offset = 0;
    const std::size_t take = std::min(size, piece.size());
    range.push_back(piece.substr(0, take));
    size -= take;
  }
  return range;
}

void EncodeFromFloat(absl::Span<const float> values, int dtype, std::string* raw) {
  const std::size_t start = raw->size();
  const std::size_t element_size =
      dtype == v1::DTYPE_FLOAT16 || dtype == v1::DTYPE_BFLOAT16 ? 2 : sizeof(float);
  raw->resize(start + element_size * values.size());
  EncodeFromFloat(values, dtype, raw->data() + start);
}

void EncodeFromFloat(absl::Span<const float> values, int dtype, char* out) {
  switch (dtype) {
    // One loop per dtype, dtype_bits.h's conversions inlined (the bf16 one vectorizes).
    case v1::DTYPE_FLOAT16:
      for (std::size_t i = 0; i < values.size(); ++i) {
        StoreBits16(bits::FloatBitsToHalf(bits::BitsOfFloat(values[i])), out + 2 * i);
      }
      break;
    case v1::DTYPE_BFLOAT16:
      for (std::size_t i = 0; i < values.size(); ++i) {
        StoreBits16(bits::FloatBitsToBFloat16(bits::BitsOfFloat(values[i])), out + 2 * i);
      }
      break;
    default:
      if (!values.empty()) std::memcpy(out, values.data(), values.size() * sizeof(float));
      break;
  }
}

void EncodeTensor(absl::Span<const float> values, absl::Span<const std::int64_t> shape, int dtype,
                  v1::Tensor* tensor) {
  if (!IsSupportedDType(dtype)) dtype = v1::DTYPE_FLOAT32;
  tensor->set_dtype(static_cast<v1::DType>(dtype));
  tensor->clear_shape();
  for (std::int64_t dimension : shape) tensor->add_shape(dimension);
  std::string* raw = tensor->mutable_raw_data();
  raw->clear();
  EncodeFromFloat(values, dtype, raw);
}

v1::Tensor MakeTensor(absl::Span<const float> values, absl::Span<const std::int64_t> shape,
                      int dtype) {
  v1::Tensor tensor;
  EncodeTensor(values, shape, dtype, &tensor);
  return tensor;
}

v1::DType DTypeFromSafetensors(absl::string_view safetensors_dtype) {
  if (safetensors_dtype == "F32") return v1::DTYPE_FLOAT32;
  if (safetensors_dtype == "F16") return v1::DTYPE_FLOAT16;
  if (safetensors_dtype == "BF16") return v1::DTYPE_BFLOAT16;
  return v1::DTYPE_UNSPECIFIED;
}

absl::string_view SafetensorsDTypeName(int dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return "F32";
    case v1::DTYPE_FLOAT16: return "F16";
    case v1::DTYPE_BFLOAT16: return "BF16";
    default: return "";
  }
}

}  // namespace attngrad::wire
