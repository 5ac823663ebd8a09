// The client library's pieces that need no server: the split plan, .npy files, the SPEC section 4
// comparison rule and the deterministic generators. (Wire dtypes, tensors and safetensors files are
// the wire library's: tests/proto.)
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "client_impl.h"
#include "gtest/gtest.h"
#include "random_tensors.h"
#include "reference_check.h"
#include "tensor_files.h"
#include "test_support.h"

namespace attngrad {
namespace {

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
  const WeightSet a = RandomWeights(config, 5), b = RandomWeights(config, 5),
                  c = RandomWeights(config, 6);
  EXPECT_EQ(a[Weight::kQNorm].data, b[Weight::kQNorm].data);
  EXPECT_NE(a[Weight::kQNorm].data, c[Weight::kQNorm].data);
  EXPECT_EQ(a[Weight::kOProj].shape, (std::vector<int64_t>{3072, 3072}));
  EXPECT_EQ(a[Weight::kKProj].shape, (std::vector<int64_t>{1024, 3072}));
  double sum_squares = 0;
  for (float v : a[Weight::kQProj].data) sum_squares += double{v} * v;
  EXPECT_NEAR(std::sqrt(sum_squares / a[Weight::kQProj].data.size()), std::sqrt(2.0 / 3072), 1e-4);
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
