// A whole checkpoint in one server, on the CPU backend: a tiny Gemma-3-like model directory written
// here (config.json with a text_config, four layers alternating sliding and full attention,
// head_dim 32 (256 on a GPU run), a multimodal tensor prefix, bf16 weights in two shards with an
// index) served with --weights=DIR; layer-addressed batches against BackwardHost with each layer's
// config.json settings (window, RoPE base and linear scaling, scaling, no soft-cap); per-layer
// accumulation, windows and a fetch of several layers; GetModelInfo's layer list; unknown layers;
// per-layer weight versions; and --weights=random --model=gemma-3-270m --layers=0-1.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/safetensors.h"
#include "attngrad/wire/tensor.h"
#include "server_test_util.h"
#include "weights/model.h"

namespace attngrad::server::testing {
namespace {

constexpr int kLayers = 4;
constexpr int kWindow = 4;
constexpr double kLocalTheta = 10000.0;
constexpr double kGlobalTheta = 1000000.0;
constexpr double kGlobalFactor = 8.0;
constexpr double kQueryPreAttnScalar = 24.0;

// The tiny model's head_dim: 32 on the CPU backend (quick), 256 on a GPU test run (the GPU kernels
// compute head_dim 128 and 256: the Gemma-3 270M/1B/4B/12B head size).
int TinyHeadDim() { return TestOnGpu() ? 256 : 32; }

LayerConfig TinyConfig() {
  LayerConfig config;
  config.hidden_size = 64;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.head_dim = TinyHeadDim();
  return config;
}

bool IsSliding(int layer) { return (layer + 1) % 2 != 0; }  // sliding_window_pattern 2

// config.json of the tiny model, text config nested as multimodal checkpoints have it.
std::string TinyConfigJson() {
  return absl::StrReplaceAll(R"({
  "architectures": ["Gemma3ForConditionalGeneration"],
  "model_type": "gemma3",
  "text_config": {
    "model_type": "gemma3_text",
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM,
    "num_hidden_layers": 4, "query_pre_attn_scalar": 24, "attn_logit_softcapping": null,
    "sliding_window": 4, "sliding_window_pattern": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}
  }
})",
                             {{"HEAD_DIM", absl::StrCat(TinyHeadDim())}});
}

// Writes the model directory: layers 0-1 (and layer 2's q_proj) in shard 1, the rest in shard 2,
// all bf16, names behind "model.language_model.". Returns the weights as the server reads them.
std::vector<LayerWeights> WriteTinyCheckpoint(const std::string& directory) {
  std::filesystem::create_directories(directory);
  std::ofstream(directory + "/config.json") << TinyConfigJson();
  std::vector<LayerWeights> layers;
  for (int i = 0; i < kLayers; ++i) layers.push_back(RandomLayerWeights(TinyConfig(), 100 + i));
  std::vector<wire::SafetensorsTensor> shards[2];
  std::map<std::string, std::string> weight_map;
  const std::string shard_names[2] = {"model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors"};
  for (int i = 0; i < kLayers; ++i) {
    for (Weight weight : kAllWeights) {
      const int shard = i < 2 || (i == 2 && weight == Weight::kQProj) ? 0 : 1;
      wire::SafetensorsTensor tensor;
      tensor.name = "model.language_model." + wire::HuggingFaceTensorName(i, weight).substr(6);
      tensor.shape = WeightShape(TinyConfig(), weight);
      tensor.values = layers[static_cast<std::size_t>(i)].values[weight];
      tensor.dtype = v1::DTYPE_BFLOAT16;
      weight_map[tensor.name] = shard_names[shard];
      shards[shard].push_back(tensor);
    }
  }
  for (int shard = 0; shard < 2; ++shard) {
    const absl::Status written =
        wire::WriteSafetensors(directory + "/" + shard_names[shard], shards[shard]);
    EXPECT_TRUE(written.ok()) << written;
  }
  std::ofstream index(directory + "/model.safetensors.index.json");
  index << "{\"metadata\": {}, \"weight_map\": {";
  bool first = true;
  for (const auto& [name, file] : weight_map) {
    index << (first ? "" : ", ") << "\"" << name << "\": \"" << file << "\"";
    first = false;
  }
  index << "}}";
  index.close();
  // The server's fp32 copies are the bf16 values: read them back the way it does.
  absl::StatusOr<wire::SafetensorsCheckpoint> checkpoint =
      wire::SafetensorsCheckpoint::Open(directory);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  for (int i = 0; i < kLayers && checkpoint.ok(); ++i) {
    for (Weight weight : kAllWeights) {
      const std::string name =
          "model.language_model." + wire::HuggingFaceTensorName(i, weight).substr(6);
      absl::StatusOr<std::vector<float>> values = checkpoint->ReadFloats(name);
      EXPECT_TRUE(values.ok()) << values.status();
      if (values.ok()) layers[static_cast<std::size_t>(i)].values[weight] = *values;
    }
  }
  return layers;
}

// Rotary tables of positions 0..S-1 for a layer, independently of the server's rotary.cc.
void RotaryTables(int head_dim, int batch, int seq_len, double theta, double factor,
                  std::vector<float>* cos, std::vector<float>* sin) {
  cos->assign(static_cast<std::size_t>(batch) * seq_len * head_dim, 0.f);
  sin->assign(cos->size(), 0.f);
  const int half = head_dim / 2;
  for (int b = 0; b < batch; ++b) {
    for (int s = 0; s < seq_len; ++s) {
      for (int i = 0; i < half; ++i) {
        const double angle = s * std::pow(theta, -2.0 * i / head_dim) / factor;
        const std::size_t at = (static_cast<std::size_t>(b) * seq_len + s) * head_dim + i;
        (*cos)[at] = (*cos)[at + half] = static_cast<float>(std::cos(angle));
        (*sin)[at] = (*sin)[at + half] = static_cast<float>(std::sin(angle));
      }
    }
  }
}

// BackwardHost for one layer with the given scalars; cos/sin replaced by the layer's tables.
Gradients LayerReference(const LayerWeights& weights, Batch batch, double theta, double factor,
                         const Scalars& scalars) {
  RotaryTables(weights.config.head_dim, batch.batch, batch.seq_len, theta, factor, &batch.cos,
               &batch.sin);
  return Reference(weights, batch, scalars);
}

// The scalars config.json gives `layer` of the tiny model.
Scalars TinyScalars(int layer) {
  Scalars scalars;
  scalars.scaling = static_cast<float>(1.0 / std::sqrt(kQueryPreAttnScalar));
  scalars.softcap = 0.f;
  scalars.eps = 1e-6f;
  scalars.sliding_window = IsSliding(layer) ? kWindow : 0;
  return scalars;
}

Gradients TinyReference(const LayerWeights& weights, const Batch& batch, int layer) {
  return LayerReference(weights, batch, IsSliding(layer) ? kLocalTheta : kGlobalTheta,
                        IsSliding(layer) ? 1.0 : kGlobalFactor, TinyScalars(layer));
}

// A request for `layer` with position ids (the server builds the layer's rotary tables).
v1::BackwardRequest LayerRequest(const LayerConfig& config, const Batch& batch, int layer,
                                 std::uint64_t batch_id, v1::GradientMode mode) {
  v1::BackwardRequest request = MakeRequest(config, batch, batch_id, mode);
  request.set_layer(layer);
  request.clear_rotary_tables();
  for (int s = 0; s < batch.seq_len; ++s) request.mutable_positions()->add_position_ids(s);
  return request;
}

// Every chunk of a FetchGradients stream, reassembled per layer in arrival order.
struct LayerFetch {
  v1::AccumulationState state;
  LayerTensors gradients;
};
std::vector<LayerFetch> FetchLayers(v1::AttentionGradient::Stub& stub,
                                    const v1::FetchGradientsRequest& request,
                                    grpc::Status* status) {
  std::vector<LayerFetch> layers;
  grpc::ClientContext context;
  auto reader = stub.FetchGradients(&context, request);
  v1::GradientChunk chunk;
  while (reader->Read(&chunk)) {
    if (chunk.has_state()) {
      layers.emplace_back();
      layers.back().state = chunk.state();
      EXPECT_EQ(chunk.state().layer(), chunk.layer());
    }
    if (layers.empty()) continue;
    EXPECT_EQ(chunk.layer(), layers.back().state.layer());
    const std::optional<Weight> weight = wire::WeightOfWireName(chunk.name());
    if (!weight.has_value()) continue;
    std::vector<float>& values = layers.back().gradients[*weight];
    if (chunk.shape_size() > 0) {
      std::size_t count = 1;
      for (std::int64_t dim : chunk.shape()) count *= static_cast<std::size_t>(dim);
      values.assign(count, NAN);
    }
    const std::size_t count = chunk.data().size() / sizeof(float);
    if (chunk.offset() + count > values.size()) continue;
    EXPECT_TRUE(wire::DecodeToFloat(chunk.data(), v1::DTYPE_FLOAT32, "chunk",
                                    absl::MakeSpan(values.data() + chunk.offset(), count))
                    .ok());
  }
  *status = reader->Finish();
  return layers;
}

class ModelDirectoryTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override {
    directory_ = ::testing::TempDir() + "/attngrad_model_test_" + std::to_string(::getpid());
    std::filesystem::remove_all(directory_);
    layers_ = WriteTinyCheckpoint(directory_);
    options.weights = directory_;
  }
  void TearDown() override {
    ServerTest::TearDown();
    std::filesystem::remove_all(directory_);
  }

  v1::GetModelInfoResponse Info() {
    v1::GetModelInfoResponse info;
    grpc::ClientContext context;
    EXPECT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
    return info;
  }

  std::string directory_;
  std::vector<LayerWeights> layers_;
};

TEST_F(ModelDirectoryTest, GetModelInfoListsEveryLayer) {
  const v1::GetModelInfoResponse info = Info();
  EXPECT_EQ(info.model_name(), "gemma3_text");
  EXPECT_EQ(info.num_hidden_layers(), kLayers);
  ASSERT_EQ(info.layers_size(), kLayers);
  for (int i = 0; i < kLayers; ++i) {
    const v1::LayerInfo& layer = info.layers(i);
    SCOPED_TRACE(absl::StrCat("layer ", i));
    EXPECT_EQ(layer.index(), i);
    EXPECT_EQ(layer.config().hidden_size(), 64);
    EXPECT_EQ(layer.config().num_heads(), 4);
    EXPECT_EQ(layer.config().num_kv_heads(), 2);
    EXPECT_EQ(layer.config().head_dim(), TinyHeadDim());
    EXPECT_EQ(layer.type(), IsSliding(i) ? v1::ATTENTION_TYPE_SLIDING : v1::ATTENTION_TYPE_FULL);
    EXPECT_EQ(layer.sliding_window(), IsSliding(i) ? kWindow : 0);
    EXPECT_EQ(layer.rope_theta(), IsSliding(i) ? kLocalTheta : kGlobalTheta);
    EXPECT_EQ(layer.rope_scaling_factor(), IsSliding(i) ? 1.0 : kGlobalFactor);
    EXPECT_FLOAT_EQ(layer.scaling(), static_cast<float>(1.0 / std::sqrt(kQueryPreAttnScalar)));
    EXPECT_LE(layer.softcap(), 0.f);
    EXPECT_EQ(layer.weights_version(), 1u);
  }
  // The old single-layer fields describe layer 0.
  EXPECT_EQ(info.config().head_dim(), TinyHeadDim());
  EXPECT_FLOAT_EQ(info.default_scaling(), info.layers(0).scaling());
  EXPECT_LE(info.default_softcap(), 0.f);
  EXPECT_EQ(info.weights_version(), 1u);
}

TEST_F(ModelDirectoryTest, LayerAddressedBatchesMatchTheReference) {
  std::vector<v1::BackwardRequest> requests;
  std::vector<Batch> batches;
  for (int layer = 0; layer < kLayers; ++layer) {
    // S = 9 > the window (4): the local layers' window matters.
    batches.push_back(MakeBatch(TinyConfig(), 2, 9, 500 + layer));
    requests.push_back(
        LayerRequest(TinyConfig(), batches.back(), layer, layer, v1::GRADIENT_MODE_RETURN));
  }
  const std::vector<v1::BackwardResponse> responses = RunStream(stub(), requests);
  ASSERT_EQ(responses.size(), requests.size());
  for (const v1::BackwardResponse& response : responses) {
    const int layer = static_cast<int>(response.batch_id());
    SCOPED_TRACE(absl::StrCat("layer ", layer));
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_EQ(response.layer(), layer);
    const Gradients expected = TinyReference(layers_[static_cast<std::size_t>(layer)],
                                             batches[static_cast<std::size_t>(layer)], layer);
    EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                      Tolerance(1e-5), "grad_hidden_states"));
    EXPECT_TRUE(
        Close(ResponseWeightGradients(response), expected.weights, Tolerance(1e-5), "weights"));
  }
  // The window and the layer's RoPE made a difference: full attention with the local base differs.
  const Gradients unwindowed =
      LayerReference(layers_[0], batches[0], kLocalTheta, 1.0, TinyScalars(/*a full layer*/ 1));
  const Gradients windowed = TinyReference(layers_[0], batches[0], 0);
  EXPECT_FALSE(Close(unwindowed.grad_hidden_states, windowed.grad_hidden_states, 1e-3, "window"));
}

TEST_F(ModelDirectoryTest, RequestOverridesWindowAndScalars) {
  const Batch batch = MakeBatch(TinyConfig(), 1, 9, 77);
  v1::BackwardRequest request = LayerRequest(TinyConfig(), batch, 2, 1, v1::GRADIENT_MODE_RETURN);
  request.set_sliding_window(0);
  request.set_softcap(30.f);
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  Scalars scalars = TinyScalars(2);
  scalars.sliding_window = 0;
  scalars.softcap = 30.f;
  const Gradients expected = LayerReference(layers_[2], batch, kLocalTheta, 1.0, scalars);
  EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                    Tolerance(1e-5), "grad_hidden_states"));
  // softcap <= 0 is "none".
  request.set_softcap(-1.f);
  request.set_sliding_window(kWindow);
  const v1::BackwardResponse uncapped = RunOne(stub(), request);
  ASSERT_FALSE(uncapped.has_error()) << uncapped.error().message();
  const Gradients plain = TinyReference(layers_[2], batch, 2);
  EXPECT_TRUE(Close(ToFloats(uncapped.grad_hidden_states()), plain.grad_hidden_states,
                    Tolerance(1e-5), "softcap -1"));
}

TEST_F(ModelDirectoryTest, AccumulatesPerLayerAndFetchesSeveralLayers) {
  const Batch a = MakeBatch(TinyConfig(), 1, 6, 1), b = MakeBatch(TinyConfig(), 2, 5, 2),
              c = MakeBatch(TinyConfig(), 1, 7, 3);
  // The same batch id in two layers: windows are per layer, so both count.
  const std::vector<v1::BackwardResponse> responses =
      RunStream(stub(), {LayerRequest(TinyConfig(), a, 1, 10, v1::GRADIENT_MODE_ACCUMULATE),
                         LayerRequest(TinyConfig(), b, 1, 11, v1::GRADIENT_MODE_ACCUMULATE),
                         LayerRequest(TinyConfig(), c, 3, 10, v1::GRADIENT_MODE_ACCUMULATE)});
  ASSERT_EQ(responses.size(), 3u);
  for (const v1::BackwardResponse& response : responses) {
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_FALSE(response.duplicate());
  }
  LayerTensors expected_1 = TinyReference(layers_[1], a, 1).weights;
  const LayerTensors b_1 = TinyReference(layers_[1], b, 1).weights;
  for (Weight w : kAllWeights) {
    for (std::size_t j = 0; j < expected_1[w].size(); ++j) expected_1[w][j] += b_1[w][j];
  }
  const LayerTensors expected_3 = TinyReference(layers_[3], c, 3).weights;

  v1::FetchGradientsRequest fetch;
  fetch.add_layers(3);
  fetch.add_layers(1);
  fetch.add_layers(0);
  grpc::Status status;
  std::vector<LayerFetch> fetched = FetchLayers(stub(), fetch, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(fetched.size(), 3u);
  EXPECT_EQ(fetched[0].state.layer(), 3);
  EXPECT_EQ(fetched[0].state.batches(), 1);
  EXPECT_EQ(fetched[0].state.tokens(), 7);
  EXPECT_TRUE(Close(fetched[0].gradients, expected_3, Tolerance(1e-5), "layer 3"));
  EXPECT_EQ(fetched[1].state.layer(), 1);
  EXPECT_EQ(fetched[1].state.batches(), 2);
  EXPECT_EQ(fetched[1].state.tokens(), 16);
  EXPECT_TRUE(Close(fetched[1].gradients, expected_1, Tolerance(1e-5), "layer 1"));
  EXPECT_EQ(fetched[2].state.layer(), 0);
  EXPECT_EQ(fetched[2].state.batches(), 0);
  for (float value : fetched[2].gradients[Weight::kQProj]) ASSERT_EQ(value, 0.f);
  EXPECT_NE(fetched[0].state.window_id(), fetched[1].state.window_id());

  // Zeroing layer 1 leaves layer 3's sums.
  v1::ZeroGradientsRequest zero;
  zero.set_layer(1);
  v1::ZeroGradientsResponse zeroed;
  grpc::ClientContext zero_context;
  ASSERT_TRUE(stub().ZeroGradients(&zero_context, zero, &zeroed).ok());
  EXPECT_EQ(zeroed.previous().layer(), 1);
  EXPECT_EQ(zeroed.previous().batches(), 2);
  fetch.clear_layers();
  fetch.add_layers(1);
  fetch.add_layers(3);
  fetch.set_zero_after_fetch(true);
  fetched = FetchLayers(stub(), fetch, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(fetched.size(), 2u);
  EXPECT_EQ(fetched[0].state.batches(), 0);
  EXPECT_EQ(fetched[1].state.batches(), 1);
  EXPECT_TRUE(Close(fetched[1].gradients, expected_3, Tolerance(1e-5), "layer 3 again"));
  // Fetch-and-zero of both: layer 3 is empty now.
  fetch.clear_layers();
  fetch.add_layers(3);
  fetched = FetchLayers(stub(), fetch, &status);
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(fetched.size(), 1u);
  EXPECT_EQ(fetched[0].state.batches(), 0);
}

TEST_F(ModelDirectoryTest, UnknownLayerIsInvalidArgumentNamingTheRange) {
  const Batch batch = MakeBatch(TinyConfig(), 1, 3, 9);
  const v1::BackwardResponse response =
      RunOne(stub(), LayerRequest(TinyConfig(), batch, kLayers, 1, v1::GRADIENT_MODE_RETURN));
  ASSERT_TRUE(response.has_error());
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(response.error().message().find("layer"), std::string::npos)
      << response.error().message();
  EXPECT_NE(response.error().message().find("0-3"), std::string::npos)
      << response.error().message();

  v1::FetchGradientsRequest fetch;
  fetch.add_layers(-1);
  grpc::Status status;
  FetchLayers(stub(), fetch, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("layers[0]"), std::string::npos) << status.error_message();

  v1::ZeroGradientsRequest zero;
  zero.set_layer(9);
  v1::ZeroGradientsResponse zeroed;
  grpc::ClientContext zero_context;
  const grpc::Status zero_status = stub().ZeroGradients(&zero_context, zero, &zeroed);
  EXPECT_EQ(zero_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(zero_status.error_message().find("0-3"), std::string::npos);
}

TEST_F(ModelDirectoryTest, LoadWeightsReplacesOneLayerAndBumpsItsVersion) {
  const LayerWeights replacement = RandomLayerWeights(TinyConfig(), 999);
  v1::LoadWeightsResponse loaded;
  grpc::ClientContext context;
  auto writer = stub().LoadWeights(&context, &loaded);
  for (Weight weight : kAllWeights) {
    v1::LoadWeightsRequest chunk;
    chunk.set_layer(2);
    chunk.set_name(wire::WireWeightName(weight));
    chunk.set_dtype(v1::DTYPE_FLOAT32);
    for (std::int64_t dim : WeightShape(TinyConfig(), weight)) chunk.add_shape(dim);
    wire::EncodeFromFloat(replacement.values[weight], v1::DTYPE_FLOAT32, chunk.mutable_data());
    ASSERT_TRUE(writer->Write(chunk));
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(loaded.layer(), 2);
  EXPECT_EQ(loaded.weights_version(), 2u);
  const v1::GetModelInfoResponse info = Info();
  for (int i = 0; i < kLayers; ++i) {
    EXPECT_EQ(info.layers(i).weights_version(), i == 2 ? 2u : 1u) << "layer " << i;
  }
  const Batch batch = MakeBatch(TinyConfig(), 1, 5, 4);
  const v1::BackwardResponse response =
      RunOne(stub(), LayerRequest(TinyConfig(), batch, 2, 1, v1::GRADIENT_MODE_RETURN));
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(response.weights_version(), 2u);
  EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()),
                    TinyReference(replacement, batch, 2).grad_hidden_states, Tolerance(1e-5),
                    "new weights"));
}

TEST(ModelConfigTest, LayerTypesOverrideThePattern) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(R"({
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
    "num_hidden_layers": 3, "sliding_window": 8, "query_pre_attn_scalar": 32,
    "layer_types": ["full_attention", "sliding_attention", "full_attention"]})",
                                                        "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->Layer(0).type, AttentionType::kFull);
  EXPECT_EQ(config->Layer(1).type, AttentionType::kSliding);
  EXPECT_EQ(config->Layer(1).scalars.sliding_window, 8);
  EXPECT_EQ(config->Layer(2).scalars.sliding_window, 0);
  EXPECT_EQ(config->Layer(1).rope_theta, 10000.0);  // rope_local_base_freq's default
  EXPECT_EQ(config->Layer(2).rope_theta, 1000000.0);

  EXPECT_FALSE(ParseModelConfig(R"({"hidden_size": 64})", "config.json").ok());
  EXPECT_FALSE(ParseLayerRange("3-1", 4).ok());
  EXPECT_FALSE(ParseLayerRange("0-4", 4).ok());
  ASSERT_TRUE(ParseLayerRange("1-2", 4).ok());
  EXPECT_EQ(ParseLayerRange("2", 4)->first, 2);
  EXPECT_EQ(ParseLayerRange("", 4)->last, 3);
}

TEST(ModelConfigTest, NamedModelsMatchThePublishedConfigs) {
  absl::StatusOr<ModelConfig> model = NamedModelConfig("gemma-3-27b");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->num_hidden_layers, 62);
  EXPECT_EQ(model->layer.head_dim, 128);
  EXPECT_EQ(model->Layer(5).type, AttentionType::kFull);
  EXPECT_EQ(model->Layer(5).rope_scaling_factor, 8.0);
  EXPECT_EQ(model->Layer(4).scalars.sliding_window, 1024);
  EXPECT_FLOAT_EQ(model->Layer(0).scalars.scaling, static_cast<float>(1.0 / std::sqrt(168.0)));
  EXPECT_FALSE(NamedModelConfig("gemma-9").ok());
}

class RandomModelTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override {
    options.weights = "random";
    options.model = "gemma-3-270m";
    options.layers = "0-1";
  }
};

TEST_F(RandomModelTest, ServesTheRangeOfGemma3_270m) {
  v1::GetModelInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.model_name(), "gemma-3-270m");
  EXPECT_EQ(info.num_hidden_layers(), 18);
  ASSERT_EQ(info.layers_size(), 2);
  EXPECT_EQ(info.layers(1).index(), 1);
  EXPECT_EQ(info.layers(1).type(), v1::ATTENTION_TYPE_SLIDING);
  EXPECT_EQ(info.layers(1).sliding_window(), 512);
  EXPECT_EQ(info.layers(1).config().head_dim(), 256);
  EXPECT_EQ(info.layers(1).config().hidden_size(), 640);

  absl::StatusOr<ModelConfig> model = NamedModelConfig("gemma-3-270m");
  ASSERT_TRUE(model.ok());
  const LayerWeights weights = RandomLayerWeights(model->layer, kWeightsSeed + 1);
  const Batch batch = MakeBatch(model->layer, 1, 4, 12);
  const v1::BackwardResponse response =
      RunOne(stub(), LayerRequest(model->layer, batch, 1, 1, v1::GRADIENT_MODE_RETURN));
  ASSERT_FALSE(response.has_error()) << response.error().message();
  const Gradients expected = LayerReference(weights, batch, 10000.0, 1.0, model->Layer(1).scalars);
  EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                    Tolerance(1e-5), "grad_hidden_states"));
  EXPECT_TRUE(
      Close(ResponseWeightGradients(response), expected.weights, Tolerance(1e-5), "weights"));

  const v1::BackwardResponse missing =
      RunOne(stub(), LayerRequest(model->layer, batch, 5, 2, v1::GRADIENT_MODE_RETURN));
  ASSERT_TRUE(missing.has_error());
  EXPECT_EQ(missing.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(missing.error().message().find("0-1"), std::string::npos) << missing.error().message();
}

}  // namespace
}  // namespace attngrad::server::testing
