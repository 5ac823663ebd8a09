// Backward in RETURN mode: the answer equals attngrad::BackwardHost on the same inputs, for fp32
// and 16-bit wire dtypes, with rotary tables or positions.
#include <cmath>

#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

class ServerBackwardTest : public ServerTest {};

TEST_F(ServerBackwardTest, ReturnMatchesBackwardHost) {
  const Batch batch = MakeBatch(config(), 2, 6, 101);
  const Gradients expected = Reference(weights(), batch);
  const v1::BackwardResponse response =
      RunOne(stub(), MakeRequest(config(), batch, 42, v1::GRADIENT_MODE_RETURN));
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(response.batch_id(), 42u);
  EXPECT_EQ(response.weights_version(), 1u);
  if (TestOnGpu()) {
    EXPECT_EQ(response.device().rfind("cuda:", 0), 0u) << response.device();
  } else {
    EXPECT_EQ(response.device(), "cpu");
  }
  EXPECT_EQ(response.server_instance_id(), server().instance_id());
  EXPECT_FALSE(response.duplicate());
  EXPECT_GT(response.timings().compute_seconds(), 0.0);
  EXPECT_GE(response.timings().total_seconds(), response.timings().compute_seconds());
  ASSERT_EQ(response.grad_hidden_states().shape_size(), 3);
  EXPECT_EQ(response.grad_hidden_states().shape(0), 2);
  EXPECT_EQ(response.grad_hidden_states().shape(1), 6);
  EXPECT_EQ(response.grad_hidden_states().shape(2), config().hidden_size);
  EXPECT_EQ(response.weight_gradients().q_proj().shape(0), config().q_out());
  EXPECT_EQ(response.weight_gradients().o_proj().shape(1), config().q_out());
  EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                    Tolerance(1e-5), "grad_hidden_states"));
  EXPECT_TRUE(Close(ResponseWeightGradients(response), expected.weights, Tolerance(1e-5),
                    "weight gradient"));
}

TEST_F(ServerBackwardTest, PositionsBuildTheSameRotaryTables) {
  const Batch batch = MakeBatch(config(), 2, 5, 202);
  const Gradients expected = Reference(weights(), batch);
  v1::BackwardRequest request = MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_ACCUMULATE);
  // Shared positions 0..S-1 (S values), default theta.
  request.mutable_positions()->clear_position_ids();
  for (int s = 0; s < batch.seq_len; ++s) request.mutable_positions()->add_position_ids(s);
  ASSERT_EQ(request.rotary_case(), v1::BackwardRequest::kPositions);
  v1::BackwardRequest per_token = request;
  per_token.set_batch_id(2);
  per_token.mutable_positions()->clear_position_ids();
  for (int b = 0; b < batch.batch; ++b) {
    for (int s = 0; s < batch.seq_len; ++s) per_token.mutable_positions()->add_position_ids(s);
  }
  per_token.mutable_positions()->set_rope_theta(10000.0);
  const std::vector<v1::BackwardResponse> responses = RunStream(stub(), {request, per_token});
  ASSERT_EQ(responses.size(), 2u);
  for (const v1::BackwardResponse& response : responses) {
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_FALSE(response.has_weight_gradients());  // ACCUMULATE returns only grad_hidden_states
    EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                      Tolerance(1e-4), "grad_hidden_states from positions"));
  }
}

TEST_F(ServerBackwardTest, SixteenBitWireDtypes) {
  Batch batch = MakeBatch(config(), 1, 4, 303);
  // Round the inputs to what travels: hidden_states as bf16, grad_output as fp16.
  v1::BackwardRequest request = MakeRequest(config(), batch, 9, v1::GRADIENT_MODE_RETURN);
  wire::EncodeTensor(batch.hidden_states, {1, 4, config().hidden_size}, v1::DTYPE_BFLOAT16,
                     request.mutable_hidden_states());
  wire::EncodeTensor(batch.grad_output, {1, 4, config().hidden_size}, v1::DTYPE_FLOAT16,
                     request.mutable_grad_output());
  for (float& value : batch.hidden_states) {
    value = wire::BFloat16ToFloat(wire::FloatToBFloat16(value));
  }
  for (float& value : batch.grad_output) value = wire::HalfToFloat(wire::FloatToHalf(value));
  request.set_response_dtype(v1::DTYPE_FLOAT16);
  const Gradients expected = Reference(weights(), batch);
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(response.grad_hidden_states().dtype(), v1::DTYPE_FLOAT16);
  EXPECT_EQ(response.grad_hidden_states().raw_data().size(), 4u * config().hidden_size * 2);
  EXPECT_EQ(response.weight_gradients().k_norm().dtype(), v1::DTYPE_FLOAT16);
  // fp16 output rounding: relative 2^-11 per element, plus subnormals.
  EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()), expected.grad_hidden_states,
                    Tolerance(1e-3), "grad_hidden_states (fp16)"));
  EXPECT_TRUE(Close(ResponseWeightGradients(response), expected.weights, Tolerance(1e-3),
                    "weight gradient (fp16)"));
}

TEST_F(ServerBackwardTest, ManyBatchesOnOneStreamAreAllAnswered) {
  std::vector<v1::BackwardRequest> requests;
  std::vector<Gradients> expected;
  for (int i = 0; i < 7; ++i) {
    const Batch batch = MakeBatch(config(), 1, 2 + i % 3, 400 + i);
    expected.push_back(Reference(weights(), batch));
    requests.push_back(MakeRequest(config(), batch, 1000 + i, v1::GRADIENT_MODE_ACCUMULATE));
  }
  const std::vector<v1::BackwardResponse> responses =
      ByBatchId(RunStream(stub(), requests), 1000, requests.size());
  if (HasFailure()) return;
  for (std::size_t index = 0; index < responses.size(); ++index) {
    EXPECT_TRUE(Close(ToFloats(responses[index].grad_hidden_states()),
                      expected[index].grad_hidden_states, Tolerance(1e-5), "grad_hidden_states"));
  }
}

}  // namespace
}  // namespace attngrad::server::testing
