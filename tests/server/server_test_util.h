// Shared by the server tests: a fixture that starts attngrad-server in-process on a loopback port
// with the CPU backend, random inputs as in SPEC section 3, tensors to and from the wire, the
// BackwardHost reference and a Backward stream helper that writes and reads concurrently.
#ifndef ATTNGRAD_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define ATTNGRAD_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "attngrad/backward.h"
#include "attngrad/forward.h"
#include "attngrad/v1/attngrad.grpc.pb.h"
#include "server.h"
#include "weights/served_weights.h"

namespace attngrad::server::testing {

// A layer small enough for quick CPU tests: hidden 64, 4 heads, 2 kv heads, head_dim 16.
LayerConfig SmallConfig();

// One batch of fp32 inputs: hidden_states = randn/sqrt(hidden), grad_output = randn, cos/sin from
// positions 0..S-1 with theta 10000 (computed here independently of the server's rotary.cc).
struct Batch {
  int batch = 0, seq_len = 0;
  std::vector<float> hidden_states, grad_output, cos, sin;
};
Batch MakeBatch(const LayerConfig& config, int batch, int seq_len, std::uint64_t seed);

v1::Tensor FloatTensor(const std::vector<float>& values, std::vector<std::int64_t> shape);
std::vector<float> ToFloats(const v1::Tensor& tensor);  // any wire dtype

// A request carrying the batch as fp32 tensors with explicit rotary tables.
v1::BackwardRequest MakeRequest(const LayerConfig& config, const Batch& batch,
                                std::uint64_t batch_id, v1::GradientMode mode);

// A FORWARD request (computation = COMPUTATION_FORWARD) carrying the batch's hidden_states and
// rotary tables as fp32 tensors, no grad_output, mode unset.
v1::BackwardRequest MakeForwardRequest(const LayerConfig& config, const Batch& batch,
                                       std::uint64_t batch_id);
// ForwardHost on the batch: the layer's output [B,S,hidden] with the server's default scalars.
std::vector<float> ForwardReference(const LayerWeights& weights, const Batch& batch);

struct Gradients {
  std::vector<float> grad_hidden_states;
  LayerTensors weights;  // the six weight gradients
};
// BackwardHost on the batch (accumulate=false).
Gradients Reference(const LayerWeights& weights, const Batch& batch);
// The same with the given scalars (window, soft-cap, scaling) in place of the server's defaults.
Gradients Reference(const LayerWeights& weights, const Batch& batch, const Scalars& scalars);
// The six weight gradients of a RETURN response, in LayerTensors order.
LayerTensors ResponseWeightGradients(const v1::BackwardResponse& response);

// max |actual - expected| <= relative * max |expected| + 1e-12, with a message naming `what`.
::testing::AssertionResult Close(const std::vector<float>& actual,
                                 const std::vector<float>& expected, double relative,
                                 const std::string& what);
::testing::AssertionResult Close(const LayerTensors& actual, const LayerTensors& expected,
                                 double relative, const std::string& what);

// The body of an HTTP/1.0 GET of `path` on a loopback port (cli/http_get.h); empty, with
// a test failure, when the GET fails.
std::string HttpGet(int port, const std::string& path);

// LoadWeights: streams `weights` (fp32) in chunks of at most chunk_elements; skip_weight leaves one
// out and shape_override replaces every declared shape (the refusal tests).
grpc::Status Upload(v1::AttentionGradient::Stub& stub, const LayerWeights& weights,
                    std::uint64_t expected_version, v1::LoadWeightsResponse* response,
                    std::size_t chunk_elements = 1 << 18,
                    std::optional<Weight> skip_weight = std::nullopt,
                    std::vector<std::int64_t> shape_override = {});

// ATTNGRAD_TEST_DEVICES (environment): --devices for the fixture's server ("cpu" when unset), so
// the same tests can drive the GPU workers on a GPU machine. On a GPU, tolerances widen to 1e-3
// (the kernels' accumulation order differs from the CPU reference's).
std::string TestDevices();
bool TestOnGpu();
double Tolerance(double cpu_tolerance);

// Writes every request on one stream (from a second thread) while reading the responses; returns
// them indexed by arrival. The stream is half-closed after the last request.
std::vector<v1::BackwardResponse> RunStream(v1::AttentionGradient::Stub& stub,
                                            const std::vector<v1::BackwardRequest>& requests,
                                            grpc::Status* status = nullptr);
// The responses to requests with batch ids first_id, first_id + 1, ... (`count` of them), by batch
// id: each must be answered exactly once and without an error (a test failure names what was not).
std::vector<v1::BackwardResponse> ByBatchId(const std::vector<v1::BackwardResponse>& responses,
                                            std::uint64_t first_id, std::size_t count);
// Sends one request on its own stream and returns the one response.
v1::BackwardResponse RunOne(v1::AttentionGradient::Stub& stub, const v1::BackwardRequest& request);

// The whole FetchGradients stream reassembled.
struct Fetched {
  grpc::Status status;
  v1::AccumulationState state;
  LayerTensors gradients;
  int chunks = 0;
};
// client_id: sent as attngrad-client-id (authentication off) when not empty.
Fetched Fetch(v1::AttentionGradient::Stub& stub, const v1::FetchGradientsRequest& request,
              const std::string& client_id = "");

// Starts a server (CPU backend, random weights with kWeightsSeed, loopback, metrics on a free port)
// in SetUp and stops it in TearDown. Override Customize() to change options before the start.
class ServerTest : public ::testing::Test {
 protected:
  static constexpr std::uint64_t kWeightsSeed = 11;

  void SetUp() override;
  void TearDown() override;
  virtual void Customize(ServerOptions& /*options*/) {}

  const LayerConfig& config() const { return config_; }
  const LayerWeights& weights();  // the server's initial weights, recomputed here once
  v1::AttentionGradient::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  GradientServer& server() { return *server_; }
  std::unique_ptr<v1::AttentionGradient::Stub> NewStub();  // on its own connection

  ServerOptions options_;
  LayerConfig config_ = LayerConfig::Gemma3_4B();
  std::unique_ptr<GradientServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionGradient::Stub> stub_;
  std::unique_ptr<LayerWeights> weights_;
};

// A unary call of `method` ("/package.Service/Method") whose request is `bytes` as they are (not
// a serialised message), with a 10 s deadline; its status.
grpc::Status RawUnaryCall(grpc::GenericStub& generic, const std::string& method,
                          const std::string& bytes);

}  // namespace attngrad::server::testing

#endif  // ATTNGRAD_TESTS_SERVER_SERVER_TEST_UTIL_H_
