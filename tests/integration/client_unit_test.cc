// The client library's pieces that need no server: the split plan, .npy files, the SPEC section 4
// comparison rule, the deterministic generators, the layer map and the merge of several servers'
// model info. (Wire dtypes, tensors and safetensors files are
// the wire library's: tests/proto.)
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "attngrad/sharded_client.h"
#include "client_impl.h"
#include "gmock/gmock.h"
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

TEST(LayerMapTest, ParsesRangesSingleLayersAndPlainTargets) {
  auto map = ParseLayerMap(" 13-25=host-b:50051, 0-12=host-a:50051 ,26=host-c:1");
  ASSERT_TRUE(map.ok()) << map.status();
  ASSERT_EQ(map->size(), 3u);
  EXPECT_EQ((*map)[0].first, 0);
  EXPECT_EQ((*map)[0].last, 12);
  EXPECT_EQ((*map)[0].target, "host-a:50051");
  EXPECT_EQ((*map)[1].first, 13);
  EXPECT_EQ((*map)[2].first, 26);
  EXPECT_EQ((*map)[2].last, 26);
  EXPECT_EQ(LayerMapString(*map), "0-12=host-a:50051,13-25=host-b:50051,26=host-c:1");
  EXPECT_TRUE((*map)[1].Contains(25));
  EXPECT_FALSE((*map)[1].Contains(26));
  auto plain = ParseLayerMap("host-a:50051");
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_EQ(plain->size(), 1u);
  EXPECT_TRUE((*plain)[0].all_layers());
  EXPECT_TRUE((*plain)[0].Contains(1000));
  EXPECT_EQ(LayerMapString(*plain), "host-a:50051");
}

TEST(LayerMapTest, RefusesMalformedMapsNamingThePiece) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"0-12=a:1,12-20=b:2", "overlap"}, {"0-x=a:1", "\"0-x=a:1\""},
      {"5-2=a:1", "FIRST <= LAST"},      {"0-3=", "no address"},
      {"a:1,b:2", "need layer ranges"},  {"", "empty"},
      {"0-3=a:1,b:2", "no '='"}};
  for (const auto& [text, fragment] : cases) {
    auto map = ParseLayerMap(text);
    ASSERT_FALSE(map.ok()) << text;
    EXPECT_EQ(map.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(map.status().message()), ::testing::HasSubstr(fragment)) << text;
  }
}

v1::GetModelInfoResponse ServerInfo(const std::string& model, std::vector<int> layers,
                                    int64_t max_tokens) {
  v1::GetModelInfoResponse info;
  info.set_model_name(model);
  info.set_num_hidden_layers(26);
  info.mutable_config()->set_hidden_size(1152);
  info.mutable_config()->set_num_heads(4);
  info.mutable_config()->set_num_kv_heads(1);
  info.mutable_config()->set_head_dim(256);
  info.set_max_batch_tokens(max_tokens);
  info.set_server_instance_id(absl::StrCat("id-", layers.front()));
  for (int index : layers) {
    v1::LayerInfo* layer = info.add_layers();
    layer->set_index(index);
    *layer->mutable_config() = info.config();
  }
  info.add_devices()->set_name(absl::StrCat("device-", layers.front()));
  return info;
}

TEST(MergeModelInfoTest, LayersOfEveryServerSmallestLimits) {
  auto map = ParseLayerMap("0-1=a:1,2-3=b:2");
  ASSERT_TRUE(map.ok());
  // Server a holds 0-2 (layer 2 is b's in the map: not taken from a).
  auto merged = MergeModelInfo(
      *map, {ServerInfo("gemma-3-1b", {0, 1, 2}, 4096), ServerInfo("gemma-3-1b", {2, 3}, 1024)});
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_EQ(merged->layers_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(merged->layers(i).index(), i);
  EXPECT_EQ(merged->max_batch_tokens(), 1024);
  EXPECT_EQ(merged->devices_size(), 2);
  EXPECT_EQ(merged->server_instance_id(), "id-0,id-2");
}

TEST(MergeModelInfoTest, RefusesDifferentModelsAndMissingLayers) {
  auto map = ParseLayerMap("0-1=a:1,2-3=b:2");
  ASSERT_TRUE(map.ok());
  auto models = MergeModelInfo(
      *map, {ServerInfo("gemma-3-1b", {0, 1}, 0), ServerInfo("gemma-3-4b", {2, 3}, 0)});
  EXPECT_EQ(models.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(models.status().message()), ::testing::HasSubstr("different models"));
  v1::GetModelInfoResponse wider = ServerInfo("gemma-3-1b", {2, 3}, 0);
  wider.mutable_config()->set_head_dim(128);
  auto shapes = MergeModelInfo(*map, {ServerInfo("gemma-3-1b", {0, 1}, 0), wider});
  EXPECT_EQ(shapes.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(shapes.status().message()), ::testing::HasSubstr("head_dim 128"));
  auto missing =
      MergeModelInfo(*map, {ServerInfo("gemma-3-1b", {0, 1}, 0), ServerInfo("gemma-3-1b", {2}, 0)});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(missing.status().message()),
              ::testing::HasSubstr("sends layer 3 (2-3=b:2) to b:2, which holds layers 2-2"));
}

TEST(RoundToWireDTypeTest, RoundsAsTheWireDoes) {
  std::vector<float> values = {1.0f, 1.00390625f, 1.0f + 1.0f / 1024, 3.14159265f};
  std::vector<float> bf16 = values;
  RoundToWireDType(v1::DTYPE_BFLOAT16, &bf16);
  EXPECT_EQ(bf16[0], 1.0f);
  EXPECT_EQ(bf16[1], 1.0f);  // a tie rounds to even
  EXPECT_EQ(bf16[3], 3.140625f);
  std::vector<float> fp16 = values;
  RoundToWireDType(v1::DTYPE_FLOAT16, &fp16);
  EXPECT_EQ(fp16[2], 1.0f + 1.0f / 1024);  // representable in fp16, not in bf16
  EXPECT_EQ(fp16[3], 3.140625f);
  std::vector<float> fp32 = values;
  RoundToWireDType(v1::DTYPE_FLOAT32, &fp32);
  EXPECT_EQ(fp32, values);
}

}  // namespace
}  // namespace attngrad
