// Every bad-input class of a Backward request is answered in-band with its status code and a
// message naming the field; the same stream then serves the next (good) request, and the
// accumulators hold only the good batches.
#include <cmath>
#include <cstring>
#include <map>
#include <functional>
#include <limits>

#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

class ServerBadInputTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override { options.max_batch_tokens = 32; }
};

struct BadCase {
  std::string name;
  std::function<void(v1::BackwardRequest&)> spoil;
  grpc::StatusCode code;
  std::string field;  // the message must contain it
};

TEST_F(ServerBadInputTest, EachClassGetsItsCodeAndTheStreamContinues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::int64_t hidden = config().hidden_size;
  const std::vector<BadCase> cases = {
      {"missing hidden_states", [](auto& r) { r.clear_hidden_states(); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states"},
      {"wrong hidden size", [](auto& r) { r.mutable_hidden_states()->set_shape(2, 100); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape"},
      {"wrong rank", [](auto& r) { r.mutable_hidden_states()->add_shape(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape"},
      {"zero batch", [](auto& r) { r.mutable_hidden_states()->set_shape(0, 0); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape"},
      {"byte count", [](auto& r) { r.mutable_hidden_states()->mutable_raw_data()->resize(100); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.raw_data"},
      {"unknown dtype",
       [](auto& r) { r.mutable_grad_output()->set_dtype(static_cast<v1::DType>(7)); },
       grpc::StatusCode::INVALID_ARGUMENT, "grad_output.dtype"},
      {"unspecified dtype",
       [](auto& r) { r.mutable_grad_output()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       grpc::StatusCode::INVALID_ARGUMENT, "grad_output.dtype"},
      {"grad_output shape", [](auto& r) { r.mutable_grad_output()->set_shape(1, 3); },
       grpc::StatusCode::INVALID_ARGUMENT, "grad_output.shape"},
      {"cos shape", [](auto& r) { r.mutable_rotary_tables()->mutable_cos()->set_shape(2, 64); },
       grpc::StatusCode::INVALID_ARGUMENT, "rotary_tables.cos.shape"},
      {"missing sin", [](auto& r) { r.mutable_rotary_tables()->clear_sin(); },
       grpc::StatusCode::INVALID_ARGUMENT, "rotary_tables"},
      {"no rotary", [](auto& r) { r.clear_rotary_tables(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "rotary"},
      {"position count",
       [](auto& r) {
         r.mutable_positions()->add_position_ids(0);  // 1 id for S=2
       },
       grpc::StatusCode::INVALID_ARGUMENT, "positions.position_ids"},
      {"negative theta",
       [](auto& r) {
         r.mutable_positions()->add_position_ids(0);
         r.mutable_positions()->add_position_ids(1);
         r.mutable_positions()->set_rope_theta(-1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "positions.rope_theta"},
      {"NaN scaling", [nan](auto& r) { r.set_scaling(nan); }, grpc::StatusCode::INVALID_ARGUMENT,
       "scaling"},
      {"infinite eps", [inf](auto& r) { r.set_eps(inf); }, grpc::StatusCode::INVALID_ARGUMENT,
       "eps"},
      // softcap <= 0 means "no soft-capping" (Gemma-3 layers without a cap); a non-finite one is
      // refused.
      {"infinite softcap", [inf](auto& r) { r.set_softcap(-inf); },
       grpc::StatusCode::INVALID_ARGUMENT, "softcap"},
      {"negative sliding window", [](auto& r) { r.set_sliding_window(-2); },
       grpc::StatusCode::INVALID_ARGUMENT, "sliding_window"},
      {"unknown layer", [](auto& r) { r.set_layer(3); }, grpc::StatusCode::INVALID_ARGUMENT,
       "layer: this server has no decoder layer 3; it holds layer 0"},
      {"unknown mode", [](auto& r) { r.set_mode(static_cast<v1::GradientMode>(9)); },
       grpc::StatusCode::INVALID_ARGUMENT, "mode"},
      {"unknown precision", [](auto& r) { r.set_precision(static_cast<v1::Precision>(17)); },
       grpc::StatusCode::INVALID_ARGUMENT, "precision"},
      {"unknown response dtype", [](auto& r) { r.set_response_dtype(static_cast<v1::DType>(5)); },
       grpc::StatusCode::INVALID_ARGUMENT, "response_dtype"},
      {"non-finite activation",
       [nan](auto& r) {
         std::string& raw = *r.mutable_hidden_states()->mutable_raw_data();
         std::memcpy(raw.data() + 8, &nan, 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.raw_data: element 2"},
      {"weights version", [](auto& r) { r.set_expected_weights_version(5); },
       grpc::StatusCode::FAILED_PRECONDITION, "expected_weights_version"},
      {"unknown window", [](auto& r) { r.set_accumulation_window_id(1); },
       grpc::StatusCode::FAILED_PRECONDITION, "accumulation_window_id"},
      {"window with RETURN",
       [](auto& r) {
         r.set_mode(v1::GRADIENT_MODE_RETURN);
         r.set_accumulation_window_id(3);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "accumulation_window_id"},
  };

  std::vector<v1::BackwardRequest> requests;
  std::vector<Batch> good_batches;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Batch bad = MakeBatch(config(), 1, 2, 900 + i);
    v1::BackwardRequest request =
        MakeRequest(config(), bad, 10000 + i, v1::GRADIENT_MODE_ACCUMULATE);
    cases[i].spoil(request);
    requests.push_back(request);
    good_batches.push_back(MakeBatch(config(), 1, 2, 2000 + i));
    requests.push_back(
        MakeRequest(config(), good_batches.back(), 20000 + i, v1::GRADIENT_MODE_ACCUMULATE));
  }
  // Too many tokens for --max_batch_tokens=32: B=3, S=16.
  const Batch big = MakeBatch(config(), 3, 16, 3000);
  requests.push_back(MakeRequest(config(), big, 30000, v1::GRADIENT_MODE_ACCUMULATE));
  good_batches.push_back(MakeBatch(config(), 1, 2, 3001));
  requests.push_back(
      MakeRequest(config(), good_batches.back(), 30001, v1::GRADIENT_MODE_ACCUMULATE));
  (void)hidden;

  const std::vector<v1::BackwardResponse> responses = RunStream(stub(), requests);
  ASSERT_EQ(responses.size(), requests.size());
  std::map<std::uint64_t, v1::BackwardResponse> by_id;
  for (const v1::BackwardResponse& response : responses) by_id[response.batch_id()] = response;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    const v1::BackwardResponse& bad = by_id[10000 + i];
    ASSERT_TRUE(bad.has_error());
    EXPECT_EQ(bad.error().code(), static_cast<int>(cases[i].code)) << bad.error().message();
    EXPECT_NE(bad.error().message().find(cases[i].field), std::string::npos)
        << "message: " << bad.error().message();
    EXPECT_FALSE(bad.has_grad_hidden_states());
    const v1::BackwardResponse& good = by_id[20000 + i];
    EXPECT_FALSE(good.has_error()) << good.error().message();
    EXPECT_EQ(good.grad_hidden_states().raw_data().size(), 2u * config().hidden_size * 4);
  }
  const v1::BackwardResponse& too_big = by_id[30000];
  EXPECT_EQ(too_big.error().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(too_big.error().message().find("split the batch along B"), std::string::npos)
      << too_big.error().message();
  EXPECT_NE(too_big.error().message().find("at most 2 sequences of S=16"), std::string::npos)
      << too_big.error().message();
  EXPECT_FALSE(by_id[30001].has_error());

  // Only the good batches were accumulated.
  const Fetched fetched = Fetch(stub(), v1::FetchGradientsRequest());
  ASSERT_TRUE(fetched.status.ok());
  EXPECT_EQ(fetched.state.batches(), static_cast<long long>(good_batches.size()));
  LayerTensors sum = ZeroWeights<std::vector<float>>(config());
  for (const Batch& batch : good_batches) {
    const Gradients gradients = Reference(weights(), batch);
    for (Weight w : kAllWeights) {
      for (std::size_t j = 0; j < sum[w].size(); ++j) sum[w][j] += gradients.weights[w][j];
    }
  }
  EXPECT_TRUE(Close(fetched.gradients, sum, Tolerance(1e-5), "good batches only"));
}

TEST_F(ServerBadInputTest, FetchRejectsBadArguments) {
  v1::FetchGradientsRequest request;
  request.set_dtype(static_cast<v1::DType>(12));
  Fetched fetched = Fetch(stub(), request);
  EXPECT_EQ(fetched.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(fetched.status.error_message().find("dtype"), std::string::npos);
  request.set_dtype(v1::DTYPE_FLOAT32);
  request.set_chunk_bytes(-5);
  fetched = Fetch(stub(), request);
  EXPECT_EQ(fetched.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(fetched.status.error_message().find("chunk_bytes"), std::string::npos);
}

}  // namespace
}  // namespace attngrad::server::testing
