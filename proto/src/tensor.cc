// Wire tensor checks and fp32 <-> FLOAT32/FLOAT16/BFLOAT16 conversion (little-endian hosts).
#include "attngrad/wire/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/dtype_bits.h"

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

// The bits that are all ones in an Inf or NaN of `dtype` (0 for a dtype without them).
std::uint32_t ExponentMask(int dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return 0x7f800000u;
    case v1::DTYPE_FLOAT16: return 0x7c00u;
    case v1::DTYPE_BFLOAT16: return 0x7f80u;
    default: return 0;
  }
}

}  // namespace

namespace {

#if defined(__SSE2__)
// Copies 16-byte vectors from `source` to the 16-byte aligned `destination` with non-temporal
// stores; with kCheck, OR-s into *any the lanes of kBits-bit elements whose exponent bits
// (`exponent_mask`) are all ones. Returns the bytes done (a multiple of 16; the rest is the
// caller's).
template <int kBits, bool kCheck>
std::size_t StreamAndCheck(const char* source, std::size_t bytes, char* destination,
                           std::uint32_t exponent_mask, __m128i* any) {
  const __m128i mask =
      kBits == 32 ? _mm_set1_epi32(static_cast<int>(exponent_mask))
                  : _mm_set1_epi16(static_cast<short>(static_cast<std::uint16_t>(exponent_mask)));
  auto equal = [](__m128i a, __m128i b) {
    return kBits == 32 ? _mm_cmpeq_epi32(a, b) : _mm_cmpeq_epi16(a, b);
  };
  __m128i found = *any;
  std::size_t done = 0;
  for (; done + 64 <= bytes; done += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + done));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + done + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + done + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + done + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + done), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + done + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + done + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + done + 48), d);
    if (kCheck) {
      found = _mm_or_si128(found, _mm_or_si128(_mm_or_si128(equal(_mm_and_si128(a, mask), mask),
                                                            equal(_mm_and_si128(b, mask), mask)),
                                               _mm_or_si128(equal(_mm_and_si128(c, mask), mask),
                                                            equal(_mm_and_si128(d, mask), mask))));
    }
  }
  for (; done + 16 <= bytes; done += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + done));
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + done), a);
    if (kCheck) found = _mm_or_si128(found, equal(_mm_and_si128(a, mask), mask));
  }
  *any = found;
  return done;
}
#endif

// Below this many bytes the plain copy and check are as fast (and leave the data in the cache).
constexpr std::size_t kStreamingMinBytes = 4096;

// Whether any of the whole elements of `element_size` bytes (4 or 2) in `bytes` bytes at `data`
// has every bit of `mask` set (Inf or NaN for a dtype's exponent mask).
bool AnyMasked(const char* data, std::size_t bytes, std::size_t element_size, std::uint32_t mask) {
  return element_size == 4
             ? AnyNotFinite<std::uint32_t>(data, bytes / 4, mask)
             : AnyNotFinite<std::uint16_t>(data, bytes / 2, static_cast<std::uint16_t>(mask));
}

// The one streaming copy (CopyAndCheckFinite, CopyPieces): `source` to `destination`,
// from the destination's first 16-byte boundary on with non-temporal stores when the copy is at
// least kStreamingMinBytes and that boundary is a whole number of elements of `element_size` bytes
// in (else everything with memcpy). kCheck: returns whether any element has every bit of `mask`
// set (element_size 4 or 2); else false (element_size 1). The streamed stores are visible to other
// threads only after a StoreFence.
template <bool kCheck>
bool CopyMaybeStreaming(absl::string_view source, std::size_t element_size, std::uint32_t mask,
                        char* destination) {
  auto plain = [&](const char* from, std::size_t bytes, char* to) {
    if (bytes == 0) return false;
    std::memcpy(to, from, bytes);
    return kCheck && AnyMasked(from, bytes, element_size, mask);
  };
#if defined(__SSE2__)
  if (source.size() >= kStreamingMinBytes) {
    const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(destination) % 16;
    const std::size_t head = misalignment == 0 ? 0 : 16 - misalignment;
    if (head % element_size == 0) {
      bool any = plain(source.data(), head, destination);
      __m128i found = _mm_setzero_si128();
      const std::size_t streamed =
          element_size == 2 ? StreamAndCheck<16, kCheck>(source.data() + head, source.size() - head,
                                                         destination + head, mask, &found)
                            : StreamAndCheck<32, kCheck>(source.data() + head, source.size() - head,
                                                         destination + head, mask, &found);
      if (kCheck) any = any || _mm_movemask_epi8(found) != 0;
      const std::size_t done = head + streamed;
      any = plain(source.data() + done, source.size() - done, destination + done) || any;
      return any;
    }
  }
#endif
  return plain(source.data(), source.size(), destination);
}

// Makes the streamed (non-temporal) stores so far visible before anything that follows.
void StoreFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace

bool CopyAndCheckFinite(absl::string_view source, int dtype, char* destination) {
  const std::uint32_t mask = ExponentMask(dtype);
  if (mask == 0) {
    if (!source.empty()) std::memcpy(destination, source.data(), source.size());
    return true;
  }
  const bool any = CopyMaybeStreaming<true>(source, DTypeSize(dtype), mask, destination);
  StoreFence();
  return !any;
}

void CopyPieces(absl::Span<const absl::string_view> pieces, char* destination, bool streaming) {
  for (absl::string_view piece : pieces) {
    if (streaming) {
      CopyMaybeStreaming<false>(piece, 1, 0, destination);
    } else if (!piece.empty()) {
      std::memcpy(destination, piece.data(), piece.size());
    }
    destination += piece.size();
  }
  if (streaming) StoreFence();
}

absl::Status CheckFiniteRaw(absl::string_view raw, int dtype, absl::string_view field,
                            std::size_t first_index) {
  const std::size_t element_size = DTypeSize(dtype);
  const std::uint32_t mask = ExponentMask(dtype);
  if (element_size == 0 || mask == 0) return absl::OkStatus();
  const std::size_t count = raw.size() / element_size;
  if (!AnyMasked(raw.data(), count * element_size, element_size, mask)) return absl::OkStatus();
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
