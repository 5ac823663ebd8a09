// Sums that stay finite, through the server: a batch whose inputs are finite but whose gradients
// are not (grad_output = 3e38 overflows fp32 in the backward GEMMs) is answered in-band with
// INVALID_ARGUMENT naming the non-finite gradients and is not added to the window (its batch id
// stays free for a retry); so is a batch whose finite gradients would overflow the window's sums,
// which stay finite and exact; RETURN and duplicate batches are checked too; rope_theta = 5e-324
// and a position id of INT64_MIN are refused before any compute. The same body runs on the CPU
// backend (attngrad_server_test, or the GPU workers with ATTNGRAD_TEST_DEVICES) and, built with
// ATTNGRAD_FINITE_SUMS_ON_GPU, on GPU 0 (attngrad_server_gpu_test, label gpu: skips without a GPU).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

bool AllFinite(const LayerTensors& tensors) {
  for (const std::vector<float>& tensor : tensors) {
    for (float value : tensor) {
      if (!std::isfinite(value)) return false;
    }
  }
  return true;
}

// The GPU build's suite has its own name (ctest test names are unique).
#ifdef ATTNGRAD_FINITE_SUMS_ON_GPU
#define ATTNGRAD_FINITE_SUMS_SUITE ServerFiniteSumsGpuTest
#else
#define ATTNGRAD_FINITE_SUMS_SUITE ServerFiniteSumsTest
#endif

class ATTNGRAD_FINITE_SUMS_SUITE : public ServerTest {
 protected:
  void SetUp() override {
#ifdef ATTNGRAD_FINITE_SUMS_ON_GPU
    if (DeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
#endif
    ServerTest::SetUp();
  }

  void Customize(ServerOptions& options) override {
#ifdef ATTNGRAD_FINITE_SUMS_ON_GPU
    options.devices = "0";
#else
    (void)options;
#endif
  }

  bool OnGpu() const {
#ifdef ATTNGRAD_FINITE_SUMS_ON_GPU
    return true;
#else
    return TestOnGpu();
#endif
  }

  // A batch whose grad_output is 3e38 everywhere: finite, accepted by the parser, but the backward
  // pass overflows.
  Batch OverflowingBatch(std::uint64_t seed) {
    Batch batch = MakeBatch(config(), 1, 3, seed);
    for (float& value : batch.grad_output) value = 3e38f;
    return batch;
  }

  Fetched FetchWindow() {
    v1::FetchGradientsRequest request;
    request.set_dtype(v1::DTYPE_FLOAT32);
    return Fetch(stub(), request);
  }

  // The window holds exactly `good` (one batch): its sums equal the batch's reference, finite.
  void ExpectWindowHoldsOnly(const Batch& good, const std::string& when) {
    const Fetched fetched = FetchWindow();
    ASSERT_TRUE(fetched.status.ok()) << when << ": " << fetched.status.error_message();
    EXPECT_EQ(fetched.state.batches(), 1) << when;
    EXPECT_EQ(fetched.state.tokens(), 3) << when;
    EXPECT_TRUE(AllFinite(fetched.gradients)) << when << ": the window holds Inf or NaN";
    EXPECT_TRUE(
        Close(fetched.gradients, Reference(weights(), good).weights, OnGpu() ? 1e-3 : 1e-5, when));
  }
};

void ExpectNonFiniteError(const v1::BackwardResponse& response, const std::string& what) {
  ASSERT_TRUE(response.has_error()) << what << ": answered without an error";
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)) << what;
  const std::string& message = response.error().message();
  EXPECT_NE(message.find("not finite"), std::string::npos) << what << ": " << message;
  EXPECT_NE(message.find("grad_hidden_states"), std::string::npos) << what << ": " << message;
  EXPECT_NE(message.find("q_proj"), std::string::npos) << what << ": " << message;
  EXPECT_EQ(response.grad_hidden_states().raw_data().size(), 0u) << what;
}

TEST_F(ATTNGRAD_FINITE_SUMS_SUITE, OverflowingBatchIsRefusedAndNotAccumulated) {
  const Batch good = MakeBatch(config(), 1, 3, 41);
  const Batch overflowing = OverflowingBatch(42);
  const std::vector<v1::BackwardResponse> responses =
      RunStream(stub(), {MakeRequest(config(), good, 1, v1::GRADIENT_MODE_ACCUMULATE),
                         MakeRequest(config(), overflowing, 2, v1::GRADIENT_MODE_ACCUMULATE)});
  ASSERT_EQ(responses.size(), 2u);
  for (const v1::BackwardResponse& response : responses) {
    if (response.batch_id() == 1) {
      EXPECT_FALSE(response.has_error()) << response.error().message();
    } else {
      ExpectNonFiniteError(response, "ACCUMULATE of grad_output = 3e38");
    }
  }
  ExpectWindowHoldsOnly(good, "after the overflowing batch");

  // Its batch id was not taken: the retry with sane data counts.
  const Batch retry = MakeBatch(config(), 1, 3, 43);
  const v1::BackwardResponse retried =
      RunOne(stub(), MakeRequest(config(), retry, 2, v1::GRADIENT_MODE_ACCUMULATE));
  ASSERT_FALSE(retried.has_error()) << retried.error().message();
  EXPECT_FALSE(retried.duplicate());
  const Fetched fetched = FetchWindow();
  ASSERT_TRUE(fetched.status.ok());
  EXPECT_EQ(fetched.state.batches(), 2);
  EXPECT_TRUE(AllFinite(fetched.gradients));
}

// Finite batches whose sum overflows: grad_output is scaled (to about 1e38, finite) so that the
// largest weight gradient of one batch is FLT_MAX / 20.5; twenty copies of the batch add up to
// 0.98 FLT_MAX, the 21st would make the window's sum infinite. It and the 22nd are refused, naming
// the sums they would overflow; the window keeps exactly twenty batches, finite; a later batch
// that fits is still added.
TEST_F(ATTNGRAD_FINITE_SUMS_SUITE, BatchesWhoseSumWouldOverflowAreRefusedAndTheSumsStayFinite) {
  constexpr int kFitting = 20;
  Batch big = MakeBatch(config(), 1, 3, 61);
  double largest = 0;
  for (const std::vector<float>& gradient : Reference(weights(), big).weights) {
    for (float value : gradient) largest = std::max(largest, std::fabs(static_cast<double>(value)));
  }
  const double scale = std::numeric_limits<float>::max() / ((kFitting + 0.5) * largest);
  for (float& value : big.grad_output) value = static_cast<float>(value * scale);
  std::vector<v1::BackwardRequest> requests;
  for (std::uint64_t id = 1; id <= kFitting + 2; ++id) {
    requests.push_back(MakeRequest(config(), big, id, v1::GRADIENT_MODE_ACCUMULATE));
    requests.back().set_precision(v1::PRECISION_FP32);
  }
  for (const v1::BackwardResponse& response : RunStream(stub(), requests)) {
    if (response.batch_id() <= kFitting) {
      EXPECT_FALSE(response.has_error())
          << response.batch_id() << ": " << response.error().message();
      continue;
    }
    ASSERT_TRUE(response.has_error()) << response.batch_id() << " overflowed the sums";
    EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    EXPECT_NE(response.error().message().find("overflow the window"), std::string::npos)
        << response.error().message();
  }
  const Fetched fetched = FetchWindow();
  ASSERT_TRUE(fetched.status.ok()) << fetched.status.error_message();
  EXPECT_EQ(fetched.state.batches(), kFitting);
  EXPECT_TRUE(AllFinite(fetched.gradients)) << "the window holds Inf or NaN";
  const Batch small = MakeBatch(config(), 1, 3, 62);
  EXPECT_FALSE(
      RunOne(stub(), MakeRequest(config(), small, 100, v1::GRADIENT_MODE_ACCUMULATE)).has_error());
  EXPECT_EQ(FetchWindow().state.batches(), kFitting + 1);
}

TEST_F(ATTNGRAD_FINITE_SUMS_SUITE, OverflowingReturnAndDuplicateBatchesAreRefused) {
  const Batch good = MakeBatch(config(), 1, 3, 51);
  ASSERT_FALSE(
      RunOne(stub(), MakeRequest(config(), good, 7, v1::GRADIENT_MODE_ACCUMULATE)).has_error());
  ExpectNonFiniteError(
      RunOne(stub(), MakeRequest(config(), OverflowingBatch(52), 8, v1::GRADIENT_MODE_RETURN)),
      "RETURN of grad_output = 3e38");
  // Batch id 7 again (a duplicate: computed, answered, never added) with overflowing data.
  ExpectNonFiniteError(
      RunOne(stub(), MakeRequest(config(), OverflowingBatch(53), 7, v1::GRADIENT_MODE_ACCUMULATE)),
      "duplicate ACCUMULATE of grad_output = 3e38");
  ExpectWindowHoldsOnly(good, "after the overflowing RETURN and duplicate");
}

TEST_F(ATTNGRAD_FINITE_SUMS_SUITE, RotaryInputsThatOverflowAreRefusedUpFront) {
  const Batch good = MakeBatch(config(), 1, 3, 61);
  ASSERT_FALSE(
      RunOne(stub(), MakeRequest(config(), good, 1, v1::GRADIENT_MODE_ACCUMULATE)).has_error());
  struct Case {
    std::string what, field;
    std::int64_t last_position;
    double theta;
  };
  const std::int64_t lowest = std::numeric_limits<std::int64_t>::min();
  for (const Case& spoil : {Case{"rope_theta = 5e-324", "rope_theta", 2, 5e-324},
                            Case{"position INT64_MIN", "position_ids", lowest, 0.0}}) {
    v1::BackwardRequest request =
        MakeRequest(config(), MakeBatch(config(), 1, 3, 62), 2, v1::GRADIENT_MODE_ACCUMULATE);
    request.clear_rotary_tables();
    for (std::int64_t position : {std::int64_t{0}, std::int64_t{1}, spoil.last_position}) {
      request.mutable_positions()->add_position_ids(position);
    }
    request.mutable_positions()->set_rope_theta(spoil.theta);
    const v1::BackwardResponse response = RunOne(stub(), request);
    ASSERT_TRUE(response.has_error()) << spoil.what << ": accepted";
    EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT))
        << spoil.what;
    EXPECT_NE(response.error().message().find(spoil.field), std::string::npos)
        << spoil.what << ": " << response.error().message();
  }
  ExpectWindowHoldsOnly(good, "after the rotary inputs");
}

}  // namespace
}  // namespace attngrad::server::testing
