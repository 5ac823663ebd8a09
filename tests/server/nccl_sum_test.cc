// The cross-GPU gradient sum with NCCL: the server in-process on GPUs 0 and 1 with --nccl=on,
// ACCUMULATE batches spread over both devices, FetchGradients against the sum of the same batches'
// RETURN gradients, the fetch deterministic, fetch-and-zero, and the NCCL path reported. Label gpu:
// skips without two GPUs or without a loadable libnccl.so.2 (run it with
// scripts/device/nccl-check.sh on a 2-GPU machine).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "devices/nccl_library.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

// The value of the sample `series` (name{labels}) in a scrape, 0 when absent.
double Sample(const std::string& text, const std::string& series) {
  const std::size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return 0;
  return std::strtod(text.c_str() + at + series.size() + 2, nullptr);
}

class ServerNcclSumTest : public ServerTest {
 protected:
  void SetUp() override {
    // NVLink multicast stays off (shared GPU hosts; ncclReduce does not use it).
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    const int gpus = DeviceCount();
    if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs; this machine has " << gpus;
    absl::StatusOr<std::unique_ptr<NcclLibrary>> nccl = NcclLibrary::Load();
    if (!nccl.ok()) GTEST_SKIP() << "NCCL is not usable here: " << nccl.status();
    ServerTest::SetUp();
  }

  void Customize(ServerOptions& options) override {
    options.devices = "0,1";
    options.nccl = "on";  // fail at start rather than silently sum on the host
  }

  // Sends `batches` (ids first_id, first_id+1, ...) in `mode` over `streams` concurrent streams.
  std::vector<v1::BackwardResponse> Send(const std::vector<Batch>& batches, std::uint64_t first_id,
                                         v1::GradientMode mode, int streams) {
    std::vector<std::vector<v1::BackwardRequest>> requests(static_cast<std::size_t>(streams));
    for (std::size_t i = 0; i < batches.size(); ++i) {
      requests[i % streams].push_back(MakeRequest(config(), batches[i], first_id + i, mode));
    }
    std::vector<std::vector<v1::BackwardResponse>> responses(requests.size());
    std::vector<std::thread> threads;
    for (std::size_t s = 0; s < requests.size(); ++s) {
      threads.emplace_back([&, s] {
        auto stub = NewStub();
        responses[s] = RunStream(*stub, requests[s]);
      });
    }
    for (std::thread& thread : threads) thread.join();
    std::vector<v1::BackwardResponse> all;
    for (auto& stream : responses) all.insert(all.end(), stream.begin(), stream.end());
    return all;
  }

  Fetched FetchAll(bool zero) {
    v1::FetchGradientsRequest request;
    request.set_zero_after_fetch(zero);
    request.set_dtype(v1::DTYPE_FLOAT32);
    return Fetch(stub(), request);
  }
};

TEST_F(ServerNcclSumTest, FetchSumsBothDevicesWithNccl) {
  ASSERT_TRUE(server().uses_nccl()) << server().gradient_sum();
  EXPECT_FALSE(server().nccl_version().empty());
  std::cerr << "server: " << server().gradient_sum() << "\n";

  // ACCUMULATE rounds of 8 batches over 4 concurrent streams until both devices have taken some
  // (the scheduler sends each batch to the least busy device).
  const std::string on0 = "attngrad_batches_total{device=\"cuda:0\",mode=\"accumulate\"}";
  const std::string on1 = "attngrad_batches_total{device=\"cuda:1\",mode=\"accumulate\"}";
  std::vector<Batch> batches;
  std::string metrics;
  for (int round = 0; round < 6; ++round) {
    std::vector<Batch> more;
    for (int i = 0; i < 8; ++i) {
      more.push_back(MakeBatch(config(), 2, 96 + 16 * (i % 3), 7000 + batches.size() + i));
    }
    for (const v1::BackwardResponse& response :
         Send(more, batches.size(), v1::GRADIENT_MODE_ACCUMULATE, 4)) {
      ASSERT_FALSE(response.has_error()) << response.error().message();
      EXPECT_FALSE(response.duplicate());
    }
    batches.insert(batches.end(), more.begin(), more.end());
    metrics = HttpGet(server().metrics_port(), "/metrics");
    if (Sample(metrics, on0) > 0 && Sample(metrics, on1) > 0) break;
  }
  ASSERT_GT(Sample(metrics, on0), 0) << metrics;
  ASSERT_GT(Sample(metrics, on1), 0) << metrics;
  std::cerr << "accumulate batches: cuda:0 " << Sample(metrics, on0) << ", cuda:1 "
            << Sample(metrics, on1) << "\n";
  EXPECT_NE(metrics.find("attngrad_gradient_sum_info{nccl_version=\"" + server().nccl_version() +
                         "\",path=\"nccl\"} 1"),
            std::string::npos)
      << metrics;

  // The reference: the same batches in RETURN mode through the server, summed here in double
  // (eight at a time: each response carries all six weight gradients, ~100 MB).
  PerWeight<std::vector<double>> expected;
  long long tokens = 0;
  for (std::size_t start = 0; start < batches.size(); start += 8) {
    const std::vector<Batch> group(batches.begin() + start,
                                   batches.begin() + std::min(batches.size(), start + 8));
    const std::vector<v1::BackwardResponse> returned =
        Send(group, 100000 + start, v1::GRADIENT_MODE_RETURN, 4);
    ASSERT_EQ(returned.size(), group.size());
    for (const v1::BackwardResponse& response : returned) {
      ASSERT_FALSE(response.has_error()) << response.error().message();
      const LayerTensors gradients = ResponseWeightGradients(response);
      for (Weight w : kAllWeights) {
        expected[w].resize(gradients[w].size(), 0.0);
        for (std::size_t j = 0; j < gradients[w].size(); ++j) {
          expected[w][j] += gradients[w][j];
        }
      }
    }
  }
  LayerTensors reference;
  for (Weight w : kAllWeights) reference[w].assign(expected[w].begin(), expected[w].end());
  for (const Batch& batch : batches) tokens += static_cast<long long>(batch.batch) * batch.seq_len;

  const Fetched first = FetchAll(/*zero=*/false);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.state.batches(), static_cast<long long>(batches.size()));
  EXPECT_EQ(first.state.tokens(), tokens);
  // Equal up to the order of fp32 additions (per batch in the kernels vs. over devices in NCCL).
  EXPECT_TRUE(Close(first.gradients, reference, 1e-3, "NCCL-summed accumulators"));
  // SPEC section 4 style: at least 99% of each gradient's elements within 1e-3 relative of the
  // reference plus a small absolute term (here relative to the tensor's largest value).
  for (Weight w : kAllWeights) {
    const std::vector<float>& got = first.gradients[w];
    ASSERT_EQ(got.size(), reference[w].size());
    double scale = 0;
    for (float value : reference[w]) scale = std::max(scale, std::fabs(double(value)));
    std::size_t misses = 0;
    for (std::size_t j = 0; j < got.size(); ++j) {
      const double ref = reference[w][j];
      if (!(std::fabs(got[j] - ref) <= 1e-5 * scale + 1e-3 * std::fabs(ref))) ++misses;
    }
    EXPECT_LE(misses, got.size() / 100)
        << WeightModuleName(w) << ": " << misses << " of " << got.size() << " elements off";
  }

  // Deterministic: the same accumulators give a bit-equal sum.
  const Fetched second = FetchAll(/*zero=*/true);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.state.window_id(), first.state.window_id());
  for (Weight w : kAllWeights) {
    ASSERT_EQ(second.gradients[w].size(), first.gradients[w].size());
    EXPECT_EQ(std::memcmp(second.gradients[w].data(), first.gradients[w].data(),
                          first.gradients[w].size() * sizeof(float)),
              0)
        << WeightModuleName(w) << " differs between two fetches of the same accumulators";
  }

  // Fetch-and-zero cleared both devices: a new window, all zeros.
  const Fetched after = FetchAll(/*zero=*/false);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_NE(after.state.window_id(), first.state.window_id());
  EXPECT_EQ(after.state.batches(), 0);
  EXPECT_EQ(after.state.tokens(), 0);
  for (Weight w : kAllWeights) {
    for (float value : after.gradients[w]) ASSERT_EQ(value, 0.f) << WeightModuleName(w);
  }

  // And accumulating again after the zero works: one batch, equal to its RETURN gradients.
  const std::vector<Batch> one = {MakeBatch(config(), 1, 64, 7777)};
  const std::vector<v1::BackwardResponse> accumulated =
      Send(one, 200000, v1::GRADIENT_MODE_ACCUMULATE, 1);
  ASSERT_EQ(accumulated.size(), 1u);
  ASSERT_FALSE(accumulated.front().has_error()) << accumulated.front().error().message();
  const std::vector<v1::BackwardResponse> returned = Send(one, 200001, v1::GRADIENT_MODE_RETURN, 1);
  ASSERT_EQ(returned.size(), 1u);
  const v1::BackwardResponse& single = returned.front();
  ASSERT_FALSE(single.has_error()) << single.error().message();
  const Fetched again = FetchAll(/*zero=*/true);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.state.batches(), 1);
  EXPECT_TRUE(Close(again.gradients, ResponseWeightGradients(single), 1e-3, "one batch"));
}

}  // namespace
}  // namespace attngrad::server::testing
