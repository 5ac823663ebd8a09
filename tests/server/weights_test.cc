// Weights: LoadWeights (streamed upload, versions, refusals) and safetensors checkpoints (fp32,
// bf16 and fp16 tensors, Gemma-3 names behind a prefix, a chosen layer, sharded index files).
#include <optional>
#include <cstdio>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "attngrad/common/read_file.h"
#include "attngrad/wire/safetensors.h"
#include "attngrad/wire/tensor.h"
#include "server_test_util.h"
#include "weights/checkpoint_layer.h"

namespace attngrad::server::testing {
namespace {

class ServerLoadWeightsTest : public ServerTest {};

TEST_F(ServerLoadWeightsTest, UploadBumpsTheVersionAndIsUsed) {
  const Batch batch = MakeBatch(config(), 1, 3, 1100);
  // A window with batches of version 1.
  ASSERT_FALSE(
      RunOne(stub(), MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_ACCUMULATE)).has_error());

  const LayerWeights replacement = RandomLayerWeights(config(), 12);
  v1::LoadWeightsResponse loaded;
  grpc::Status status = Upload(stub(), replacement, /*expected_version=*/1, &loaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(loaded.weights_version(), 2u);

  // Stale expectation: refused before anything is changed.
  v1::LoadWeightsResponse refused;
  status = Upload(stub(), replacement, /*expected_version=*/1, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(status.error_message().find("expected_weights_version"), std::string::npos);

  v1::BackwardRequest request = MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_RETURN);
  request.set_expected_weights_version(1);
  v1::BackwardResponse response = RunOne(stub(), request);
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  request.set_expected_weights_version(2);
  response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(response.weights_version(), 2u);
  const Gradients expected = Reference(replacement, batch);
  EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                    Tolerance(1e-5), "grad_hidden_states with uploaded weights"));
  EXPECT_TRUE(
      Close(ResponseWeightGradients(response), expected.weights, Tolerance(1e-5), "uploaded"));

  // The window holds version-1 gradients: accumulating against version 2 is refused until zeroed.
  response = RunOne(stub(), MakeRequest(config(), batch, 3, v1::GRADIENT_MODE_ACCUMULATE));
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  EXPECT_NE(response.error().message().find("weights version"), std::string::npos);
  v1::FetchGradientsRequest fetch;
  fetch.set_zero_after_fetch(true);
  const Fetched fetched = Fetch(stub(), fetch);
  EXPECT_EQ(fetched.state.weights_version(), 1u);
  EXPECT_EQ(fetched.state.batches(), 1);
  response = RunOne(stub(), MakeRequest(config(), batch, 3, v1::GRADIENT_MODE_ACCUMULATE));
  EXPECT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(Fetch(stub(), v1::FetchGradientsRequest()).state.weights_version(), 2u);

  v1::GetModelInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.weights_version(), 2u);
  EXPECT_EQ(info.weights_source(), "upload");
}

TEST_F(ServerLoadWeightsTest, BadUploadsChangeNothing) {
  LayerWeights small;
  small.config = config();
  small.values = ZeroWeights<std::vector<float>>(config());
  v1::LoadWeightsResponse response;
  // A weight missing.
  grpc::Status status =
      Upload(stub(), small, 0, &response, 1 << 20, /*skip_weight=*/Weight::kKNorm);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("k_norm"), std::string::npos) << status.error_message();
  // A wrong shape.
  status = Upload(stub(), small, 0, &response, 1 << 20, std::nullopt, {3, 3});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("q_proj.shape"), std::string::npos)
      << status.error_message();
  // A non-finite value.
  small.values[Weight::kVProj][5] = std::numeric_limits<float>::infinity();
  status = Upload(stub(), small, 0, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("v_proj.data"), std::string::npos)
      << status.error_message();
  // An unknown weight name.
  {
    grpc::ClientContext context;
    auto writer = stub().LoadWeights(&context, &response);
    v1::LoadWeightsRequest chunk;
    chunk.set_name(static_cast<v1::WeightName>(40));
    writer->Write(chunk);
    writer->WritesDone();
    status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("name"), std::string::npos);
  }
  v1::GetModelInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.weights_version(), 1u);
}

// ---------------------------------------------------------------------------------------------
// safetensors

struct StoredTensor {
  std::string name;
  v1::DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<float> values;  // rounded to dtype by WriteSafetensors
};

// Writes the tensors with Hugging Face's metadata and rounds their values to what was stored.
void WriteSafetensors(const std::string& path, std::vector<StoredTensor>& tensors) {
  std::vector<wire::SafetensorsTensor> written;
  for (StoredTensor& tensor : tensors) {
    std::string raw;
    wire::EncodeFromFloat(tensor.values, tensor.dtype, &raw);
    ASSERT_TRUE(
        wire::DecodeToFloat(raw, tensor.dtype, tensor.name, absl::MakeSpan(tensor.values)).ok());
    written.push_back({tensor.name, tensor.shape, tensor.values, tensor.dtype});
  }
  ASSERT_TRUE(wire::WriteSafetensors(path, written, {{"format", "pt"}}).ok());
}

class ServerSafetensorsTest : public ServerTest {
 protected:
  static constexpr int kLayer = 3;

  void Customize(ServerOptions& options) override {
    small_.hidden_size = 64;
    small_.num_heads = 4;
    small_.num_kv_heads = 2;
    small_.head_dim = 16;
    path_ = ::testing::TempDir() + "attngrad_server_test_" + std::to_string(::getpid()) +
            ".safetensors";
    const LayerWeights layer3 = RandomLayerWeights(small_, 31);
    const LayerWeights layer2 = RandomLayerWeights(small_, 32);
    const v1::DType dtypes[kNumWeights] = {v1::DTYPE_FLOAT32,  v1::DTYPE_BFLOAT16,
                                           v1::DTYPE_FLOAT16,  v1::DTYPE_FLOAT32,
                                           v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16};
    for (const auto& [layer, weights] :
         {std::pair<int, const LayerWeights*>{2, &layer2}, {kLayer, &layer3}}) {
      for (Weight i : kAllWeights) {
        tensors_.push_back(StoredTensor{absl::StrCat("language_model.model.layers.", layer,
                                                     ".self_attn.", WeightModuleName(i), ".weight"),
                                        dtypes[IndexOf(i)], WeightShape(small_, i),
                                        weights->values[i]});
      }
    }
    // A vision-tower layer with the same suffix shape must not be picked up.
    tensors_.push_back(
        StoredTensor{"vision_tower.vision_model.encoder.layers.3.self_attn.q_proj.weight",
                     v1::DTYPE_FLOAT32,
                     {4, 4},
                     std::vector<float>(16, 1.f)});
    WriteSafetensors(path_, tensors_);
    expected_.config = small_;
    for (Weight i : kAllWeights) expected_.values[i] = tensors_[kNumWeights + IndexOf(i)].values;
    options.weights = path_;
    options.weights_layer = kLayer;
    options.devices = "cpu";  // a head_dim-16 layer: the GPU kernels need 128
  }
  void TearDown() override {
    ServerTest::TearDown();
    std::remove(path_.c_str());
  }

  LayerConfig small_;
  std::string path_;
  std::vector<StoredTensor> tensors_;
  LayerWeights expected_;
};

TEST_F(ServerSafetensorsTest, ServesTheChosenLayer) {
  v1::GetModelInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.config().hidden_size(), 64);
  EXPECT_EQ(info.config().num_heads(), 4);
  EXPECT_EQ(info.config().num_kv_heads(), 2);
  EXPECT_EQ(info.config().head_dim(), 16);
  EXPECT_EQ(info.weights_source(), absl::StrCat("safetensors:", path_, "#layer=3"));
  EXPECT_NEAR(info.default_scaling(), 0.25f, 1e-7);

  const Batch batch = MakeBatch(config(), 2, 5, 1200);
  const Gradients expected = Reference(expected_, batch);
  const v1::BackwardResponse response =
      RunOne(stub(), MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_RETURN));
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                    Tolerance(1e-5), "grad_hidden_states"));
  EXPECT_TRUE(
      Close(ResponseWeightGradients(response), expected.weights, Tolerance(1e-5), "weights"));
}

TEST_F(ServerSafetensorsTest, LoaderReadsShardsAndReportsProblems) {
  // The same layer through a sharded index.
  const std::string index =
      ::testing::TempDir() + "attngrad_index_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream file(index);
    file << "{\"metadata\":{\"total_size\":1},\"weight_map\":{";
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      file << (i ? "," : "") << "\"" << tensors_[i].name << "\":\""
           << path_.substr(path_.rfind('/') + 1) << "\"";
    }
    file << "}}";
  }
  absl::StatusOr<LayerWeights> sharded = LoadSafetensorsLayer(index, kLayer);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_TRUE(Close(sharded->values, expected_.values, Tolerance(0), "sharded"));
  std::remove(index.c_str());

  absl::StatusOr<LayerWeights> missing = LoadSafetensorsLayer(path_, 7);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("model.layers.7.self_attn.q_proj.weight"),
            std::string::npos)
      << missing.status();

  // A truncated file and a corrupt header.
  const std::string broken = path_ + ".broken";
  {
    const std::string bytes = common::ReadFileToString(path_).value();
    std::ofstream(broken, std::ios::binary) << bytes.substr(0, bytes.size() - 10);
  }
  EXPECT_FALSE(LoadSafetensorsLayer(broken, kLayer).ok());
  {
    std::ofstream out(broken, std::ios::binary);
    const std::uint64_t length = 5;
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << "{\"a\":";
  }
  absl::StatusOr<LayerWeights> corrupt = LoadSafetensorsLayer(broken, kLayer);
  EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kInvalidArgument) << corrupt.status();
  std::remove(broken.c_str());

  // A server asked for a layer the file lacks does not start.
  ServerOptions options = options_;
  options.weights_layer = 9;
  options.metrics_listen = "";
  absl::StatusOr<std::unique_ptr<GradientServer>> server = GradientServer::Start(options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(server.status().message().find("--weights"), std::string::npos);
}

}  // namespace
}  // namespace attngrad::server::testing
