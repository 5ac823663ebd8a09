// End-to-end tests of the gradient service: the real attngrad-server (CPU backend, random weights
// of seed 7, max_batch_tokens 32) on a loopback port, driven through attngrad::Client and compared
// with the local CPU reference (SPEC section 4).
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <grpcpp/create_channel.h>

#include "absl/strings/str_cat.h"
#include "attngrad/client.h"
#include "attngrad/v1/attngrad.grpc.pb.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "random_tensors.h"
#include "reference_check.h"
#include "test_support.h"

namespace attngrad {
namespace {

using ::attngrad::testing::TestServer;
using ::testing::HasSubstr;

struct Shape {
  int64_t batch;
  int64_t seq_len;
};

class EndToEndTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = TestServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Connect();
    ASSERT_NE(client_, nullptr);
    config_ = wire::LayerConfigFromWire(client_->cached_info().config());
  }

  void TearDown() override {
    if (HasFailure() && server_) std::cerr << "server log (tail):\n" << server_->LogTail() << "\n";
  }

  std::unique_ptr<Client> Connect() {
    ClientOptions options;
    options.deadline = absl::Seconds(120);
    options.max_attempts = 6;
    options.initial_backoff = absl::Milliseconds(250);
    auto client = Client::Connect(server_->target(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  const WeightSet& ServerWeights() {
    if (!weights_) weights_ = RandomWeights(config_, TestServer::kWeightsSeed);
    return *weights_;
  }

  // The summed CPU-reference weight gradients of `batches`.
  WeightSet ReferenceSum(const std::vector<BatchInputs>& batches) {
    WeightSet sum;
    for (const BatchInputs& inputs : batches) {
      auto reference = ComputeReference(config_, inputs, ServerWeights());
      EXPECT_TRUE(reference.ok()) << reference.status();
      if (reference.ok()) AddInto(reference->gradients, &sum);
    }
    return sum;
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> client_;
  LayerConfig config_;
  std::optional<WeightSet> weights_;
};

// Every element of `got` within `relative` * max|want| of `want`.
void ExpectNear(const WeightSet& got, const WeightSet& want, double relative,
                const std::string& what) {
  for (Weight weight : kAllWeights) {
    const HostTensor& g = got[weight];
    const HostTensor& w = want[weight];
    ASSERT_EQ(g.shape, w.shape) << what << " " << WeightModuleName(weight);
    double scale = 0, worst = 0;
    for (float v : w.data) scale = std::max(scale, std::fabs(double{v}));
    for (size_t i = 0; i < g.data.size(); ++i) {
      worst = std::max(worst, std::fabs(double{g.data[i]} - w.data[i]));
    }
    EXPECT_GT(scale, 0) << what << " " << WeightModuleName(weight) << " is all zeros";
    EXPECT_LE(worst, relative * scale) << what << " " << WeightModuleName(weight);
  }
}

// SPEC section 4 on each of the six weight gradients.
void ExpectSpecMatch(const WeightSet& got, const WeightSet& reference, double atol,
                     const std::string& what) {
  for (Weight weight : kAllWeights) {
    const bool norm = weight == Weight::kQNorm || weight == Weight::kKNorm;
    const OutputComparison c = CompareOutput(std::string(WeightModuleName(weight)),
                                             got[weight].data, reference[weight].data, atol, norm);
    EXPECT_TRUE(c.passed) << what << ": " << c.name << " " << c.misses << "/" << c.elements
                          << " outside tolerance, max |err| " << c.max_abs_error;
  }
}

TEST_F(EndToEndTest, InfoAndHealth) {
  auto info = client_->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->config().hidden_size(), 3072);
  EXPECT_EQ(info->config().num_heads(), 24);
  EXPECT_EQ(info->config().num_kv_heads(), 8);
  EXPECT_EQ(info->config().head_dim(), 128);
  EXPECT_EQ(info->max_batch_tokens(), TestServer::kMaxBatchTokens);
  EXPECT_EQ(info->weights_source(), "random:seed=7");
  EXPECT_FALSE(info->server_instance_id().empty());
  EXPECT_EQ(client_->server_instance_id(), info->server_instance_id());
  auto health = client_->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServing);
  // grpc.health.v1: an unknown service name is NOT_FOUND, passed through with the server's message.
  auto unknown = client_->Health("no.such.Service");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
}

// RETURN mode, one batch that fits and one the client must split along B (48 tokens > 32), both
// against the CPU reference with the server's own random weights (the shared generator).
TEST_F(EndToEndTest, ReturnModeMatchesReferenceIncludingSplitBatches) {
  for (Shape shape : {Shape{2, 8}, Shape{3, 16}}) {
    const BatchInputs inputs = RandomBatchInputs(config_, shape.batch, shape.seq_len, 11);
    BackwardBatch batch = inputs.View();
    batch.mode = v1::GRADIENT_MODE_RETURN;
    auto result = client_->Backward(batch);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->parts, shape.batch * shape.seq_len > TestServer::kMaxBatchTokens ? 2 : 1);
    EXPECT_EQ(result->device, "cpu");
    ASSERT_TRUE(result->weight_gradients.has_value());
    auto reference = ComputeReference(config_, inputs, ServerWeights());
    ASSERT_TRUE(reference.ok()) << reference.status();
    const CheckReport report =
        CheckAgainstReference(result->grad_hidden_states, &*result->weight_gradients, *reference,
                              SpecAtol(shape.batch, shape.seq_len));
    EXPECT_TRUE(report.passed()) << "B=" << shape.batch << " S=" << shape.seq_len << "\n"
                                 << report.ToString();
  }
}

// Position ids instead of tables, and a float16 answer, still match.
TEST_F(EndToEndTest, PositionsAndHalfResponse) {
  const BatchInputs inputs = RandomBatchInputs(config_, 2, 8, 12);
  BackwardBatch batch = inputs.View();
  batch.cos = batch.sin = {};  // the server builds positions 0..S-1 with theta 10000
  batch.response_dtype = v1::DTYPE_FLOAT32;
  auto result = client_->Backward(batch);
  ASSERT_TRUE(result.ok()) << result.status();
  auto reference = ComputeReference(config_, inputs, ServerWeights());
  ASSERT_TRUE(reference.ok());
  EXPECT_TRUE(CheckAgainstReference(result->grad_hidden_states, &*result->weight_gradients,
                                    *reference, SpecAtol(2, 8))
                  .passed());
  batch.response_dtype = v1::DTYPE_FLOAT16;
  auto half = client_->Backward(batch);
  ASSERT_TRUE(half.ok()) << half.status();
  // fp16 rounding (relative 2^-11) of values of order 1: compare loosely with the fp32 answer.
  double worst = 0;
  for (size_t i = 0; i < half->grad_hidden_states.size(); ++i) {
    worst = std::max(
        worst, std::fabs(double{half->grad_hidden_states[i]} - result->grad_hidden_states[i]) /
                   (1e-3 + std::fabs(double{result->grad_hidden_states[i]})));
  }
  EXPECT_LT(worst, 2e-3);
}

// grad_hidden_states_out: the answer decoded into the caller's memory is bit for bit the result's
// own vector (one request, a batch split in two, a float16 answer), the result's vector stays
// empty, and a span of the wrong size is INVALID_ARGUMENT naming the field. borrow_inputs: the
// same answers as the copied inputs'.
TEST_F(EndToEndTest, CallerMemoryInAndOutEqualsCopies) {
  auto stream = client_->StartStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (Shape shape : {Shape{2, 8}, Shape{3, 16}}) {
    for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16}) {
      const BatchInputs inputs = RandomBatchInputs(config_, shape.batch, shape.seq_len, 13);
      BackwardBatch batch = inputs.View();
      batch.mode = v1::GRADIENT_MODE_RETURN;
      batch.response_dtype = dtype;
      auto own = (*stream)->Submit(batch);
      ASSERT_TRUE(own.ok()) << own.status();
      auto expected = (*stream)->Await(*own);
      ASSERT_TRUE(expected.ok()) << expected.status();
      std::vector<float> out(expected->grad_hidden_states.size(), -1.0f);
      batch.grad_hidden_states_out = absl::MakeSpan(out);
      auto into = (*stream)->Submit(batch);
      ASSERT_TRUE(into.ok()) << into.status();
      auto got = (*stream)->Await(*into);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->parts, expected->parts);
      EXPECT_TRUE(got->grad_hidden_states.empty());
      EXPECT_EQ(got->shape, expected->shape);
      EXPECT_EQ(0, std::memcmp(out.data(), expected->grad_hidden_states.data(),
                               out.size() * sizeof(float)))
          << "B=" << shape.batch << " S=" << shape.seq_len << " dtype " << dtype;
    }
  }
  const BatchInputs inputs = RandomBatchInputs(config_, 2, 8, 14);
  BackwardBatch batch = inputs.View();
  // borrow_inputs: the same answers (fp32 inputs sent from the caller's memory; bf16 converted as
  // before), one request and a split batch.
  for (Shape shape : {Shape{2, 8}, Shape{3, 16}}) {
    for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
      const BatchInputs borrowed = RandomBatchInputs(config_, shape.batch, shape.seq_len, 15);
      BackwardBatch own = borrowed.View();
      own.mode = v1::GRADIENT_MODE_RETURN;
      own.input_dtype = dtype;
      auto copied = client_->Backward(own);
      ASSERT_TRUE(copied.ok()) << copied.status();
      own.borrow_inputs = true;
      auto id = (*stream)->Submit(own);
      ASSERT_TRUE(id.ok()) << id.status();
      auto got = (*stream)->Next();
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(got->status.ok()) << got->status;
      EXPECT_EQ(got->request_bytes, copied->request_bytes);
      EXPECT_EQ(got->grad_hidden_states, copied->grad_hidden_states)
          << "B=" << shape.batch << " S=" << shape.seq_len << " dtype " << dtype;
      ASSERT_TRUE(got->weight_gradients.has_value());
      for (Weight weight : kAllWeights) {
        EXPECT_EQ((*got->weight_gradients)[weight].data, (*copied->weight_gradients)[weight].data)
            << WeightModuleName(weight);
      }
    }
  }
  std::vector<float> short_out(static_cast<size_t>(2 * 8 * config_.hidden_size) - 1);
  batch.grad_hidden_states_out = absl::MakeSpan(short_out);
  auto bad = (*stream)->Submit(batch);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("grad_hidden_states_out"));
  EXPECT_TRUE((*stream)->Finish().ok());
}

// 16-bit inputs and answer (BackwardBatch::hidden_states_16bit, grad_output_16bit,
// grad_hidden_states_16bit_out), for float16 and bfloat16, copied or borrowed, one request or a
// batch split in two: the caller's encoded inputs are the very request of the float API with that
// input_dtype (same bytes, same answers bit for bit), the answer's bits land in the caller's
// memory unconverted (the float API's answer widens them exactly, so narrowing it gives them back)
// and the result's vector stays empty. Misuse is INVALID_ARGUMENT naming the field.
TEST_F(EndToEndTest, SixteenBitInputsAndAnswerAreTheFloatApisBits) {
  auto stream = client_->StartStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto encoded = [](const std::vector<float>& values, v1::DType dtype) {
    std::vector<uint16_t> bits(values.size());
    wire::EncodeFromFloat(values, dtype, reinterpret_cast<char*>(bits.data()));
    return bits;
  };
  for (Shape shape : {Shape{2, 8}, Shape{3, 16}}) {
    for (v1::DType dtype : {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
      SCOPED_TRACE(
          absl::StrCat("B=", shape.batch, " S=", shape.seq_len, " ", wire::DTypeName(dtype)));
      const BatchInputs inputs = RandomBatchInputs(config_, shape.batch, shape.seq_len, 21);
      BackwardBatch floats = inputs.View();
      floats.mode = v1::GRADIENT_MODE_RETURN;
      floats.input_dtype = dtype;
      floats.response_dtype = dtype;
      auto expected = client_->Backward(floats);
      ASSERT_TRUE(expected.ok()) << expected.status();
      const std::vector<uint16_t> hidden = encoded(inputs.hidden_states, dtype);
      const std::vector<uint16_t> grad = encoded(inputs.grad_output, dtype);
      const std::vector<uint16_t> expected_answer = encoded(expected->grad_hidden_states, dtype);
      for (bool borrow : {false, true}) {
        BackwardBatch own = floats;
        own.hidden_states = own.grad_output = {};
        own.hidden_states_16bit = hidden;
        own.grad_output_16bit = grad;
        own.borrow_inputs = borrow;
        std::vector<uint16_t> out(expected_answer.size(), 0xffff);
        own.grad_hidden_states_16bit_out = absl::MakeSpan(out);
        auto id = (*stream)->Submit(own);
        ASSERT_TRUE(id.ok()) << id.status();
        auto got = (*stream)->Await(*id);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(got->parts, shape.batch == 3 ? 2 : 1);
        EXPECT_EQ(got->parts, expected->parts);
        EXPECT_EQ(got->request_bytes, expected->request_bytes);
        EXPECT_EQ(got->shape, expected->shape);
        EXPECT_TRUE(got->grad_hidden_states.empty());
        EXPECT_EQ(out, expected_answer) << (borrow ? "borrowed" : "copied");
        ASSERT_TRUE(got->weight_gradients.has_value());
        for (Weight weight : kAllWeights) {
          EXPECT_EQ((*got->weight_gradients)[weight].data,
                    (*expected->weight_gradients)[weight].data)
              << WeightModuleName(weight);
        }
      }
      // 16-bit inputs with a float32 answer into the result's vector: the float API's answer.
      BackwardBatch own = floats;
      own.hidden_states = own.grad_output = {};
      own.hidden_states_16bit = hidden;
      own.grad_output_16bit = grad;
      own.response_dtype = v1::DTYPE_FLOAT32;
      floats.response_dtype = v1::DTYPE_FLOAT32;
      auto float_answer = client_->Backward(floats);
      ASSERT_TRUE(float_answer.ok()) << float_answer.status();
      auto got = client_->Backward(own);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->grad_hidden_states, float_answer->grad_hidden_states);
    }
  }

  const BatchInputs inputs = RandomBatchInputs(config_, 3, 16, 22);
  const std::vector<uint16_t> hidden = encoded(inputs.hidden_states, v1::DTYPE_BFLOAT16);
  const std::vector<uint16_t> grad = encoded(inputs.grad_output, v1::DTYPE_BFLOAT16);
  BackwardBatch good;
  good.batch = 3;
  good.seq_len = 16;
  good.hidden_states_16bit = hidden;
  good.grad_output_16bit = grad;
  good.input_dtype = v1::DTYPE_BFLOAT16;
  good.response_dtype = v1::DTYPE_BFLOAT16;
  std::vector<uint16_t> out(hidden.size());
  good.grad_hidden_states_16bit_out = absl::MakeSpan(out);
  auto refused = [&](const BackwardBatch& batch, const std::string& words) {
    auto id = (*stream)->Submit(batch);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
    EXPECT_THAT(id.status().message(), HasSubstr(words));
  };
  BackwardBatch bad = good;
  bad.input_dtype = v1::DTYPE_FLOAT32;
  refused(bad, "hidden_states_16bit / grad_output_16bit: input_dtype must be float16 or bfloat16");
  bad = good;
  bad.hidden_states = inputs.hidden_states;
  refused(bad, "set one pair, not both");
  bad = good;
  bad.response_dtype = v1::DTYPE_FLOAT32;
  refused(bad, "grad_hidden_states_16bit_out: response_dtype must be float16 or bfloat16");
  bad = good;
  bad.grad_hidden_states_16bit_out = absl::MakeSpan(out).subspan(1);
  refused(bad, "grad_hidden_states_16bit_out: expected");
  bad = good;
  std::vector<float> float_out(hidden.size());
  bad.grad_hidden_states_out = absl::MakeSpan(float_out);
  refused(bad, "set one or neither");
  bad = good;  // split in two: the client checks the sizes it slices
  bad.grad_output_16bit = absl::MakeConstSpan(grad).subspan(1);
  refused(bad, "grad_output_16bit: expected");
  auto id = (*stream)->Submit(good);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE((*stream)->Await(*id).ok());
  EXPECT_TRUE((*stream)->Finish().ok());
}

// RETURN's weight gradients decoded into the caller's memory (weight_gradients_out): bit-equal to
// the result's vectors, for one request and a batch split in two (the sum of two parts does not
// depend on their order), fp32 and bf16 answers, into memory that held other values; the result
// keeps the shapes only. A wrong size, a partial set or ACCUMULATE mode is INVALID_ARGUMENT naming
// the field.
TEST_F(EndToEndTest, WeightGradientsIntoCallerMemoryEqualTheResultVectors) {
  auto stream = client_->StartStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (Shape shape : {Shape{2, 8}, Shape{3, 16}}) {
    for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
      const BatchInputs inputs = RandomBatchInputs(config_, shape.batch, shape.seq_len, 21);
      BackwardBatch batch = inputs.View();
      batch.mode = v1::GRADIENT_MODE_RETURN;
      batch.response_dtype = dtype;
      auto expected = client_->Backward(batch);
      ASSERT_TRUE(expected.ok()) << expected.status();
      ASSERT_TRUE(expected->weight_gradients.has_value());
      PerWeight<std::vector<float>> out;
      for (Weight weight : kAllWeights) {
        out[weight].assign(WeightElements(config_, weight), 7.0f);  // overwritten, not added to
        batch.weight_gradients_out[weight] = absl::MakeSpan(out[weight]);
      }
      auto id = (*stream)->Submit(batch);
      ASSERT_TRUE(id.ok()) << id.status();
      auto got = (*stream)->Await(*id);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->parts, expected->parts);
      EXPECT_EQ(got->parts, shape.batch == 3 ? 2 : 1);  // 48 tokens > max_batch_tokens 32
      EXPECT_EQ(got->grad_hidden_states, expected->grad_hidden_states);
      ASSERT_TRUE(got->weight_gradients.has_value());
      for (Weight weight : kAllWeights) {
        const HostTensor& reference = (*expected->weight_gradients)[weight];
        EXPECT_TRUE((*got->weight_gradients)[weight].data.empty()) << WeightModuleName(weight);
        EXPECT_EQ((*got->weight_gradients)[weight].shape, reference.shape);
        ASSERT_EQ(out[weight].size(), reference.data.size());
        EXPECT_EQ(0, std::memcmp(out[weight].data(), reference.data.data(),
                                 out[weight].size() * sizeof(float)))
            << WeightModuleName(weight) << " B=" << shape.batch << " S=" << shape.seq_len
            << " dtype " << dtype << " parts " << got->parts;
      }
    }
  }
  const BatchInputs inputs = RandomBatchInputs(config_, 2, 8, 22);
  BackwardBatch batch = inputs.View();
  batch.mode = v1::GRADIENT_MODE_RETURN;
  PerWeight<std::vector<float>> out;
  for (Weight weight : kAllWeights) {
    out[weight].resize(WeightElements(config_, weight));
    batch.weight_gradients_out[weight] = absl::MakeSpan(out[weight]);
  }
  std::vector<float> short_k(WeightElements(config_, Weight::kKProj) - 1);
  batch.weight_gradients_out[Weight::kKProj] = absl::MakeSpan(short_k);
  auto bad = (*stream)->Submit(batch);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("weight_gradients_out.k_proj"));
  batch.weight_gradients_out[Weight::kKProj] = {};
  bad = (*stream)->Submit(batch);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("weight_gradients_out.k_proj"));
  batch.weight_gradients_out[Weight::kKProj] = absl::MakeSpan(out[Weight::kKProj]);
  batch.mode = v1::GRADIENT_MODE_ACCUMULATE;
  bad = (*stream)->Submit(batch);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("weight_gradients_out"));
  EXPECT_TRUE((*stream)->Finish().ok());
}

// K ACCUMULATE batches from three concurrent clients; the fetched sums equal the sum of the same
// batches in RETURN mode and the CPU reference; a retried batch id is not added twice;
// fetch-and-zero starts a new window and a batch naming the old window is refused.
TEST_F(EndToEndTest, AccumulateFromConcurrentClientsEqualsReturnSumAndReference) {
  auto zeroed = client_->Zero();
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  const uint64_t window = zeroed->current().window_id();
  const std::vector<Shape> shapes = {{1, 8}, {2, 8}, {1, 16}, {2, 16}, {1, 24}, {1, 32}};
  std::vector<BatchInputs> inputs;
  int64_t tokens = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    inputs.push_back(RandomBatchInputs(config_, shapes[i].batch, shapes[i].seq_len, 100 + i));
    tokens += shapes[i].batch * shapes[i].seq_len;
  }
  constexpr int kClients = 3;
  std::vector<std::thread> threads;
  std::vector<absl::Status> statuses(kClients);
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t]() {
      auto client = Client::Connect(server_->target());
      if (!client.ok()) {
        statuses[t] = client.status();
        return;
      }
      auto stream = (*client)->StartStream();
      if (!stream.ok()) {
        statuses[t] = stream.status();
        return;
      }
      for (size_t i = t; i < inputs.size(); i += kClients) {
        BackwardBatch batch = inputs[i].View();
        batch.mode = v1::GRADIENT_MODE_ACCUMULATE;
        batch.batch_id = 1000 + i;
        batch.accumulation_window_id = window;
        auto id = (*stream)->Submit(batch);
        if (!id.ok()) {
          statuses[t] = id.status();
          return;
        }
      }
      while (true) {
        auto result = (*stream)->Next();
        if (absl::IsOutOfRange(result.status())) break;
        if (!result.ok()) {
          statuses[t] = result.status();
          return;
        }
        if (!result->status.ok()) {
          statuses[t] = result->status;
          return;
        }
        if (result->duplicate || result->accumulation_window_id != window) {
          statuses[t] = absl::InternalError(
              absl::StrCat("batch ", result->batch_id, ": duplicate or wrong window"));
          return;
        }
      }
      statuses[t] = (*stream)->Finish();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : statuses) ASSERT_TRUE(s.ok()) << s;

  auto fetched = client_->Fetch(/*zero_after=*/false, window);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->state.window_id(), window);
  EXPECT_EQ(fetched->state.batches(), static_cast<int64_t>(shapes.size()));
  EXPECT_EQ(fetched->state.tokens(), tokens);
  EXPECT_EQ(fetched->state.server_instance_id(), client_->server_instance_id());

  // The same batches in RETURN mode, summed by the client.
  WeightSet return_sum;
  for (const BatchInputs& in : inputs) {
    auto result = client_->Backward(in.View());
    ASSERT_TRUE(result.ok()) << result.status();
    AddInto(*result->weight_gradients, &return_sum);
  }
  ExpectNear(fetched->gradients, return_sum, 1e-4, "fetched vs RETURN sum");
  ExpectSpecMatch(fetched->gradients, ReferenceSum(inputs), .0067, "fetched vs CPU reference");

  // A retry of an accumulated batch (same id, same window) is answered but not added again.
  BackwardBatch retry = inputs[0].View();
  retry.mode = v1::GRADIENT_MODE_ACCUMULATE;
  retry.batch_id = 1000;
  auto again = client_->Backward(retry);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->duplicate);
  auto after_retry = client_->Fetch(false, window);
  ASSERT_TRUE(after_retry.ok()) << after_retry.status();
  EXPECT_EQ(after_retry->state.batches(), static_cast<int64_t>(shapes.size()));
  EXPECT_EQ(after_retry->gradients[Weight::kQProj].data, fetched->gradients[Weight::kQProj].data);

  // Fetch-and-zero: the sums once more, then an empty new window.
  auto drained = client_->Fetch(/*zero_after=*/true, window);
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(drained->gradients[Weight::kOProj].data, fetched->gradients[Weight::kOProj].data);
  auto empty = client_->Fetch(false);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_NE(empty->state.window_id(), window);
  EXPECT_EQ(empty->state.batches(), 0);
  for (float v : empty->gradients[Weight::kKProj].data) ASSERT_EQ(v, 0.0f);
  retry.accumulation_window_id = window;  // the old window
  auto stale = client_->Backward(retry);
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  auto stale_fetch = client_->Fetch(false, window);
  EXPECT_EQ(stale_fetch.status().code(), absl::StatusCode::kFailedPrecondition);
}

// Bad input of each class gets its code and the server's message naming the field; the stream and
// the server keep serving; the accumulators are untouched.
TEST_F(EndToEndTest, BadInputReachesClientWithServerMessage) {
  auto zeroed = client_->Zero();
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  const uint64_t version = client_->cached_info().weights_version();
  const BatchInputs good = RandomBatchInputs(config_, 1, 8, 21);

  auto stream = client_->StartStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  struct Case {
    std::string what;
    BackwardBatch batch;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  {
    BackwardBatch b = good.View();
    b.mode = v1::GRADIENT_MODE_ACCUMULATE;
    b.hidden_states = b.hidden_states.subspan(0, b.hidden_states.size() - 5);  // wrong byte count
    cases.push_back(
        {"short hidden_states", b, absl::StatusCode::kInvalidArgument, "hidden_states"});
  }
  {
    BackwardBatch b = good.View();
    b.mode = v1::GRADIENT_MODE_ACCUMULATE;
    b.expected_weights_version = version + 100;
    cases.push_back({"unknown version", b, absl::StatusCode::kFailedPrecondition, "version"});
  }
  {
    BackwardBatch b = good.View();
    b.mode = v1::GRADIENT_MODE_ACCUMULATE;
    b.scaling = std::nanf("");
    cases.push_back({"NaN scaling", b, absl::StatusCode::kInvalidArgument, "scaling"});
  }
  {
    BackwardBatch b = good.View();
    b.mode = v1::GRADIENT_MODE_ACCUMULATE;
    b.eps = -1.0f;
    cases.push_back({"negative eps", b, absl::StatusCode::kInvalidArgument, "eps"});
  }
  {
    BackwardBatch b = good.View();
    b.mode = v1::GRADIENT_MODE_ACCUMULATE;
    b.accumulation_window_id = zeroed->current().window_id() + 1000;
    cases.push_back({"other window", b, absl::StatusCode::kFailedPrecondition, "window"});
  }
  {
    BackwardBatch b = good.View();
    b.cos = b.cos.subspan(0, 100);
    cases.push_back({"short cos", b, absl::StatusCode::kInvalidArgument, "cos"});
  }
  for (const Case& c : cases) {
    auto id = (*stream)->Submit(c.batch);
    ASSERT_TRUE(id.ok()) << c.what << ": " << id.status();
    auto result = (*stream)->Await(*id);
    ASSERT_FALSE(result.ok()) << c.what << " was accepted";
    EXPECT_EQ(result.status().code(), c.code) << c.what << ": " << result.status();
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(c.message)) << c.what;
  }
  // The same stream still serves a good batch.
  BackwardBatch ok_batch = good.View();
  auto id = (*stream)->Submit(ok_batch);
  ASSERT_TRUE(id.ok()) << id.status();
  auto answered = (*stream)->Await(*id);
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_TRUE((*stream)->Finish().ok());

  // Through the raw stub: an unknown dtype and a batch over max_batch_tokens (which the library
  // would have split).
  auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionGradient::NewStub(channel);
  grpc::ClientContext context;
  auto raw = stub->Backward(&context);
  const BatchInputs big = RandomBatchInputs(config_, 2, 32, 22);  // 64 tokens > 32
  v1::BackwardRequest bad_dtype;
  bad_dtype.set_batch_id(1);
  *bad_dtype.mutable_hidden_states() = wire::MakeTensor(good.hidden_states, {1, 8, 3072});
  bad_dtype.mutable_hidden_states()->set_dtype(static_cast<v1::DType>(9));
  *bad_dtype.mutable_grad_output() = wire::MakeTensor(good.grad_output, {1, 8, 3072});
  *bad_dtype.mutable_rotary_tables()->mutable_cos() = wire::MakeTensor(good.cos, {1, 8, 128});
  *bad_dtype.mutable_rotary_tables()->mutable_sin() = wire::MakeTensor(good.sin, {1, 8, 128});
  v1::BackwardRequest too_big;
  too_big.set_batch_id(2);
  *too_big.mutable_hidden_states() = wire::MakeTensor(big.hidden_states, {2, 32, 3072});
  *too_big.mutable_grad_output() = wire::MakeTensor(big.grad_output, {2, 32, 3072});
  too_big.mutable_positions()->add_position_ids(0);
  for (const v1::BackwardRequest* request : {&bad_dtype, &too_big}) {
    ASSERT_TRUE(raw->Write(*request));
    v1::BackwardResponse response;
    ASSERT_TRUE(raw->Read(&response));
    EXPECT_EQ(response.batch_id(), request->batch_id());
    ASSERT_TRUE(response.has_error());
    if (request == &bad_dtype) {
      EXPECT_EQ(response.error().code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(response.error().message(), HasSubstr("hidden_states"));
    } else {
      EXPECT_EQ(response.error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_THAT(response.error().message(), HasSubstr("split"));
    }
  }
  raw->WritesDone();
  EXPECT_TRUE(raw->Finish().ok());

  // Unary calls: wrong expected versions / windows, a wrongly shaped weight upload.
  auto fetch_other = client_->Fetch(false, zeroed->current().window_id() + 1000);
  EXPECT_EQ(fetch_other.status().code(), absl::StatusCode::kFailedPrecondition);
  auto zero_other = client_->Zero(zeroed->current().window_id() + 1000);
  EXPECT_EQ(zero_other.status().code(), absl::StatusCode::kFailedPrecondition);
  WeightSet weights = ServerWeights();
  auto stale_upload = client_->LoadWeights(weights, version + 100);
  EXPECT_EQ(stale_upload.status().code(), absl::StatusCode::kFailedPrecondition)
      << stale_upload.status();
  weights[Weight::kQProj].shape = {3072, 3071};
  weights[Weight::kQProj].data.resize(3072 * 3071);
  auto bad_upload = client_->LoadWeights(weights);
  EXPECT_EQ(bad_upload.status().code(), absl::StatusCode::kInvalidArgument) << bad_upload.status();
  EXPECT_THAT(std::string(bad_upload.status().message()), HasSubstr("q_proj"));

  // Nothing was accumulated and the weights did not change.
  auto state = client_->Fetch(false);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->state.batches(), 0);
  EXPECT_EQ(state->state.tokens(), 0);
  for (float v : state->gradients[Weight::kQProj].data) ASSERT_EQ(v, 0.0f);
  auto info = client_->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->weights_version(), version);
}

// A stream cancelled with batches in flight leaves the accumulators consistent: once the server is
// quiet, re-sending every batch with its id adds exactly the ones that were not accumulated, and
// the window then holds each batch exactly once.
TEST_F(EndToEndTest, CancelledStreamLeavesAccumulatorsConsistent) {
  auto zeroed = client_->Zero();
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  const uint64_t window = zeroed->current().window_id();
  std::vector<BatchInputs> inputs;
  for (int i = 0; i < 4; ++i) inputs.push_back(RandomBatchInputs(config_, 1, 16, 300 + i));
  {
    auto stream = client_->StartStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    for (int i = 0; i < 4; ++i) {
      BackwardBatch b = inputs[i].View();
      b.mode = v1::GRADIENT_MODE_ACCUMULATE;
      b.batch_id = 2000 + i;
      b.accumulation_window_id = window;
      ASSERT_TRUE((*stream)->Submit(b).ok());
    }
    (*stream)->Cancel();
    EXPECT_FALSE((*stream)->Finish().ok());
  }
  // Wait until the count stops moving (batches already queued may still complete).
  int64_t last = -1;
  for (int i = 0; i < 60; ++i) {
    auto state = client_->Fetch(false, window);
    ASSERT_TRUE(state.ok()) << state.status();
    if (state->state.batches() == last) break;
    last = state->state.batches();
    absl::SleepFor(absl::Seconds(1));
  }
  EXPECT_LE(last, 4);
  int duplicates = 0;
  for (int i = 0; i < 4; ++i) {
    BackwardBatch b = inputs[i].View();
    b.mode = v1::GRADIENT_MODE_ACCUMULATE;
    b.batch_id = 2000 + i;
    b.accumulation_window_id = window;
    auto result = client_->Backward(b);
    ASSERT_TRUE(result.ok()) << result.status();
    duplicates += result->duplicate ? 1 : 0;
  }
  EXPECT_EQ(duplicates, last);
  auto fetched = client_->Fetch(false, window);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->state.batches(), 4);
  EXPECT_EQ(fetched->state.tokens(), 4 * 16);
  ExpectSpecMatch(fetched->gradients, ReferenceSum(inputs), .0067, "after cancel + resend");
}

// A server restart is detected through the instance id and reported as ABORTED until accepted.
TEST_F(EndToEndTest, ServerRestartIsDetected) {
  BackwardBatch batch;
  const BatchInputs inputs = RandomBatchInputs(config_, 1, 8, 41);
  batch = inputs.View();
  batch.mode = v1::GRADIENT_MODE_ACCUMULATE;
  ASSERT_TRUE(client_->Backward(batch).ok());
  const std::string before = client_->server_instance_id();
  ASSERT_TRUE(server_->Restart().ok()) << server_->LogTail();

  auto fetched = client_->Fetch(false);
  ASSERT_FALSE(fetched.ok());
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kAborted) << fetched.status();
  EXPECT_THAT(std::string(fetched.status().message()), HasSubstr("restarted"));
  EXPECT_THAT(std::string(fetched.status().message()), HasSubstr(before));
  // Sticky: every data call fails until the restart is accepted.
  auto again = client_->Backward(batch);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(client_->StartStream().status().code(), absl::StatusCode::kAborted);

  ASSERT_TRUE(client_->AcceptServerRestart().ok());
  EXPECT_NE(client_->server_instance_id(), before);
  auto fresh = client_->Fetch(false);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->state.batches(), 0);  // the old window is gone, and the client was told
}

// Idempotent calls retry through a short outage: the server is down when Info starts.
TEST_F(EndToEndTest, IdempotentCallsRetryWithBackoff) {
  ClientOptions options;
  options.max_attempts = 8;
  options.initial_backoff = absl::Milliseconds(500);
  options.deadline = absl::Seconds(5);
  auto client = Client::Connect(server_->target(), options);
  ASSERT_TRUE(client.ok()) << client.status();
  server_->Stop();
  std::thread restarter([this]() {
    absl::SleepFor(absl::Seconds(1));
    EXPECT_TRUE(server_->Restart().ok());
  });
  auto info = (*client)->Info();
  restarter.join();
  ASSERT_TRUE(info.ok()) << info.status();
  // The restart is recorded and surfaced on the next data call.
  EXPECT_EQ((*client)->Fetch(false).status().code(), absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace attngrad
