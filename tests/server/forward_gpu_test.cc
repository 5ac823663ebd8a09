// FORWARD batches on the GPU worker (server/devices/gpu_worker.cc, ForwardDevice with the layer's
// prepared weights): the answer's `output` against attngrad::ForwardHost (the CPU result) on the
// same inputs under SPEC section 4's bar (every value finite, at least 99% of them within
// atol + 1e-3·|ref|) in every precision mode, with a 16-bit answer's rounding added to the bar;
// repeated batches give the same bits; forward and backward batches interleaved on one stream are
// each answered right; a host shared-memory output_region gets the bytes path's bits; a non-finite
// output is refused naming `output`. Label gpu: skips without a GPU.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/shared_memory_region.h"
#include "attngrad/wire/dtype.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

class ServerForwardGpuTest : public ServerTest {
 protected:
  void SetUp() override {
    if (DeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
    ServerTest::SetUp();
  }
  void Customize(ServerOptions& options) override { options.devices = "0"; }
};

// SPEC section 4's atol of a workload (B, S); .0067 for shapes outside its list.
double SpecAtol(int batch, int seq_len) {
  if (batch == 2 && seq_len == 541) return 0.0079;
  if (batch == 4 && seq_len == 256) return 0.0077;
  if (batch == 8 && seq_len == 128) return 0.0091;
  return 0.0067;
}

// SPEC section 4's rule for one output against `reference`: every value finite and at least 99%
// of them with |got - ref| <= atol + rtol·|ref| (rtol 1e-3, plus a 16-bit answer's rounding).
::testing::AssertionResult MeetsSpecBar(const std::vector<float>& got,
                                        const std::vector<float>& reference, double atol,
                                        double rtol, const std::string& what) {
  if (got.size() != reference.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " values, expected " << reference.size();
  }
  std::size_t misses = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      return ::testing::AssertionFailure() << what << ": value " << i << " is " << got[i];
    }
    const double error = std::fabs(static_cast<double>(got[i]) - reference[i]);
    worst = std::max(worst, error);
    if (error > atol + rtol * std::fabs(reference[i])) ++misses;
  }
  if (misses * 100 > got.size()) {
    return ::testing::AssertionFailure() << what << ": " << misses << " of " << got.size()
                                         << " values miss the bar (largest error " << worst << ")";
  }
  return ::testing::AssertionSuccess();
}

TEST_F(ServerForwardGpuTest, OutputMeetsTheSpecBarAgainstForwardHostInEveryMode) {
  const std::pair<int, int> workloads[] = {{1, 128}, {2, 541}, {4, 256}};
  const v1::Precision precisions[] = {v1::PRECISION_AUTO, v1::PRECISION_FP16, v1::PRECISION_TF32,
                                      v1::PRECISION_FP32};
  std::uint64_t batch_id = 1;
  for (const auto& [b, s] : workloads) {
    const Batch batch = MakeBatch(config(), b, s, 900 + b * 1000 + s);
    const std::vector<float> expected = ForwardReference(weights(), batch);
    for (v1::Precision precision : precisions) {
      const std::string what = absl::StrCat("(", b, ",", s, ") ", v1::Precision_Name(precision));
      v1::BackwardRequest request = MakeForwardRequest(config(), batch, batch_id++);
      request.set_precision(precision);
      const v1::BackwardResponse response = RunOne(stub(), request);
      ASSERT_FALSE(response.has_error()) << what << ": " << response.error().message();
      EXPECT_EQ(response.device(), "cuda:0");
      EXPECT_FALSE(response.has_grad_hidden_states());
      const std::vector<float> output = ToFloats(response.output());
      EXPECT_TRUE(MeetsSpecBar(output, expected, SpecAtol(b, s), 1e-3, what));
      // The same batch again (the kernels' cached graph, the slot's buffers reused): same bits.
      request.set_batch_id(batch_id++);
      const v1::BackwardResponse again = RunOne(stub(), request);
      ASSERT_FALSE(again.has_error()) << what << ": " << again.error().message();
      EXPECT_EQ(again.output().raw_data(), response.output().raw_data()) << what << ": repeated";
    }
  }
}

TEST_F(ServerForwardGpuTest, SixteenBitAnswersMeetTheBarWithTheirRounding) {
  const Batch batch = MakeBatch(config(), 2, 256, 910);
  const std::vector<float> expected = ForwardReference(weights(), batch);
  for (v1::DType dtype : {v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16}) {
    v1::BackwardRequest request = MakeForwardRequest(config(), batch, 10 + dtype);
    request.set_precision(v1::PRECISION_AUTO);
    request.set_response_dtype(dtype);
    const v1::BackwardResponse response = RunOne(stub(), request);
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_EQ(response.output().dtype(), dtype);
    const double rounding =
        dtype == v1::DTYPE_BFLOAT16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    EXPECT_TRUE(MeetsSpecBar(ToFloats(response.output()), expected, SpecAtol(2, 256),
                             1e-3 + rounding, wire::DTypeName(dtype)));
  }
}

TEST_F(ServerForwardGpuTest, InterleavedWithBackwardBatchesOnOneStream) {
  std::vector<Batch> batches;
  std::vector<v1::BackwardRequest> requests;
  for (int i = 0; i < 8; ++i) {
    batches.push_back(MakeBatch(config(), 1, 128 + 64 * (i % 3), 920 + i));
    v1::BackwardRequest request =
        i % 2 == 0 ? MakeForwardRequest(config(), batches.back(), 100 + i)
                   : MakeRequest(config(), batches.back(), 100 + i, v1::GRADIENT_MODE_ACCUMULATE);
    request.set_precision(v1::PRECISION_AUTO);
    requests.push_back(request);
  }
  const std::vector<v1::BackwardResponse> responses = RunStream(stub(), requests);
  ASSERT_EQ(responses.size(), requests.size());
  for (const v1::BackwardResponse& response : responses) {
    ASSERT_FALSE(response.has_error()) << response.error().message();
    const std::size_t index = response.batch_id() - 100;
    ASSERT_LT(index, batches.size());
    const std::string what = absl::StrCat("batch ", index);
    if (index % 2 == 0) {
      EXPECT_TRUE(MeetsSpecBar(ToFloats(response.output()),
                               ForwardReference(weights(), batches[index]), 0.0067, 1e-3,
                               what + " output"));
    } else {
      EXPECT_TRUE(MeetsSpecBar(ToFloats(response.grad_hidden_states()),
                               Reference(weights(), batches[index]).grad_hidden_states, 0.0067,
                               1e-3, what + " grad_hidden_states"));
    }
  }
  const Fetched fetched = Fetch(stub(), v1::FetchGradientsRequest());
  ASSERT_TRUE(fetched.status.ok()) << fetched.status.error_message();
  EXPECT_EQ(fetched.state.batches(), 4);  // the backward ones only
}

TEST_F(ServerForwardGpuTest, OutputGoesIntoAHostRegionWithTheBitsOfTheBytesPath) {
  const Batch batch = MakeBatch(config(), 1, 128, 930);
  const v1::BackwardRequest bytes_request = MakeForwardRequest(config(), batch, 1);
  const v1::BackwardResponse expected = RunOne(stub(), bytes_request);
  ASSERT_FALSE(expected.has_error()) << expected.error().message();
  const std::size_t bytes = batch.hidden_states.size() * sizeof(float);
  absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> memory = SharedMemoryRegion::Create(bytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  absl::StatusOr<std::uint64_t> region = RegisterRegionDescriptor(
      server().region_socket_path(), (*memory)->fd(), static_cast<std::int64_t>(bytes), {});
  ASSERT_TRUE(region.ok()) << region.status();
  v1::BackwardRequest request = bytes_request;
  request.set_batch_id(2);
  request.mutable_output_region()->set_region_id(*region);
  request.mutable_output_region()->set_byte_size(static_cast<std::int64_t>(bytes));
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_TRUE(response.output().raw_data().empty());
  EXPECT_EQ(std::memcmp((*memory)->data(), expected.output().raw_data().data(), bytes), 0);
}

TEST_F(ServerForwardGpuTest, NonFiniteOutputIsRefusedNamingOutput) {
  Batch batch = MakeBatch(config(), 1, 128, 940);
  for (float& value : batch.hidden_states) value = 3e38f;  // finite; X Wᵀ overflows fp32
  v1::BackwardRequest request = MakeForwardRequest(config(), batch, 1);
  request.set_precision(v1::PRECISION_FP32);
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_TRUE(response.has_error());
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(response.error().message().rfind("output", 0), 0u) << response.error().message();
  // The worker goes on.
  const v1::BackwardResponse next =
      RunOne(stub(), MakeForwardRequest(config(), MakeBatch(config(), 1, 64, 941), 2));
  EXPECT_FALSE(next.has_error()) << next.error().message();
}

}  // namespace
}  // namespace attngrad::server::testing
