// Test helpers for the in-process server.
#include "server_test_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "cli/http_get.h"

namespace attngrad::server::testing {

LayerConfig SmallConfig() {
  LayerConfig config;
  config.hidden_size = 64;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.head_dim = 16;
  return config;
}

Batch MakeBatch(const LayerConfig& config, int batch, int seq_len, std::uint64_t seed) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  Batch result;
  result.batch = batch;
  result.seq_len = seq_len;
  const std::size_t tokens = static_cast<std::size_t>(batch) * seq_len;
  const float hidden_scale = 1.f / std::sqrt(static_cast<float>(config.hidden_size));
  result.hidden_states.resize(tokens * config.hidden_size);
  result.grad_output.resize(tokens * config.hidden_size);
  for (float& value : result.hidden_states) value = normal(engine) * hidden_scale;
  for (float& value : result.grad_output) value = normal(engine);
  result.cos.resize(tokens * config.head_dim);
  result.sin.resize(tokens * config.head_dim);
  const int half = config.head_dim / 2;
  for (std::size_t token = 0; token < tokens; ++token) {
    const double position = static_cast<double>(token % seq_len);
    for (int i = 0; i < half; ++i) {
      const double inv_freq = 1.0 / std::pow(10000.0, 2.0 * i / config.head_dim);
      const double angle = position * inv_freq;
      for (int copy = 0; copy < 2; ++copy) {
        result.cos[token * config.head_dim + i + copy * half] = static_cast<float>(std::cos(angle));
        result.sin[token * config.head_dim + i + copy * half] = static_cast<float>(std::sin(angle));
      }
    }
  }
  return result;
}

v1::Tensor FloatTensor(const std::vector<float>& values, std::vector<std::int64_t> shape) {
  return wire::MakeTensor(values, shape, v1::DTYPE_FLOAT32);
}

std::vector<float> ToFloats(const v1::Tensor& tensor) {
  const std::size_t size = wire::DTypeSize(tensor.dtype());
  std::vector<float> values(size == 0 ? 0 : tensor.raw_data().size() / size);
  EXPECT_TRUE(
      wire::DecodeToFloat(tensor.raw_data(), tensor.dtype(), "tensor", absl::MakeSpan(values))
          .ok());
  return values;
}

v1::BackwardRequest MakeRequest(const LayerConfig& config, const Batch& batch,
                                std::uint64_t batch_id, v1::GradientMode mode) {
  v1::BackwardRequest request;
  request.set_batch_id(batch_id);
  request.set_mode(mode);
  request.set_precision(v1::PRECISION_FP32);
  const std::int64_t b = batch.batch, s = batch.seq_len;
  *request.mutable_hidden_states() = FloatTensor(batch.hidden_states, {b, s, config.hidden_size});
  *request.mutable_grad_output() = FloatTensor(batch.grad_output, {b, s, config.hidden_size});
  *request.mutable_rotary_tables()->mutable_cos() = FloatTensor(batch.cos, {b, s, config.head_dim});
  *request.mutable_rotary_tables()->mutable_sin() = FloatTensor(batch.sin, {b, s, config.head_dim});
  return request;
}

v1::BackwardRequest MakeForwardRequest(const LayerConfig& config, const Batch& batch,
                                       std::uint64_t batch_id) {
  v1::BackwardRequest request = MakeRequest(config, batch, batch_id, v1::GRADIENT_MODE_RETURN);
  request.clear_mode();
  request.clear_grad_output();
  request.set_computation(v1::COMPUTATION_FORWARD);
  return request;
}

std::vector<float> ForwardReference(const LayerWeights& weights, const Batch& batch) {
  Scalars scalars;  // the server's defaults: scaling 1/sqrt(head_dim), softcap 50, eps 1e-6
  scalars.scaling = 1.0f / std::sqrt(static_cast<float>(weights.config.head_dim));
  ForwardInputs in;
  in.weights = DataOf(weights.values);
  in.hidden_states = batch.hidden_states.data();
  in.cos = batch.cos.data();
  in.sin = batch.sin.data();
  std::vector<float> output(batch.hidden_states.size(), 0.f);
  EXPECT_EQ(
      ForwardHost(weights.config, batch.batch, batch.seq_len, scalars, in, output.data()).code,
      ATTNGRAD_OK);
  return output;
}

Gradients Reference(const LayerWeights& weights, const Batch& batch) {
  Scalars scalars;  // the server's defaults: scaling 1/sqrt(head_dim), softcap 50, eps 1e-6
  scalars.scaling = 1.0f / std::sqrt(static_cast<float>(weights.config.head_dim));
  return Reference(weights, batch, scalars);
}

Gradients Reference(const LayerWeights& weights, const Batch& batch, const Scalars& scalars) {
  Gradients result;
  result.grad_hidden_states.assign(batch.hidden_states.size(), 0.f);
  result.weights = ZeroWeights<std::vector<float>>(weights.config);
  BackwardInputs in;
  in.weights = DataOf(weights.values);
  in.hidden_states = batch.hidden_states.data();
  in.grad_output = batch.grad_output.data();
  in.cos = batch.cos.data();
  in.sin = batch.sin.data();
  BackwardOutputs out;
  out.grad_hidden_states = result.grad_hidden_states.data();
  out.weight_gradients = DataOf(result.weights);
  EXPECT_EQ(BackwardHost(weights.config, batch.batch, batch.seq_len, scalars, false, in, out).code,
            ATTNGRAD_OK);
  return result;
}

LayerTensors ResponseWeightGradients(const v1::BackwardResponse& response) {
  LayerTensors result;
  for (Weight weight : kAllWeights) {
    result[weight] = ToFloats(wire::GradientTensor(response.weight_gradients(), weight));
  }
  return result;
}

::testing::AssertionResult Close(const std::vector<float>& actual,
                                 const std::vector<float>& expected, double relative,
                                 const std::string& what) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << actual.size() << " elements, expected " << expected.size();
  }
  double scale = 0, worst = 0;
  std::size_t worst_index = 0;
  for (std::size_t i = 0; i < expected.size(); ++i)
    scale = std::max(scale, std::fabs(double(expected[i])));
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double diff = std::fabs(double(actual[i]) - double(expected[i]));
    if (!(diff <= worst)) {  // also catches NaN
      worst = std::isnan(diff) ? INFINITY : diff;
      worst_index = i;
    }
  }
  if (worst <= relative * scale + 1e-12) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": max |diff| " << worst << " at " << worst_index << " (got "
         << actual[worst_index] << ", expected " << expected[worst_index] << "), allowed "
         << relative * scale;
}

::testing::AssertionResult Close(const LayerTensors& actual, const LayerTensors& expected,
                                 double relative, const std::string& what) {
  for (Weight weight : kAllWeights) {
    ::testing::AssertionResult result =
        Close(actual[weight], expected[weight], relative, what + " " + WeightModuleName(weight));
    if (!result) return result;
  }
  return ::testing::AssertionSuccess();
}

std::vector<v1::BackwardResponse> ByBatchId(const std::vector<v1::BackwardResponse>& responses,
                                            std::uint64_t first_id, std::size_t count) {
  EXPECT_EQ(responses.size(), count);
  std::vector<v1::BackwardResponse> ordered(count);
  std::vector<bool> seen(count, false);
  for (const v1::BackwardResponse& response : responses) {
    EXPECT_FALSE(response.has_error()) << response.error().message();
    const std::uint64_t index = response.batch_id() - first_id;
    if (response.batch_id() < first_id || index >= count) {
      ADD_FAILURE() << "an answer to unknown batch id " << response.batch_id();
      continue;
    }
    EXPECT_FALSE(seen[index]) << "batch " << response.batch_id() << " answered twice";
    seen[index] = true;
    ordered[index] = response;
  }
  for (std::size_t index = 0; index < count; ++index) {
    EXPECT_TRUE(seen[index]) << "batch " << first_id + index << " was not answered";
  }
  return ordered;
}

std::vector<v1::BackwardResponse> RunStream(v1::AttentionGradient::Stub& stub,
                                            const std::vector<v1::BackwardRequest>& requests,
                                            grpc::Status* status) {
  grpc::ClientContext context;
  auto stream = stub.Backward(&context);
  std::thread writer([&] {
    for (const v1::BackwardRequest& request : requests) {
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
  });
  std::vector<v1::BackwardResponse> responses;
  v1::BackwardResponse response;
  while (stream->Read(&response)) responses.push_back(response);
  writer.join();
  grpc::Status finish = stream->Finish();
  EXPECT_TRUE(finish.ok()) << finish.error_code() << " " << finish.error_message();
  if (status != nullptr) *status = finish;
  return responses;
}

v1::BackwardResponse RunOne(v1::AttentionGradient::Stub& stub, const v1::BackwardRequest& request) {
  std::vector<v1::BackwardResponse> responses = RunStream(stub, {request});
  EXPECT_EQ(responses.size(), 1u);
  return responses.empty() ? v1::BackwardResponse() : responses.front();
}

Fetched Fetch(v1::AttentionGradient::Stub& stub, const v1::FetchGradientsRequest& request,
              const std::string& client_id) {
  Fetched fetched;
  grpc::ClientContext context;
  if (!client_id.empty()) context.AddMetadata("attngrad-client-id", client_id);
  auto reader = stub.FetchGradients(&context, request);
  v1::GradientChunk chunk;
  PerWeight<int> dtypes;
  while (reader->Read(&chunk)) {
    if (fetched.chunks++ == 0) {
      EXPECT_TRUE(chunk.has_state());
      fetched.state = chunk.state();
    }
    const std::optional<Weight> named = wire::WeightOfWireName(chunk.name());
    EXPECT_TRUE(named.has_value()) << chunk.name();
    if (!named.has_value()) continue;
    const Weight index = *named;
    std::vector<float>& values = fetched.gradients[index];
    if (chunk.shape_size() > 0) {
      std::size_t count = 1;
      for (std::int64_t dim : chunk.shape()) count *= dim;
      values.assign(count, NAN);
      dtypes[index] = chunk.dtype();
    }
    const std::size_t size = wire::DTypeSize(dtypes[index]);
    const std::size_t count = size == 0 ? 0 : chunk.data().size() / size;
    EXPECT_LE(chunk.offset() + count, values.size());
    if (chunk.offset() + count > values.size()) continue;
    EXPECT_TRUE(wire::DecodeToFloat(chunk.data(), dtypes[index], "chunk",
                                    absl::MakeSpan(values.data() + chunk.offset(), count))
                    .ok());
  }
  fetched.status = reader->Finish();
  return fetched;
}

grpc::Status Upload(v1::AttentionGradient::Stub& stub, const LayerWeights& weights,
                    std::uint64_t expected_version, v1::LoadWeightsResponse* response,
                    std::size_t chunk_elements, std::optional<Weight> skip_weight,
                    std::vector<std::int64_t> shape_override) {
  grpc::ClientContext context;
  auto writer = stub.LoadWeights(&context, response);
  for (Weight i : kAllWeights) {
    if (skip_weight == i) continue;
    const std::vector<float>& values = weights.values[i];
    for (std::size_t offset = 0; offset < values.size(); offset += chunk_elements) {
      v1::LoadWeightsRequest chunk;
      chunk.set_name(wire::WireWeightName(i));
      chunk.set_offset(static_cast<std::int64_t>(offset));
      chunk.set_expected_weights_version(expected_version);
      if (offset == 0) {
        chunk.set_dtype(v1::DTYPE_FLOAT32);
        const std::vector<std::int64_t> shape =
            shape_override.empty() ? WeightShape(weights.config, i) : shape_override;
        for (std::int64_t dim : shape) chunk.add_shape(dim);
      }
      const std::size_t count = std::min(chunk_elements, values.size() - offset);
      wire::EncodeFromFloat(absl::MakeConstSpan(values.data() + offset, count), v1::DTYPE_FLOAT32,
                            chunk.mutable_data());
      if (!writer->Write(chunk)) return writer->Finish();
    }
  }
  writer->WritesDone();
  return writer->Finish();
}

std::string TestDevices() {
  const char* devices = std::getenv("ATTNGRAD_TEST_DEVICES");
  return devices == nullptr || *devices == '\0' ? "cpu" : devices;
}

bool TestOnGpu() { return TestDevices() != "cpu"; }

double Tolerance(double cpu_tolerance) {
  return TestOnGpu() ? std::max(cpu_tolerance, 1e-3) : cpu_tolerance;
}

void ServerTest::SetUp() {
  options_.listen = "127.0.0.1:0";
  options_.metrics_listen = "127.0.0.1:0";
  options_.devices = TestDevices();
  options_.weights = "random";
  options_.weights_seed = kWeightsSeed;
  options_.cpu_threads = 2;
  Customize(options_);
  absl::StatusOr<std::unique_ptr<GradientServer>> server = GradientServer::Start(options_);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  channel_ = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                       grpc::InsecureChannelCredentials(), arguments);
  stub_ = v1::AttentionGradient::NewStub(channel_);
  v1::GetModelInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->GetModelInfo(&context, {}, &info).ok());
  config_.hidden_size = info.config().hidden_size();
  config_.num_heads = info.config().num_heads();
  config_.num_kv_heads = info.config().num_kv_heads();
  config_.head_dim = info.config().head_dim();
}

void ServerTest::TearDown() {
  stub_.reset();
  channel_.reset();
  if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  server_.reset();
}

const LayerWeights& ServerTest::weights() {
  if (weights_ == nullptr) {
    weights_ = std::make_unique<LayerWeights>(RandomLayerWeights(config_, kWeightsSeed));
  }
  return *weights_;
}

std::unique_ptr<v1::AttentionGradient::Stub> ServerTest::NewStub() {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  return v1::AttentionGradient::NewStub(
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                grpc::InsecureChannelCredentials(), arguments));
}

std::string HttpGet(int port, const std::string& path) {
  absl::StatusOr<cli::HttpResponse> response = cli::HttpGet(absl::StrCat("127.0.0.1:", port), path);
  EXPECT_TRUE(response.ok()) << response.status();
  return response.ok() ? response->body : std::string();
}

grpc::Status RawUnaryCall(grpc::GenericStub& generic, const std::string& method,
                          const std::string& bytes) {
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::CompletionQueue queue;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = generic.PrepareUnaryCall(&context, method, request, &queue);
  call->StartCall();
  grpc::ByteBuffer reply;
  grpc::Status status;
  call->Finish(&reply, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  EXPECT_TRUE(queue.Next(&tag, &ok));
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  return status;
}

}  // namespace attngrad::server::testing
