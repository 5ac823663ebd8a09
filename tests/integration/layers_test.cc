// The C++ client and attngrad-cli against the real server holding two layers of a model
// (--weights=random --model=gemma-3-270m --layers=4-5): GetModelInfo's layers, layer-addressed
// batches, per-layer accumulation, FetchLayers and a per-layer Zero, an unknown layer refused
// naming the range, and the CLI's --layer / fetch --layers.
#include <memory>
#include <vector>

#include "attngrad/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_support.h"

namespace attngrad {
namespace {

using ::attngrad::testing::CliBinary;
using ::attngrad::testing::NormalValues;
using ::attngrad::testing::RunCommand;
using ::attngrad::testing::TestServer;
using ::testing::HasSubstr;

constexpr int kHidden = 640;  // gemma-3-270m

TEST(LayersTest, ClientAndCliAddressTheServersLayers) {
  auto server = TestServer::Start({"--model=gemma-3-270m", "--layers=4-5"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Client::Connect((*server)->target());
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::GetModelInfoResponse info = (*client)->cached_info();
  ASSERT_EQ(info.layers_size(), 2);
  EXPECT_EQ(info.layers(0).index(), 4);
  EXPECT_EQ(info.layers(0).type(), v1::ATTENTION_TYPE_SLIDING);
  EXPECT_EQ(info.layers(1).type(), v1::ATTENTION_TYPE_FULL);

  const int seq_len = 5;
  const std::vector<float> hidden = NormalValues(seq_len * kHidden, 0.04f, 1);
  const std::vector<float> grad = NormalValues(seq_len * kHidden, 1.f, 2);
  BackwardBatch batch;
  batch.batch = 1;
  batch.seq_len = seq_len;
  batch.hidden_states = hidden;
  batch.grad_output = grad;  // no cos/sin: the server builds the layer's tables of 0..S-1
  batch.layer = 5;
  batch.mode = v1::GRADIENT_MODE_ACCUMULATE;
  for (int i = 0; i < 2; ++i) {
    auto result = (*client)->Backward(batch);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->layer, 5);
  }
  batch.layer = 4;
  ASSERT_TRUE((*client)->Backward(batch).ok());

  auto fetched = (*client)->FetchLayers({5, 4}, /*zero_after=*/false);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  ASSERT_EQ(fetched->size(), 2u);
  EXPECT_EQ((*fetched)[0].state.layer(), 5);
  EXPECT_EQ((*fetched)[0].state.batches(), 2);
  EXPECT_EQ((*fetched)[1].state.layer(), 4);
  EXPECT_EQ((*fetched)[1].state.batches(), 1);
  EXPECT_EQ((*fetched)[0].gradients[Weight::kQProj].shape, (std::vector<int64_t>{1024, kHidden}));

  auto zeroed = (*client)->Zero(0, 5);
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  EXPECT_EQ(zeroed->previous().batches(), 2);
  auto layer_4 = (*client)->Fetch(false, 0, 4);
  ASSERT_TRUE(layer_4.ok()) << layer_4.status();
  EXPECT_EQ(layer_4->state.batches(), 1);

  batch.layer = 7;
  auto missing = (*client)->Backward(batch);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("4-5"));

  std::string out;
  const std::string target = "--target=" + (*server)->target();
  ASSERT_EQ(RunCommand({CliBinary(), "info", target}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("layer 5              full"));
  ASSERT_EQ(RunCommand({CliBinary(), "backward", "--layer=5", "--batch=1", "--seq_len=4",
                        "--count=1", "--mode=accumulate", "--rotary=positions", target},
                       &out),
            0)
      << out;
  ASSERT_EQ(RunCommand({CliBinary(), "fetch", "--layers=4,5", target}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("layer 4: window"));
  EXPECT_THAT(out, HasSubstr("layer 5: window"));
  EXPECT_THAT(out, HasSubstr("1 batches"));
  EXPECT_NE(RunCommand({CliBinary(), "backward", "--layer=9", "--batch=1", "--seq_len=4",
                        "--count=1", target},
                       &out),
            0);
  EXPECT_THAT(out, HasSubstr("4-5"));
}

}  // namespace
}  // namespace attngrad
