// attngrad-cli against the real server: every subcommand, backward --check (uploaded weights, the
// server's own weights, a split batch, a mismatch that must fail), and load-weights from a
// safetensors file verified through the library.
#include <memory>

#include "absl/strings/str_cat.h"
#include "attngrad/client.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "random_tensors.h"
#include "reference_check.h"
#include "test_support.h"

namespace attngrad {
namespace {

using ::attngrad::testing::CliBinary;
using ::attngrad::testing::RunCommand;
using ::attngrad::testing::TempDir;
using ::attngrad::testing::TestServer;
using ::testing::HasSubstr;
using ::testing::Not;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = TestServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    if (HasFailure() && server_) std::cerr << "server log (tail):\n" << server_->LogTail() << "\n";
  }
  // Runs attngrad-cli <args> --target=<server>; returns the exit code.
  int Cli(std::vector<std::string> args, std::string* output) {
    args.insert(args.begin(), CliBinary());
    args.push_back("--target=" + server_->target());
    return RunCommand(args, output);
  }
  std::unique_ptr<TestServer> server_;
};

TEST_F(CliTest, InfoAndHealth) {
  std::string out;
  ASSERT_EQ(Cli({"info"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("hidden=3072 heads=24 kv_heads=8 head_dim=128"));
  EXPECT_THAT(out, HasSubstr("random:seed=7"));
  ASSERT_EQ(Cli({"health"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("SERVING"));
}

TEST_F(CliTest, BackwardCheckWithUploadedWeightsPasses) {
  std::string out;
  ASSERT_EQ(
      Cli({"backward", "--batch=2", "--seq_len=8", "--count=2", "--check", "--weights_seed=3"},
          &out),
      0)
      << out;
  EXPECT_THAT(out, HasSubstr("uploaded random:seed=3 as weights version"));
  EXPECT_THAT(out, HasSubstr("PASS"));
  EXPECT_THAT(out, Not(HasSubstr("FAIL")));
  EXPECT_THAT(out, HasSubstr("2 batches (32 tokens)"));
}

TEST_F(CliTest, BackwardCheckWithServerWeightsSplitAndPositionsPasses) {
  std::string out;
  // 3 x 16 = 48 tokens > the server's 32: the client splits the batch in two.
  ASSERT_EQ(Cli({"backward", "--batch=3", "--seq_len=16", "--check", "--check_weights=server",
                 "--weights_seed=7", "--rotary=positions"},
                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("split into 2"));
  EXPECT_THAT(out, HasSubstr("PASS"));
  EXPECT_THAT(out, Not(HasSubstr("FAIL")));
}

TEST_F(CliTest, BackwardCheckFailsOnWrongWeights) {
  std::string out;
  // The CLI refuses to check against weights the server does not hold.
  EXPECT_NE(Cli({"backward", "--check", "--check_weights=server", "--weights_seed=8"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("random:seed=7"));
  // A bad batch reaches the CLI with the server's message and a non-zero exit.
  EXPECT_NE(Cli({"backward", "--expected_weights_version=12345"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("FAILED_PRECONDITION"));
}

TEST_F(CliTest, AccumulateFetchZeroAndBench) {
  TempDir dir;
  std::string out;
  ASSERT_EQ(Cli({"zero"}, &out), 0) << out;
  ASSERT_EQ(Cli({"backward", "--mode=accumulate", "--count=3", "--batch=1", "--seq_len=8"}, &out),
            0)
      << out;
  const std::string file = dir.path() + "/grads.safetensors";
  ASSERT_EQ(Cli({"fetch", "--output=" + file}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("3 batches, 24 tokens"));
  auto written = wire::SafetensorsFile::Open(file);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->tensors().size(), 6u);
  EXPECT_EQ(written->tensors().at("model.layers.0.self_attn.q_proj.weight").shape,
            (std::vector<int64_t>{3072, 3072}));
  ASSERT_EQ(Cli({"fetch", "--zero_after"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("zeroed"));
  ASSERT_EQ(Cli({"fetch"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("0 batches, 0 tokens"));
  ASSERT_EQ(Cli({"bench", "--streams=2", "--in_flight=2", "--count=3", "--batch=1", "--seq_len=8",
                 "--warmup=0"},
                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("bench: 6 batches"));
  EXPECT_THAT(out, HasSubstr("tokens/s"));
  EXPECT_THAT(out, HasSubstr("p99"));
  // The metrics summary: 3 + 6 ACCUMULATE batches of 8 tokens so far.
  ASSERT_EQ(
      Cli({"metrics", absl::StrCat("--metrics_target=127.0.0.1:", server_->metrics_port())}, &out),
      0)
      << out;
  EXPECT_THAT(out, HasSubstr("attngrad_batches_total{device=\"cpu\",mode=\"accumulate\"}"));
  EXPECT_THAT(out, HasSubstr("observed, mean"));
  EXPECT_THAT(out, Not(HasSubstr("_bucket")));
}

// load-weights from a safetensors file (bf16 on the wire when the server accepts it is the file's
// dtype; here F32): the server then computes with exactly those weights.
TEST_F(CliTest, LoadWeightsFromSafetensors) {
  TempDir dir;
  auto client = Client::Connect(server_->target());
  ASSERT_TRUE(client.ok()) << client.status();
  const LayerConfig config = wire::LayerConfigFromWire((*client)->cached_info().config());
  const uint64_t version = (*client)->cached_info().weights_version();
  const WeightSet weights = RandomWeights(config, 11);
  std::vector<wire::SafetensorsTensor> tensors;
  for (Weight weight : kAllWeights) {
    tensors.push_back(
        {wire::HuggingFaceTensorName(2, weight), weights[weight].shape, weights[weight].data});
  }
  const std::string file = dir.path() + "/layer.safetensors";
  ASSERT_TRUE(wire::WriteSafetensors(file, tensors).ok());
  std::string out;
  ASSERT_EQ(Cli({"load-weights", "--weights_file=" + file, "--weights_layer=2"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("weights version ", version + 1)));

  const BatchInputs inputs = RandomBatchInputs(config, 1, 8, 77);
  BackwardBatch batch = inputs.View();
  batch.expected_weights_version = version + 1;
  auto result = (*client)->Backward(batch);
  ASSERT_TRUE(result.ok()) << result.status();
  auto uploaded = ComputeReference(config, inputs, weights);
  auto original = ComputeReference(config, inputs, RandomWeights(config, TestServer::kWeightsSeed));
  ASSERT_TRUE(uploaded.ok() && original.ok());
  EXPECT_TRUE(CheckAgainstReference(result->grad_hidden_states, &*result->weight_gradients,
                                    *uploaded, SpecAtol(1, 8))
                  .passed());
  EXPECT_FALSE(CheckAgainstReference(result->grad_hidden_states, &*result->weight_gradients,
                                     *original, SpecAtol(1, 8))
                   .passed());
  // A layer the file does not have is refused by the CLI with the tensor's name.
  EXPECT_NE(Cli({"load-weights", "--weights_file=" + file, "--weights_layer=0"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("model.layers.0.self_attn.q_proj.weight"));
}

}  // namespace
}  // namespace attngrad
