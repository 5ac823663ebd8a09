// attngrad/wire/tensor.h: encode/decode round trips in every wire dtype and the errors a bad tensor
// gets (naming the field and the expected shape).
#include "attngrad/wire/tensor.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/wire/dtype.h"

namespace attngrad::wire {
namespace {

bool Contains(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

TEST(TensorTest, ShapeStringsAndCounts) {
  EXPECT_EQ(ShapeString({2, 16, 3072}), "[2,16,3072]");
  EXPECT_EQ(ShapeString({}), "[]");
  EXPECT_EQ(NumElements({2, 3, 4}), 24);
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({5, 0}), 0);
  EXPECT_EQ(NumElements({2, -1}), -1);
  EXPECT_EQ(NumElements({1 << 30, 1 << 30, 1 << 30}), -1);
  EXPECT_EQ(*ElementCount({2, 3}, "x"), 6);
  absl::StatusOr<std::int64_t> negative = ElementCount({2, -3}, "hidden_states");
  ASSERT_FALSE(negative.ok());
  EXPECT_TRUE(Contains(negative.status(), "hidden_states: shape [2,-3] has a negative dimension"))
      << negative.status();
  EXPECT_TRUE(Contains(ElementCount({1 << 30, 1 << 30, 1 << 30}, "x").status(), "too many"));
}

TEST(TensorTest, RoundTripsInEveryDType) {
  const std::vector<float> values = {1.0f, -2.5f, 0.125f, 3.0f, 0.0f, -0.5f};  // exact in all three
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    const v1::Tensor tensor = MakeTensor(values, {2, 3}, dtype);
    EXPECT_EQ(tensor.dtype(), dtype);
    EXPECT_EQ(tensor.raw_data().size(), 6 * DTypeSize(dtype));
    std::vector<float> back;
    ASSERT_TRUE(DecodeTensor(tensor, "t", {2, 3}, &back).ok());
    EXPECT_EQ(back, values) << DTypeName(dtype);
    ASSERT_TRUE(DecodeTensor(tensor, "t", {-1, 3}, &back).ok());
    EXPECT_FALSE(DecodeTensor(tensor, "t", {3, 2}, &back).ok());
  }
  // UNSPECIFIED and unknown dtypes are encoded as fp32.
  EXPECT_EQ(MakeTensor(values, {6}, v1::DTYPE_UNSPECIFIED).dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(MakeTensor(values, {6}, 77).raw_data().size(), 24u);
  // EncodeFromFloat appends.
  std::string raw = "xy";
  EncodeFromFloat(values, v1::DTYPE_FLOAT16, &raw);
  EXPECT_EQ(raw.size(), 2 + 12u);
  std::vector<float> decoded(6);
  ASSERT_TRUE(DecodeToFloat(absl::string_view(raw).substr(2), v1::DTYPE_FLOAT16, "raw",
                            absl::MakeSpan(decoded))
                  .ok());
  EXPECT_EQ(decoded, values);
}

TEST(TensorTest, CheckTensorErrorsNameTheFieldAndTheExpectedShape) {
  const std::vector<float> values(2 * 4 * 8, 1.0f);
  v1::Tensor tensor = MakeTensor(values, {2, 4, 8});
  EXPECT_TRUE(CheckTensor(tensor, "hidden_states", {-1, -1, 8}).ok());

  absl::Status rank = CheckTensor(tensor, "hidden_states", {-1, 8}).status();
  EXPECT_EQ(rank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(rank, "hidden_states.shape: got [2,4,8] (rank 3), expected [*,8]")) << rank;

  absl::Status dimension = CheckTensor(tensor, "grad_output", {2, 4, 16}).status();
  EXPECT_TRUE(Contains(dimension, "grad_output.shape: got [2,4,8], expected [2,4,16]"))
      << dimension;

  v1::Tensor zero = MakeTensor({}, {0, 4, 8});
  EXPECT_FALSE(CheckTensor(zero, "x", {-1, 4, 8}).ok());  // "*" means >= 1

  v1::Tensor short_tensor = tensor;
  short_tensor.mutable_raw_data()->resize(20);
  absl::Status bytes = CheckTensor(short_tensor, "rotary_tables.cos", {2, 4, 8}).status();
  EXPECT_TRUE(Contains(bytes, "rotary_tables.cos.raw_data: got 20 bytes, expected 256")) << bytes;

  v1::Tensor unspecified = tensor;
  unspecified.set_dtype(v1::DTYPE_UNSPECIFIED);
  absl::Status dtype = CheckTensor(unspecified, "hidden_states", {2, 4, 8}).status();
  EXPECT_TRUE(Contains(dtype, "hidden_states.dtype: unspecified is not supported")) << dtype;

  v1::Tensor negative = tensor;
  negative.set_shape(0, -2);
  EXPECT_FALSE(CheckTensor(negative, "x", {-1, 4, 8}).ok());
}

TEST(TensorTest, DecodeErrors) {
  std::vector<float> out(3);
  absl::Status size =
      DecodeToFloat(std::string(10, '\0'), v1::DTYPE_FLOAT32, "chunk", absl::MakeSpan(out));
  EXPECT_TRUE(Contains(size, "chunk: got 10 bytes, expected 12")) << size;
  absl::Status dtype = DecodeToFloat(std::string(6, '\0'), 9, "chunk", absl::MakeSpan(out));
  EXPECT_TRUE(Contains(dtype, "chunk.dtype: dtype 9 is not supported")) << dtype;
  EXPECT_TRUE(DecodeToFloat("", v1::DTYPE_FLOAT32, "empty", {}).ok());

  const std::vector<float> finite = {1.f, 2.f};
  EXPECT_TRUE(CheckFinite(finite, "x").ok());
  const std::vector<float> bad = {1.f, std::numeric_limits<float>::infinity()};
  absl::Status not_finite = CheckFinite(bad, "q_proj.data");
  EXPECT_TRUE(Contains(not_finite, "q_proj.data: element 1 is not finite")) << not_finite;
}

TEST(TensorTest, SafetensorsDTypeNames) {
  EXPECT_EQ(DTypeFromSafetensors("F32"), v1::DTYPE_FLOAT32);
  EXPECT_EQ(DTypeFromSafetensors("F16"), v1::DTYPE_FLOAT16);
  EXPECT_EQ(DTypeFromSafetensors("BF16"), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(DTypeFromSafetensors("I64"), v1::DTYPE_UNSPECIFIED);
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    EXPECT_EQ(DTypeFromSafetensors(SafetensorsDTypeName(dtype)), dtype);
  }
  EXPECT_EQ(SafetensorsDTypeName(v1::DTYPE_UNSPECIFIED), "");
}

// PiecesRange: the bytes of a range of the concatenated pieces, as views of the same memory; a
// tensor decoded range by range equals the whole decode (elements straddling pieces included).
TEST(TensorTest, PiecesRangeIsTheRangeOfTheConcatenation) {
  const std::string a = "abc", b = "defg", c = "h";
  const std::vector<absl::string_view> pieces = {a, b, c};
  auto joined = [](const std::vector<absl::string_view>& range) {
    std::string out;
    for (absl::string_view piece : range) out.append(piece.data(), piece.size());
    return out;
  };
  EXPECT_EQ(joined(PiecesRange(pieces, 0, 8)), "abcdefgh");
  EXPECT_EQ(joined(PiecesRange(pieces, 2, 4)), "cdef");
  EXPECT_EQ(PiecesRange(pieces, 2, 4).front().data(), a.data() + 2);  // not copied
  EXPECT_EQ(joined(PiecesRange(pieces, 3, 4)), "defg");
  EXPECT_EQ(PiecesRange(pieces, 3, 4).size(), 1u);
  EXPECT_EQ(joined(PiecesRange(pieces, 6, 100)), "gh");  // what there is
  EXPECT_TRUE(PiecesRange(pieces, 8, 4).empty());
  EXPECT_TRUE(PiecesRange(pieces, 1, 0).empty());

  std::vector<float> values(1000);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 7.f;
  const std::string raw(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  std::vector<absl::string_view> split;  // pieces of 1, 7, 13, ... bytes: elements straddle them
  for (std::size_t at = 0, size = 1; at < raw.size(); at += size, size += 6) {
    split.push_back(absl::string_view(raw).substr(at, size));
  }
  std::vector<float> decoded(values.size(), 0.f);
  for (std::size_t first = 0; first < values.size(); first += 97) {
    const std::size_t count = std::min<std::size_t>(97, values.size() - first);
    ASSERT_TRUE(DecodePiecesToFloat(PiecesRange(split, first * 4, count * 4), v1::DTYPE_FLOAT32,
                                    "x", absl::MakeSpan(decoded).subspan(first, count))
                    .ok());
  }
  EXPECT_EQ(decoded, values);
}

// CopyAndCheckFinite: the bytes of memcpy, and false exactly when some element is Inf or NaN,
// wherever it lies (the head before the destination's 16-byte boundary, the streamed middle, the
// tail), for every wire dtype, lengths below and above the streaming threshold and destinations
// at every alignment.
TEST(TensorTest, CopyAndCheckFiniteCopiesAndFindsEveryNonFiniteElement) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    const std::size_t size = DTypeSize(dtype);
    for (std::size_t count : {0u, 1u, 7u, 33u, 1000u, 5003u}) {
      std::vector<float> values(count);
      for (std::size_t i = 0; i < count; ++i) values[i] = 0.01f * static_cast<float>(i) - 3.f;
      std::string raw;
      EncodeFromFloat(values, dtype, &raw);
      for (std::size_t shift = 0; shift < 16; shift += size) {
        std::vector<char> out(raw.size() + 32, 'x');
        char* destination = out.data() + (16 - reinterpret_cast<std::uintptr_t>(out.data()) % 16) +
                            shift;  // 16-byte aligned, then shifted by whole elements
        ASSERT_TRUE(CopyAndCheckFinite(raw, dtype, destination)) << dtype << " " << count;
        EXPECT_EQ(0, std::memcmp(destination, raw.data(), raw.size())) << dtype << " " << count;
        // One non-finite element at a time, at positions across the whole range.
        for (std::size_t at : {std::size_t{0}, count / 3, count / 2 + 1, count - 1}) {
          if (at >= count) continue;
          for (float bad :
               {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                std::numeric_limits<float>::quiet_NaN()}) {
            std::vector<float> with_bad = values;
            with_bad[at] = bad;
            std::string bad_raw;
            EncodeFromFloat(with_bad, dtype, &bad_raw);
            EXPECT_FALSE(CopyAndCheckFinite(bad_raw, dtype, destination))
                << dtype << " count " << count << " at " << at << " shift " << shift;
            EXPECT_EQ(0, std::memcmp(destination, bad_raw.data(), bad_raw.size()));
          }
        }
      }
    }
  }
}

// CopyPieces, streaming or not: the concatenated bytes of the pieces, whatever their sizes (empty,
// below and above the streaming threshold, odd) and the destination's alignment, and not a byte
// more.
TEST(TensorTest, CopyPiecesCopiesThePiecesInOrder) {
  std::string bytes(70000, '\0');
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131 + i / 251);
  const std::vector<std::vector<std::size_t>> cuts = {
      {}, {0}, {1}, {4095}, {4096}, {4097}, {70000}, {3, 0, 8191, 5, 12289, 1, 40000}};
  for (const std::vector<std::size_t>& sizes : cuts) {
    std::vector<absl::string_view> pieces;
    std::size_t total = 0;
    for (std::size_t size : sizes) {
      pieces.push_back(absl::string_view(bytes).substr(total, size));
      total += size;
    }
    for (std::size_t shift = 0; shift < 32; ++shift) {
      const bool streaming = shift < 16;
      std::vector<char> out(total + 64, 'x');
      char* destination =
          out.data() + (16 - reinterpret_cast<std::uintptr_t>(out.data()) % 16) + shift % 16;
      CopyPieces(pieces, destination, streaming);
      EXPECT_EQ(0, std::memcmp(destination, bytes.data(), total))
          << "pieces " << sizes.size() << " total " << total << " shift " << shift % 16
          << (streaming ? " streaming" : " memcpy");
      for (char* c = out.data(); c < destination; ++c) ASSERT_EQ(*c, 'x');
      for (char* c = destination + total; c < out.data() + out.size(); ++c) ASSERT_EQ(*c, 'x');
    }
  }
}

}  // namespace
}  // namespace attngrad::wire
