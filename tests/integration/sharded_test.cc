// A model's layers spread over two servers and the client's connections and input dtype, against
// real attngrad-server processes (CPU backend, --weights=random --model=gemma-3-270m):
// attngrad::ShardedClient over the layer map "4=serverA,5=serverB" (merged info, every
// layer-addressed call reaching the server of its layer, one ShardedStream across both, the
// refusals), attngrad-cli with a layer map as --target, ClientOptions::channels (streams on
// distinct TCP connections: this process's sockets counted in /proc/net/tcp),
// BackwardBatch::input_dtype (bf16 on the wire = the fp32 answer of the rounded inputs, bit for
// bit) and `attngrad-cli bench --channels --input_dtype`.
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attngrad/client.h"
#include "attngrad/sharded_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "random_tensors.h"
#include "test_support.h"

namespace attngrad {
namespace {

using ::attngrad::testing::CliBinary;
using ::attngrad::testing::NormalValues;
using ::attngrad::testing::RunCommand;
using ::attngrad::testing::TestServer;
using ::testing::HasSubstr;

constexpr int kHidden = 640;  // gemma-3-270m

// Inodes of the sockets this process holds open (the links "socket:[inode]" in /proc/self/fd).
std::set<std::string> OwnSocketInodes() {
  std::set<std::string> inodes;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", error)) {
    const std::string link = std::filesystem::read_symlink(entry.path(), error).string();
    if (!error && absl::StartsWith(link, "socket:[") && absl::EndsWith(link, "]")) {
      inodes.insert(link.substr(8, link.size() - 9));
    }
  }
  return inodes;
}

// ESTABLISHED TCP connections of this process whose remote end is port `port` on loopback: the
// client side of each connection this test's clients hold to a server listening there. Sockets of
// other processes (the servers, other tests' clients) are not counted.
int OwnConnectionsTo(int port) {
  const std::set<std::string> own = OwnSocketInodes();
  int count = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream file(table);
    std::string line;
    std::getline(file, line);  // header
    while (std::getline(file, line)) {
      std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.size() < 10 || fields[3] != "01" || own.count(fields[9]) == 0) continue;
      const std::string& remote = fields[2];
      int remote_port = 0;
      if (absl::SimpleHexAtoi(remote.substr(remote.rfind(':') + 1), &remote_port) &&
          remote_port == port) {
        ++count;
      }
    }
  }
  return count;
}

// Polls OwnConnectionsTo(port) until it is `expected` or 10 s have passed; returns the last count.
// A destroyed client closes its connections asynchronously, so the count settles after a moment.
int OwnConnectionsSettleAt(int port, int expected) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  int count = OwnConnectionsTo(port);
  while (count != expected && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    count = OwnConnectionsTo(port);
  }
  return count;
}

class ShardedTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto a = TestServer::Start({"--model=gemma-3-270m", "--layers=4-4"});
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = TestServer::Start({"--model=gemma-3-270m", "--layers=5-5"});
    ASSERT_TRUE(b.ok()) << b.status();
    server_a_ = a->release();
    server_b_ = b->release();
  }
  static void TearDownTestSuite() {
    delete server_a_;
    delete server_b_;
    server_a_ = server_b_ = nullptr;
  }

  static std::string Map() {
    return absl::StrCat("4=", server_a_->target(), ",5=", server_b_->target());
  }

  BackwardBatch Batch(int layer, int seq_len, v1::GradientMode mode) {
    hidden_ = NormalValues(static_cast<std::size_t>(seq_len) * kHidden, 0.04f, ++seed_);
    grad_ = NormalValues(static_cast<std::size_t>(seq_len) * kHidden, 1.f, ++seed_);
    BackwardBatch batch;
    batch.batch = 1;
    batch.seq_len = seq_len;
    batch.hidden_states = hidden_;
    batch.grad_output = grad_;
    batch.layer = layer;
    batch.mode = mode;
    return batch;
  }

  static TestServer* server_a_;
  static TestServer* server_b_;
  std::vector<float> hidden_, grad_;
  unsigned seed_ = 100;
};

TestServer* ShardedTest::server_a_ = nullptr;
TestServer* ShardedTest::server_b_ = nullptr;

TEST_F(ShardedTest, InfoMergesTheServersLayers) {
  auto sharded = ShardedClient::Connect(Map());
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  const v1::GetModelInfoResponse info = (*sharded)->cached_info();
  ASSERT_EQ(info.layers_size(), 2);
  EXPECT_EQ(info.layers(0).index(), 4);
  EXPECT_EQ(info.layers(1).index(), 5);
  EXPECT_EQ(info.model_name(), "gemma-3-270m");
  EXPECT_EQ(info.devices_size(), 2);
  EXPECT_EQ(info.server_instance_id(), absl::StrCat((*sharded)->server(0).server_instance_id(), ",",
                                                    (*sharded)->server(1).server_instance_id()));
  auto health = (*sharded)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServing);
}

TEST_F(ShardedTest, EveryLayerAddressedCallReachesItsServer) {
  auto sharded = ShardedClient::Connect(Map());
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ASSERT_TRUE((*sharded)->FetchLayers({4, 5}, /*zero_after=*/true).ok());
  // One stream across both servers: 2 batches of layer 4, 1 of layer 5.
  auto stream = (*sharded)->StartStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::set<uint64_t> ids;
  std::vector<std::vector<float>> kept;  // the spans must live until Submit returns: they do
  for (int layer : {4, 5, 4}) {
    BackwardBatch batch = Batch(layer, 3, v1::GRADIENT_MODE_ACCUMULATE);
    auto id = (*stream)->Submit(batch);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.insert(*id);
  }
  std::multiset<int> layers;
  for (int i = 0; i < 3; ++i) {
    auto result = (*stream)->Next(absl::Seconds(60));
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE(result->status.ok()) << result->status;
    EXPECT_TRUE(ids.count(result->batch_id));
    layers.insert(result->layer);
  }
  EXPECT_EQ(layers, (std::multiset<int>{4, 4, 5}));
  EXPECT_EQ((*stream)->Next(absl::Seconds(1)).status().code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE((*stream)->Finish().ok());

  // Each server holds the windows of its own layer.
  auto fetched = (*sharded)->FetchLayers({5, 4}, /*zero_after=*/false);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  ASSERT_EQ(fetched->size(), 2u);
  EXPECT_EQ((*fetched)[0].state.layer(), 5);
  EXPECT_EQ((*fetched)[0].state.batches(), 1);
  EXPECT_EQ((*fetched)[0].state.server_instance_id(), (*sharded)->server(1).server_instance_id());
  EXPECT_EQ((*fetched)[1].state.layer(), 4);
  EXPECT_EQ((*fetched)[1].state.batches(), 2);
  EXPECT_EQ((*fetched)[1].state.server_instance_id(), (*sharded)->server(0).server_instance_id());

  auto zeroed = (*sharded)->Zero(0, 4);
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  EXPECT_EQ(zeroed->previous().batches(), 2);
  auto layer_5 = (*sharded)->Fetch(false, 0, 5);
  ASSERT_TRUE(layer_5.ok()) << layer_5.status();
  EXPECT_EQ(layer_5->state.batches(), 1);

  // A weight upload changes only its layer's server.
  auto before = (*sharded)->Info();
  ASSERT_TRUE(before.ok()) << before.status();
  LayerConfig config;
  config.hidden_size = kHidden;
  config.num_heads = 4;
  config.num_kv_heads = 1;
  config.head_dim = 256;
  auto version = (*sharded)->LoadWeights(RandomWeights(config, 3), 0, 5);
  ASSERT_TRUE(version.ok()) << version.status();
  auto after = (*sharded)->Info();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->layers(1).weights_version(), *version);
  EXPECT_NE(after->layers(1).weights_version(), before->layers(1).weights_version());
  EXPECT_EQ(after->layers(0).weights_version(), before->layers(0).weights_version());

  // The one-batch call is routed too.
  auto one = (*sharded)->Backward(Batch(5, 2, v1::GRADIENT_MODE_RETURN));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->layer, 5);
}

TEST_F(ShardedTest, RefusesWhatTheMapCannotServe) {
  auto sharded = ShardedClient::Connect(Map());
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  auto outside = (*sharded)->Backward(Batch(6, 2, v1::GRADIENT_MODE_RETURN));
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(outside.status().message()),
              HasSubstr("layer 6 is not in the layer map"));
  BackwardBatch unnamed = Batch(4, 2, v1::GRADIENT_MODE_RETURN);
  unnamed.layer.reset();
  EXPECT_EQ((*sharded)->Backward(unnamed).status().code(), absl::StatusCode::kInvalidArgument);

  // The map sends layers 4-5 to a server holding only 4.
  auto short_server = ShardedClient::Connect(absl::StrCat("4-5=", server_a_->target()));
  ASSERT_FALSE(short_server.ok());
  EXPECT_EQ(short_server.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(short_server.status().message()), HasSubstr("--layers=4-5"));

  // Servers of different models.
  auto other = TestServer::Start({"--model=gemma-3-1b", "--layers=5-5"});
  ASSERT_TRUE(other.ok()) << other.status();
  auto mixed =
      ShardedClient::Connect(absl::StrCat("4=", server_a_->target(), ",5=", (*other)->target()));
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(mixed.status().message()), HasSubstr("different models"));
}

TEST_F(ShardedTest, CliTakesALayerMap) {
  std::string out;
  const std::string target = "--target=" + Map();
  ASSERT_EQ(RunCommand({CliBinary(), "info", target}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("layer 4              sliding"));
  EXPECT_THAT(out, HasSubstr("layer 5              full"));
  EXPECT_THAT(out, HasSubstr("server               4=" + server_a_->target()));
  ASSERT_EQ(RunCommand({CliBinary(), "zero", "--layer=5", target}, &out), 0) << out;
  ASSERT_EQ(RunCommand({CliBinary(), "backward", "--layer=5", "--batch=1", "--seq_len=4",
                        "--count=2", "--mode=accumulate", "--rotary=positions", target},
                       &out),
            0)
      << out;
  ASSERT_EQ(RunCommand({CliBinary(), "fetch", "--layers=4,5", target}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("layer 5: window"));
  EXPECT_THAT(out, HasSubstr("2 batches, 8 tokens"));
  EXPECT_NE(RunCommand({CliBinary(), "backward", "--batch=1", "--seq_len=4", target}, &out), 0);
  EXPECT_THAT(out, HasSubstr("name the layer"));
  EXPECT_NE(RunCommand({CliBinary(), "info", "--target=0-3=a:1,2-5=b:2"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("overlap"));
}

// --check uploads its weights to the layer it checks (and pins that layer's version), whichever
// server of the map holds it; a bf16 input is checked against the reference of the rounded input.
TEST_F(ShardedTest, CliCheckUploadsToTheCheckedLayer) {
  std::string out;
  for (const char* input_dtype : {"float32", "bfloat16"}) {
    ASSERT_EQ(RunCommand({CliBinary(), "backward", "--target=" + Map(), "--layer=5", "--batch=2",
                          "--seq_len=6", "--check", std::string("--input_dtype=") + input_dtype},
                         &out),
              0)
        << out;
    EXPECT_THAT(out, HasSubstr("SPEC section 4, atol 0.0067): PASS"));
    EXPECT_THAT(out, HasSubstr("1 ok, 0 failed"));
  }
}

TEST_F(ShardedTest, StreamsTakeTheirOwnConnections) {
  for (int channels : {1, 3}) {
    // The probe of TestServer::Start and the previous iteration's client close their
    // connections asynchronously: start from none.
    ASSERT_EQ(OwnConnectionsSettleAt(server_a_->grpc_port(), 0), 0);
    ClientOptions options;
    options.channels = channels;
    auto client = Client::Connect(server_a_->target(), options);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ((*client)->channel_count(), channels);
    std::vector<std::unique_ptr<BackwardStream>> streams;
    for (int i = 0; i < 3; ++i) {
      auto stream = (*client)->StartStream();
      ASSERT_TRUE(stream.ok()) << stream.status();
      auto id = (*stream)->Submit(Batch(4, 2, v1::GRADIENT_MODE_RETURN));
      ASSERT_TRUE(id.ok()) << id.status();
      ASSERT_TRUE((*stream)->Await(*id).ok());
      streams.push_back(*std::move(stream));
    }
    EXPECT_EQ(OwnConnectionsTo(server_a_->grpc_port()), channels) << "channels=" << channels;
  }
}

TEST_F(ShardedTest, Bfloat16InputsAreTheRoundedInputs) {
  auto client = Client::Connect(server_a_->target());
  ASSERT_TRUE(client.ok()) << client.status();
  BackwardBatch batch = Batch(4, 3, v1::GRADIENT_MODE_RETURN);
  batch.input_dtype = v1::DTYPE_BFLOAT16;
  auto wire = (*client)->Backward(batch);
  ASSERT_TRUE(wire.ok()) << wire.status();
  std::vector<float> hidden = hidden_, grad = grad_;
  RoundToWireDType(v1::DTYPE_BFLOAT16, &hidden);
  RoundToWireDType(v1::DTYPE_BFLOAT16, &grad);
  ASSERT_NE(hidden, hidden_);  // the rounding changed the input
  batch.hidden_states = hidden;
  batch.grad_output = grad;
  batch.input_dtype = v1::DTYPE_FLOAT32;
  auto exact = (*client)->Backward(batch);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(wire->grad_hidden_states, exact->grad_hidden_states);
  for (Weight weight : kAllWeights) {
    EXPECT_EQ((*wire->weight_gradients)[weight].data, (*exact->weight_gradients)[weight].data)
        << WeightModuleName(weight);
  }
  // Half the bytes of hidden_states and grad_output.
  EXPECT_LT(wire->request_bytes, exact->request_bytes * 6 / 10);
  batch.input_dtype = static_cast<v1::DType>(77);
  EXPECT_EQ((*client)->Backward(batch).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShardedTest, CliBenchWithChannelsAndInputDType) {
  std::string out;
  ASSERT_EQ(RunCommand({CliBinary(), "bench", "--target=" + server_a_->target(), "--layer=4",
                        "--streams=2", "--channels=2", "--in_flight=1", "--count=2", "--batch=1",
                        "--seq_len=4", "--input_dtype=bfloat16", "--response_dtype=float16",
                        "--progress=false"},
                       &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("2 channels"));
  EXPECT_THAT(out, HasSubstr("input bfloat16, response float16"));
  EXPECT_THAT(out, HasSubstr("errors      0"));
  // 16-bit inputs drawn once and sent as they are, a 16-bit answer copied into 16-bit buffers; with
  // --float32_api the client converts both ways per batch.
  EXPECT_THAT(out, HasSubstr("inputs borrowed bfloat16, answers into reused float16 buffers"));
  ASSERT_EQ(RunCommand({CliBinary(), "bench", "--target=" + server_a_->target(), "--layer=4",
                        "--streams=1", "--in_flight=2", "--count=2", "--batch=1", "--seq_len=4",
                        "--input_dtype=bfloat16", "--response_dtype=bfloat16", "--float32_api",
                        "--progress=false"},
                       &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("inputs copied float32, answers into reused float32 buffers"));
  EXPECT_THAT(out, HasSubstr("errors      0"));
  EXPECT_NE(RunCommand({CliBinary(), "bench", "--target=" + server_a_->target(),
                        "--input_dtype=int4", "--count=1", "--progress=false"},
                       &out),
            0);
}

}  // namespace
}  // namespace attngrad
