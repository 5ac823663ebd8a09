// FORWARD batches on the Backward stream (BackwardRequest.computation = COMPUTATION_FORWARD): the
// answer's `output` equals attngrad::ForwardHost on the same inputs (fp32, and bf16 rounded once),
// it goes into a host shared-memory region with output_region, every field a forward batch must
// not carry is INVALID_ARGUMENT naming it while the stream goes on, forward and backward batches
// interleave on one stream (the forward ones accumulating nothing), the weights version is pinned
// as for the backward, and forward batches are counted under their own mode label.
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/shared_memory_region.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

class ServerForwardTest : public ServerTest {
 protected:
  std::vector<std::int64_t> ActivationShape(const Batch& batch) const {
    return {batch.batch, batch.seq_len, config().hidden_size};
  }
};

void ExpectInvalidNaming(const v1::BackwardResponse& response, const std::string& field,
                         const std::string& what) {
  ASSERT_TRUE(response.has_error()) << what << ": answered without an error";
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT))
      << what << ": " << response.error().message();
  EXPECT_EQ(response.error().message().rfind(field, 0), 0u)
      << what << ": the message does not start with " << field << ": "
      << response.error().message();
}

TEST_F(ServerForwardTest, OutputMatchesForwardHost) {
  const Batch batch = MakeBatch(config(), 2, 6, 501);
  const std::vector<float> expected = ForwardReference(weights(), batch);
  v1::BackwardRequest unset_mode = MakeForwardRequest(config(), batch, 7);
  v1::BackwardRequest return_mode = MakeForwardRequest(config(), batch, 8);
  return_mode.set_mode(v1::GRADIENT_MODE_RETURN);
  for (const v1::BackwardRequest& request : {unset_mode, return_mode}) {
    const v1::BackwardResponse response = RunOne(stub(), request);
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_EQ(response.batch_id(), request.batch_id());
    EXPECT_EQ(response.weights_version(), 1u);
    EXPECT_EQ(response.layer(), 0);
    EXPECT_EQ(response.server_instance_id(), server().instance_id());
    EXPECT_EQ(response.device(), TestOnGpu() ? "cuda:0" : "cpu");
    EXPECT_GT(response.timings().compute_seconds(), 0.0);
    // The output alone: no gradient of any kind.
    EXPECT_FALSE(response.has_grad_hidden_states());
    EXPECT_FALSE(response.has_weight_gradients());
    ASSERT_TRUE(response.has_output());
    EXPECT_EQ(response.output().dtype(), v1::DTYPE_FLOAT32);
    EXPECT_EQ(std::vector<std::int64_t>(response.output().shape().begin(),
                                        response.output().shape().end()),
              ActivationShape(batch));
    const std::vector<float> output = ToFloats(response.output());
    if (!TestOnGpu()) {  // the CPU worker calls ForwardHost itself: the same bits
      ASSERT_EQ(output.size(), expected.size());
      EXPECT_EQ(std::memcmp(output.data(), expected.data(), output.size() * sizeof(float)), 0);
    }
    EXPECT_TRUE(Close(output, expected, Tolerance(1e-6), "output"));
  }
}

// bf16 in and out: the answer is ForwardHost on the bf16-rounded hidden_states, rounded to bf16
// once (on the CPU, bit for bit that rounding).
TEST_F(ServerForwardTest, SixteenBitWireDtypes) {
  Batch batch = MakeBatch(config(), 1, 5, 502);
  v1::BackwardRequest request = MakeForwardRequest(config(), batch, 9);
  wire::EncodeTensor(batch.hidden_states, ActivationShape(batch), v1::DTYPE_BFLOAT16,
                     request.mutable_hidden_states());
  for (float& value : batch.hidden_states) {
    value = wire::BFloat16ToFloat(wire::FloatToBFloat16(value));
  }
  const std::vector<float> expected = ForwardReference(weights(), batch);
  for (v1::DType dtype : {v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16, v1::DTYPE_FLOAT32}) {
    request.set_response_dtype(dtype);
    const v1::BackwardResponse response = RunOne(stub(), request);
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_EQ(response.output().dtype(), dtype);
    EXPECT_EQ(response.output().raw_data().size(),
              5u * config().hidden_size * wire::DTypeSize(dtype));
    if (!TestOnGpu()) {
      v1::Tensor rounded;
      wire::EncodeTensor(expected, ActivationShape(batch), dtype, &rounded);
      EXPECT_EQ(response.output().raw_data(), rounded.raw_data()) << wire::DTypeName(dtype);
    }
    // A 16-bit answer carries its rounding: 2^-8 (bf16) or 2^-11 (fp16) relative per element.
    EXPECT_TRUE(Close(ToFloats(response.output()), expected,
                      Tolerance(dtype == v1::DTYPE_BFLOAT16 ? 8e-3 : 1e-3),
                      std::string("output as ") + wire::DTypeName(dtype)));
  }
}

// Positions instead of rotary tables, a layer named explicitly and scalars overridden, as a
// backward batch has them.
TEST_F(ServerForwardTest, PositionsLayerAndScalarsApply) {
  const Batch batch = MakeBatch(config(), 1, 7, 503);
  v1::BackwardRequest request = MakeForwardRequest(config(), batch, 10);
  request.clear_rotary_tables();
  for (int s = 0; s < batch.seq_len; ++s) request.mutable_positions()->add_position_ids(s);
  request.set_layer(0);
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_TRUE(Close(ToFloats(response.output()), ForwardReference(weights(), batch),
                    Tolerance(1e-4), "output from positions"));
  // Another soft-cap gives another output.
  request.set_softcap(1.0f);
  const v1::BackwardResponse capped = RunOne(stub(), request);
  ASSERT_FALSE(capped.has_error()) << capped.error().message();
  EXPECT_NE(capped.output().raw_data(), response.output().raw_data());
}

TEST_F(ServerForwardTest, OutputGoesIntoAHostRegionWithTheBitsOfTheBytesPath) {
  const Batch batch = MakeBatch(config(), 1, 8, 504);
  const v1::BackwardRequest bytes_request = MakeForwardRequest(config(), batch, 11);
  const v1::BackwardResponse expected = RunOne(stub(), bytes_request);
  ASSERT_FALSE(expected.has_error()) << expected.error().message();
  const std::size_t bytes = batch.hidden_states.size() * sizeof(float);
  absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> memory =
      SharedMemoryRegion::Create(2 * bytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  absl::StatusOr<std::uint64_t> region = RegisterRegionDescriptor(
      server().region_socket_path(), (*memory)->fd(), static_cast<std::int64_t>(2 * bytes), {});
  ASSERT_TRUE(region.ok()) << region.status();
  // hidden_states read from the region's first half, the output written into its second.
  char* const data = (*memory)->data();
  std::memcpy(data, batch.hidden_states.data(), bytes);
  std::memset(data + bytes, 0x7f, bytes);
  v1::BackwardRequest request = bytes_request;
  request.mutable_hidden_states()->clear_raw_data();
  auto slice = [&](std::int64_t offset) {
    v1::RegionSlice result;
    result.set_region_id(*region);
    result.set_offset(offset);
    result.set_byte_size(static_cast<std::int64_t>(bytes));
    return result;
  };
  *request.mutable_hidden_states_region() = slice(0);
  *request.mutable_output_region() = slice(static_cast<std::int64_t>(bytes));
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_TRUE(response.output().raw_data().empty());
  EXPECT_EQ(response.output().dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(response.output().shape_size(), 3);
  ASSERT_EQ(expected.output().raw_data().size(), bytes);
  EXPECT_EQ(std::memcmp(data + bytes, expected.output().raw_data().data(), bytes), 0);
  EXPECT_EQ(std::memcmp(data, batch.hidden_states.data(), bytes), 0);  // only read

  // A slice of the wrong size names output_region and the bytes it expects.
  request.mutable_output_region()->set_byte_size(static_cast<std::int64_t>(bytes) - 4);
  const v1::BackwardResponse refused = RunOne(stub(), request);
  ExpectInvalidNaming(refused, "output_region.byte_size", "short output_region");
  EXPECT_NE(refused.error().message().find(std::to_string(bytes)), std::string::npos)
      << refused.error().message();
}

// Every field a FORWARD batch must not carry, and output_region in a backward batch, is refused
// naming the field; the batches after them on the same stream are answered.
TEST_F(ServerForwardTest, BadCombinationsAreRefusedNamingTheFieldAndTheStreamGoesOn) {
  const Batch batch = MakeBatch(config(), 1, 4, 505);
  const v1::BackwardRequest good = MakeForwardRequest(config(), batch, 100);
  v1::RegionSlice slice;
  slice.set_region_id(1);
  slice.set_byte_size(16);
  struct Case {
    std::string field;
    v1::BackwardRequest request;
  };
  std::vector<Case> cases;
  auto add = [&](const std::string& field, auto change) {
    v1::BackwardRequest request = good;
    request.set_batch_id(200 + cases.size());
    change(request);
    cases.push_back({field, std::move(request)});
  };
  add("grad_output", [&](v1::BackwardRequest& r) {
    *r.mutable_grad_output() = FloatTensor(batch.grad_output, ActivationShape(batch));
  });
  add("grad_output_region",
      [&](v1::BackwardRequest& r) { *r.mutable_grad_output_region() = slice; });
  add("mode", [](v1::BackwardRequest& r) { r.set_mode(v1::GRADIENT_MODE_ACCUMULATE); });
  add("grad_hidden_states_region",
      [&](v1::BackwardRequest& r) { *r.mutable_grad_hidden_states_region() = slice; });
  add("weight_gradients_region",
      [&](v1::BackwardRequest& r) { *r.mutable_weight_gradients_region() = slice; });
  add("accumulation_window_id", [](v1::BackwardRequest& r) { r.set_accumulation_window_id(3); });
  add("computation",
      [](v1::BackwardRequest& r) { r.set_computation(static_cast<v1::Computation>(7)); });
  add("hidden_states", [](v1::BackwardRequest& r) { r.clear_hidden_states(); });
  add("hidden_states", [&](v1::BackwardRequest& r) {
    r.mutable_hidden_states()->set_shape(2, config().hidden_size + 1);
  });
  add("output_region", [&](v1::BackwardRequest& r) {  // a backward batch
    r = MakeRequest(config(), batch, r.batch_id(), v1::GRADIENT_MODE_RETURN);
    *r.mutable_output_region() = slice;
  });
  std::vector<v1::BackwardRequest> requests;
  for (const Case& c : cases) requests.push_back(c.request);
  requests.push_back(good);
  v1::BackwardRequest backward = MakeRequest(config(), batch, 101, v1::GRADIENT_MODE_RETURN);
  requests.push_back(backward);
  grpc::Status status;
  const std::vector<v1::BackwardResponse> responses = RunStream(stub(), requests, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(responses.size(), requests.size());
  int answered = 0;
  for (const v1::BackwardResponse& response : responses) {
    if (response.batch_id() >= 200) {
      const Case& c = cases[response.batch_id() - 200];
      ExpectInvalidNaming(response, c.field, "case " + std::to_string(response.batch_id() - 200));
      continue;
    }
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_EQ(response.has_output(), response.batch_id() == 100);
    EXPECT_EQ(response.has_grad_hidden_states(), response.batch_id() == 101);
    ++answered;
  }
  EXPECT_EQ(answered, 2);
  // The missing and the misshapen hidden_states say the shape they expect.
  for (const v1::BackwardResponse& response : responses) {
    if (response.batch_id() == 207 || response.batch_id() == 208) {
      EXPECT_NE(response.error().message().find(absl::StrCat(config().hidden_size, "]")),
                std::string::npos)
          << response.error().message();
    }
  }
}

// Forward and backward batches interleaved on one stream are all answered right; the forward ones
// add nothing to the accumulated sums.
TEST_F(ServerForwardTest, InterleavedWithBackwardBatchesOnOneStream) {
  std::vector<Batch> batches;
  std::vector<v1::BackwardRequest> requests;
  for (int i = 0; i < 8; ++i) {
    batches.push_back(MakeBatch(config(), 1, 2 + i % 3, 600 + i));
    const std::uint64_t id = 1000 + i;
    if (i % 2 == 0) {
      requests.push_back(MakeForwardRequest(config(), batches.back(), id));
    } else {
      requests.push_back(
          MakeRequest(config(), batches.back(), id,
                      i % 4 == 1 ? v1::GRADIENT_MODE_ACCUMULATE : v1::GRADIENT_MODE_RETURN));
    }
  }
  const std::vector<v1::BackwardResponse> responses =
      ByBatchId(RunStream(stub(), requests), 1000, requests.size());
  if (HasFailure()) return;
  for (std::size_t index = 0; index < responses.size(); ++index) {
    const v1::BackwardResponse& response = responses[index];
    if (index % 2 == 0) {
      EXPECT_FALSE(response.has_grad_hidden_states());
      EXPECT_TRUE(Close(ToFloats(response.output()), ForwardReference(weights(), batches[index]),
                        Tolerance(1e-6), "output"));
    } else {
      EXPECT_FALSE(response.has_output());
      EXPECT_EQ(response.has_weight_gradients(), index % 4 == 3);
      EXPECT_TRUE(Close(ToFloats(response.grad_hidden_states()),
                        Reference(weights(), batches[index]).grad_hidden_states, Tolerance(1e-5),
                        "grad_hidden_states"));
    }
  }
  v1::FetchGradientsRequest fetch;
  const Fetched fetched = Fetch(stub(), fetch);
  ASSERT_TRUE(fetched.status.ok()) << fetched.status.error_message();
  EXPECT_EQ(fetched.state.batches(), 2);  // batches 1001 and 1005
  EXPECT_EQ(fetched.state.tokens(), batches[1].seq_len + batches[5].seq_len);
}

// expected_weights_version pins the weights of a forward batch as of a backward one.
TEST_F(ServerForwardTest, ExpectedWeightsVersionIsChecked) {
  const Batch batch = MakeBatch(config(), 1, 3, 506);
  v1::BackwardRequest request = MakeForwardRequest(config(), batch, 20);
  request.set_expected_weights_version(1);
  const v1::BackwardResponse pinned = RunOne(stub(), request);
  ASSERT_FALSE(pinned.has_error()) << pinned.error().message();
  EXPECT_EQ(pinned.weights_version(), 1u);

  const LayerWeights replacement = RandomLayerWeights(config(), 77);
  v1::LoadWeightsResponse loaded;
  ASSERT_TRUE(Upload(stub(), replacement, 1, &loaded).ok());
  ASSERT_EQ(loaded.weights_version(), 2u);
  const v1::BackwardResponse stale = RunOne(stub(), request);
  ASSERT_TRUE(stale.has_error());
  EXPECT_EQ(stale.error().code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  EXPECT_EQ(stale.error().message().rfind("expected_weights_version", 0), 0u)
      << stale.error().message();

  request.set_expected_weights_version(2);
  const v1::BackwardResponse current = RunOne(stub(), request);
  ASSERT_FALSE(current.has_error()) << current.error().message();
  EXPECT_EQ(current.weights_version(), 2u);
  EXPECT_TRUE(Close(ToFloats(current.output()), ForwardReference(replacement, batch),
                    Tolerance(1e-6), "output with the new weights"));
}

// Finite inputs whose output overflows fp32 are refused naming `output`; the stream goes on.
TEST_F(ServerForwardTest, NonFiniteOutputIsRefusedNamingOutput) {
  Batch batch = MakeBatch(config(), 1, 3, 508);
  for (float& value : batch.hidden_states) value = 3e38f;  // finite; X Wᵀ overflows fp32
  const Batch fine = MakeBatch(config(), 1, 3, 509);
  const std::vector<v1::BackwardResponse> responses = RunStream(
      stub(), {MakeForwardRequest(config(), batch, 1), MakeForwardRequest(config(), fine, 2)});
  ASSERT_EQ(responses.size(), 2u);
  for (const v1::BackwardResponse& response : responses) {
    if (response.batch_id() == 1) {
      ExpectInvalidNaming(response, "output", "overflowing output");
    } else {
      EXPECT_FALSE(response.has_error()) << response.error().message();
    }
  }
}

TEST_F(ServerForwardTest, ForwardBatchesHaveTheirOwnModeLabel) {
  const Batch batch = MakeBatch(config(), 1, 2, 507);
  ASSERT_FALSE(RunOne(stub(), MakeForwardRequest(config(), batch, 1)).has_error());
  ASSERT_FALSE(
      RunOne(stub(), MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_RETURN)).has_error());
  const std::string device = TestOnGpu() ? "cuda:0" : "cpu";
  const std::string forward =
      "attngrad_batches_total{device=\"" + device + "\",mode=\"forward\"} 1";
  const std::string backward =
      "attngrad_batches_total{device=\"" + device + "\",mode=\"return\"} 1";
  const std::string text = HttpGet(server().metrics_port(), "/metrics");
  EXPECT_NE(text.find(forward), std::string::npos) << "missing: " << forward;
  EXPECT_NE(text.find(backward), std::string::npos) << "missing: " << backward;
}

}  // namespace
}  // namespace attngrad::server::testing
