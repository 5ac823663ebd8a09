// The client library's pieces that need no server: wire dtype conversions, the split plan, .npy and
// safetensors files, the SPEC section 4 comparison rule and the deterministic generators.
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "client_impl.h"
#include "dtype.h"
#include "gtest/gtest.h"
#include "random_tensors.h"
#include "reference_check.h"
#include "tensor_files.h"
#include "test_support.h"

namespace attngrad {
namespace {

TEST(DTypeTest, HalfConversions) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie: to even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie: to even (up)
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  for (float v : {0.0f, 1.5f, -3.25f, 1e-5f, 6.1e-5f, 1000.5f, -0.099975586f}) {
    const float back = HalfToFloat(FloatToHalf(v));
    EXPECT_NEAR(back, v, std::fabs(v) * 1e-3 + 6e-8) << v;
  }
}

TEST(DTypeTest, BFloat16Conversions) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie: to even
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie: to even (up)
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
}

TEST(DTypeTest, TensorRoundTripAndErrors) {
  const std::vector<float> values = {1.0f, -2.5f, 0.125f, 3.0f, 0.0f, -0.5f};
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    const v1::Tensor tensor = MakeTensor(values, {2, 3}, dtype);
    EXPECT_EQ(static_cast<int64_t>(tensor.raw_data().size()), 6 * DTypeSize(dtype));
    std::vector<float> back;
    ASSERT_TRUE(ReadTensor(tensor, {2, 3}, "t", &back).ok());
    EXPECT_EQ(back, values) << DTypeName(dtype);  // all exactly representable
    EXPECT_FALSE(ReadTensor(tensor, {3, 2}, "t", &back).ok());
  }
  v1::Tensor short_tensor = MakeTensor(values, {2, 3});
  short_tensor.mutable_raw_data()->resize(20);
  std::vector<float> out;
  const absl::Status status = ReadTensor(short_tensor, {2, 3}, "grad_hidden_states", &out);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("grad_hidden_states"), absl::string_view::npos);
}

TEST(SplitPlanTest, TokensAndMessageLimits) {
  MessageSizes sizes;
  sizes.request_fixed = 100;
  sizes.request_per_sequence = 1000;
  auto fits = PlanSplit(4, 16, sizes, 1 << 20, 1 << 20, 64);
  ASSERT_TRUE(fits.ok());
  EXPECT_EQ(*fits, (SplitPlan{{0, 4}}));
  auto by_tokens = PlanSplit(3, 16, sizes, 1 << 20, 1 << 20, 32);
  ASSERT_TRUE(by_tokens.ok());
  EXPECT_EQ(*by_tokens, (SplitPlan{{0, 2}, {2, 1}}));
  auto by_bytes = PlanSplit(10, 1, sizes, 3100, 1 << 20, 0);  // 3 sequences per request
  ASSERT_TRUE(by_bytes.ok());
  EXPECT_EQ(*by_bytes, (SplitPlan{{0, 3}, {3, 3}, {6, 2}, {8, 2}}));
  sizes.response_fixed = 5000;  // e.g. RETURN weight gradients
  sizes.response_per_sequence = 10;
  auto by_response = PlanSplit(10, 1, sizes, 1 << 20, 5025, 0);
  ASSERT_TRUE(by_response.ok());
  EXPECT_EQ(by_response->size(), 5u);  // 2 sequences per answer
  auto too_long = PlanSplit(2, 64, sizes, 1 << 20, 1 << 20, 32);
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("seq_len=64"), absl::string_view::npos);
}

TEST(TensorFilesTest, NpyRoundTrip) {
  testing::TempDir dir;
  HostTensor tensor{{2, 3, 4}, {}};
  for (int i = 0; i < 24; ++i) tensor.data.push_back(0.5f * i - 3);
  const std::string path = dir.path() + "/t.npy";
  ASSERT_TRUE(WriteNpy(path, tensor).ok());
  auto back = ReadNpy(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->shape, tensor.shape);
  EXPECT_EQ(back->data, tensor.data);
  EXPECT_FALSE(ReadNpy(dir.path() + "/missing.npy").ok());
}

TEST(TensorFilesTest, SafetensorsReadsWhatItWritesAndBf16) {
  testing::TempDir dir;
  HostTensor a{{2, 2}, {1, 2, 3, 4}};
  HostTensor b{{3}, {-1, 0.5f, 8}};
  const std::string path = dir.path() + "/x.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"a", &a}, {"b.weight", &b}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->entries().size(), 2u);
  EXPECT_EQ(file->entries().at("b.weight").dtype, "F32");
  auto bytes = file->ReadBytes("b.weight");
  ASSERT_TRUE(bytes.ok());
  std::vector<float> values(3);
  ASSERT_TRUE(DecodeFloats(*bytes, v1::DTYPE_FLOAT32, absl::MakeSpan(values)).ok());
  EXPECT_EQ(values, b.data);
  EXPECT_EQ(file->ReadBytes("nope").status().code(), absl::StatusCode::kNotFound);

  // A hand-written BF16 file with metadata, as Hugging Face writes them.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  const std::string bf16_path = dir.path() + "/bf16.safetensors";
  {
    std::ofstream out(bf16_path, std::ios::binary);
    uint64_t length = header.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << header;
    const uint16_t data[2] = {FloatToBFloat16(1.5f), FloatToBFloat16(-2.0f)};
    out.write(reinterpret_cast<const char*>(data), 4);
  }
  auto bf16 = SafetensorsFile::Open(bf16_path);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(WireDTypeOf(bf16->entries().at("w").dtype), v1::DTYPE_BFLOAT16);
  auto raw = bf16->ReadBytes("w");
  ASSERT_TRUE(raw.ok());
  std::vector<float> decoded(2);
  ASSERT_TRUE(DecodeFloats(*raw, v1::DTYPE_BFLOAT16, absl::MakeSpan(decoded)).ok());
  EXPECT_EQ(decoded, (std::vector<float>{1.5f, -2.0f}));

  // A broken header is an error, not a crash.
  const std::string bad_path = dir.path() + "/bad.safetensors";
  {
    std::ofstream out(bad_path, std::ios::binary);
    const std::string bad = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0})";
    uint64_t length = bad.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << bad;
  }
  EXPECT_EQ(SafetensorsFile::Open(bad_path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReferenceCheckTest, SpecSectionFourRule) {
  EXPECT_DOUBLE_EQ(SpecAtol(2, 541), .0079);
  EXPECT_DOUBLE_EQ(SpecAtol(64, 256), .0099);
  EXPECT_DOUBLE_EQ(SpecAtol(3, 7), .0067);
  std::vector<float> reference(1000, 1.0f);
  std::vector<float> got = reference;
  for (int i = 0; i < 10; ++i) got[i] += 0.1f;  // 1% misses: still passes
  EXPECT_TRUE(CompareOutput("x", got, reference, .0067, false).passed);
  got[10] += 0.1f;  // 1.1%: fails
  EXPECT_FALSE(CompareOutput("x", got, reference, .0067, false).passed);
  got = reference;
  got[0] += 0.0067f + 0.0009f;  // inside atol + 1e-3*|ref|
  EXPECT_EQ(CompareOutput("x", got, reference, .0067, false).misses, 0);
  got[1] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(CompareOutput("x", got, reference, .0067, false).passed);  // no Inf allowed
  std::vector<float> norm_ref(128, 0.5f), norm = norm_ref;
  norm[3] = 2;
  EXPECT_TRUE(CompareOutput("n", norm, norm_ref, .0067, true).passed);  // one miss allowed
  norm[4] = 2;
  EXPECT_FALSE(CompareOutput("n", norm, norm_ref, .0067, true).passed);
}

TEST(RandomTensorsTest, DeterministicAndShapedAsSpecSectionThree) {
  const LayerConfig config;
  const WeightSet a = RandomWeights(config, 5), b = RandomWeights(config, 5), c = RandomWeights(config, 6);
  EXPECT_EQ(a.q_norm.data, b.q_norm.data);
  EXPECT_NE(a.q_norm.data, c.q_norm.data);
  EXPECT_EQ(a.o_proj.shape, (std::vector<int64_t>{3072, 3072}));
  EXPECT_EQ(a.k_proj.shape, (std::vector<int64_t>{1024, 3072}));
  double sum_squares = 0;
  for (float v : a.q_proj.data) sum_squares += double{v} * v;
  EXPECT_NEAR(std::sqrt(sum_squares / a.q_proj.data.size()), std::sqrt(2.0 / 3072), 1e-4);
  const BatchInputs inputs = RandomBatchInputs(config, 2, 5, 1);
  EXPECT_EQ(inputs.hidden_states.size(), 2u * 5 * 3072);
  EXPECT_EQ(inputs.cos.size(), 2u * 5 * 128);
  // Position 0: cos 1, sin 0; rotate-half embedding [f, f]; the same in every sequence.
  EXPECT_EQ(inputs.cos[0], 1.0f);
  EXPECT_EQ(inputs.sin[0], 0.0f);
  EXPECT_FLOAT_EQ(inputs.cos[128 + 1], std::cos(std::pow(10000.0, -2.0 / 128)));
  EXPECT_EQ(inputs.sin[128 + 3], inputs.sin[128 + 64 + 3]);
  EXPECT_EQ(inputs.cos[5 * 128 + 128 + 7], inputs.cos[128 + 7]);
}

}  // namespace
}  // namespace attngrad
