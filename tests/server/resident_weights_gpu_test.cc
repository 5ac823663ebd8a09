// The GPU worker's resident weights (server/devices/gpu_worker.cc): every batch reads the fp16
// copies the worker prepared at startup or at the last LoadWeights, never per batch and never a
// stale one. A server that started with weights A and then loaded B answers, bit for bit, what a
// server started with B answers, in every precision mode (FP16 and AUTO read the prepared copies,
// FP32/TF32 the fp32 weights), and loading A again gives A's answers back; the old copies would
// give A's answers after B's upload (or a mix). Label gpu: skips without a GPU.
#include <cstring>
#include <string>
#include <vector>

#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

class ServerResidentWeightsGpuTest : public ServerTest {
 protected:
  void SetUp() override {
    if (DeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
    ServerTest::SetUp();
  }
  void Customize(ServerOptions& options) override { options.devices = "0"; }
};

struct Answer {
  std::vector<float> grad_hidden_states;
  LayerTensors weight_gradients;
};

Answer RunReturn(v1::AttentionGradient::Stub& stub, const LayerConfig& config, const Batch& batch,
                 v1::Precision precision, std::uint64_t batch_id, const std::string& what) {
  v1::BackwardRequest request = MakeRequest(config, batch, batch_id, v1::GRADIENT_MODE_RETURN);
  request.set_precision(precision);
  const v1::BackwardResponse response = RunOne(stub, request);
  EXPECT_FALSE(response.has_error()) << what << ": " << response.error().message();
  return Answer{ToFloats(response.grad_hidden_states()), ResponseWeightGradients(response)};
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void ExpectSameBits(const Answer& got, const Answer& want, const std::string& what) {
  EXPECT_TRUE(BitwiseEqual(got.grad_hidden_states, want.grad_hidden_states))
      << what << ": grad_hidden_states";
  for (Weight weight : kAllWeights) {
    EXPECT_TRUE(BitwiseEqual(got.weight_gradients[weight], want.weight_gradients[weight]))
        << what << ": " << WeightModuleName(weight);
  }
}

TEST_F(ServerResidentWeightsGpuTest, NewWeightsReplaceTheResidentCopiesInEveryMode) {
  // A second server on the same GPU, started with the weights the first one will load.
  constexpr std::uint64_t kOtherSeed = kWeightsSeed + 1;
  ServerOptions other_options = options_;
  other_options.weights_seed = kOtherSeed;
  absl::StatusOr<std::unique_ptr<GradientServer>> other_server =
      GradientServer::Start(other_options);
  ASSERT_TRUE(other_server.ok()) << other_server.status();
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  auto other_stub = v1::AttentionGradient::NewStub(
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string((*other_server)->port()),
                                grpc::InsecureChannelCredentials(), arguments));

  const Batch batch = MakeBatch(config(), 1, 128, 1700);
  const v1::Precision precisions[] = {v1::PRECISION_AUTO, v1::PRECISION_FP16, v1::PRECISION_FP32,
                                      v1::PRECISION_TF32};
  std::vector<Answer> initial, other;
  std::uint64_t batch_id = 1;
  for (v1::Precision precision : precisions) {
    const std::string mode = v1::Precision_Name(precision);
    // Twice each: the second batch replays the kernels' cached CUDA graph.
    initial.push_back(RunReturn(stub(), config(), batch, precision, batch_id++, mode + " initial"));
    ExpectSameBits(RunReturn(stub(), config(), batch, precision, batch_id++, mode), initial.back(),
                   mode + " initial weights, second batch");
    other.push_back(
        RunReturn(*other_stub, config(), batch, precision, batch_id++, mode + " other"));
  }
  ASSERT_FALSE(BitwiseEqual(initial[0].grad_hidden_states, other[0].grad_hidden_states))
      << "the two weight versions give the same answer: the test cannot tell them apart";

  const LayerWeights replacement = RandomLayerWeights(config(), kOtherSeed);
  v1::LoadWeightsResponse loaded;
  grpc::Status status = Upload(stub(), replacement, /*expected_version=*/1, &loaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (std::size_t i = 0; i < std::size(precisions); ++i) {
    const std::string mode = v1::Precision_Name(precisions[i]);
    ExpectSameBits(RunReturn(stub(), config(), batch, precisions[i], batch_id++, mode), other[i],
                   mode + " after loading the other weights");
  }

  // And back: the copies are re-made in place each time.
  status =
      Upload(stub(), RandomLayerWeights(config(), kWeightsSeed), /*expected_version=*/2, &loaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (std::size_t i = 0; i < std::size(precisions); ++i) {
    const std::string mode = v1::Precision_Name(precisions[i]);
    ExpectSameBits(RunReturn(stub(), config(), batch, precisions[i], batch_id++, mode), initial[i],
                   mode + " after loading the initial weights again");
  }
  (*other_server)->Shutdown(absl::Seconds(5));
}

}  // namespace
}  // namespace attngrad::server::testing
