// The server's /metrics scraped by a real Prometheus (Debian's /usr/bin/prometheus, started here on
// loopback with a 1 s scrape interval): the series are queried through Prometheus's HTTP API
// (/api/v1/query) and must show the counts of the batches this test sent; `promtool check metrics`
// must accept the exposition.
#include <filesystem>
#include <fstream>
#include <memory>

#include "attngrad/wire/layer.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "attngrad/client.h"
#include "gtest/gtest.h"
#include "random_tensors.h"
#include "test_support.h"

namespace attngrad {
namespace {

using ::attngrad::testing::HttpGet;
using ::attngrad::testing::PickPort;
using ::attngrad::testing::RunCommand;
using ::attngrad::testing::Subprocess;
using ::attngrad::testing::TempDir;
using ::attngrad::testing::TestServer;
using ::attngrad::testing::UrlEncode;

constexpr char kPrometheus[] = "/usr/bin/prometheus";
constexpr char kPromtool[] = "/usr/bin/promtool";

// The value of an instant query with one sample; NOT_FOUND when the result is empty.
absl::StatusOr<double> QueryValue(int port, const std::string& expression) {
  auto response = HttpGet(port, "/api/v1/query?query=" + UrlEncode(expression));
  if (!response.ok()) return response.status();
  if (response->status != 200) {
    return absl::InternalError(absl::StrCat("HTTP ", response->status, ": ", response->body));
  }
  const std::string& body = response->body;
  if (body.find("\"status\":\"success\"") == std::string::npos) {
    return absl::InternalError(absl::StrCat("query failed: ", body));
  }
  const size_t value = body.find("\"value\":[");
  if (value == std::string::npos) return absl::NotFoundError(absl::StrCat("no sample: ", body));
  const size_t open = body.find('"', body.find(',', value));
  const size_t close = body.find('"', open + 1);
  double number = 0;
  if (open == std::string::npos || close == std::string::npos ||
      !absl::SimpleAtod(body.substr(open + 1, close - open - 1), &number)) {
    return absl::InternalError(absl::StrCat("unparsable sample: ", body));
  }
  return number;
}

TEST(MetricsTest, PrometheusScrapesServerMetricsAndPromtoolAcceptsThem) {
  if (!std::filesystem::exists(kPrometheus) || !std::filesystem::exists(kPromtool)) {
    GTEST_SKIP() << "Debian's prometheus package is not installed";
  }
  auto server = TestServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Client::Connect((*server)->target());
  ASSERT_TRUE(client.ok()) << client.status();
  const LayerConfig config = wire::LayerConfigFromWire((*client)->cached_info().config());
  ASSERT_TRUE((*client)->Zero().ok());

  // 3 RETURN batches of 8 tokens, 2 ACCUMULATE batches of 16 tokens, 1 refused batch.
  for (int i = 0; i < 3; ++i) {
    const BatchInputs inputs = RandomBatchInputs(config, 1, 8, 500 + i);
    auto result = (*client)->Backward(inputs.View());
    ASSERT_TRUE(result.ok()) << result.status();
  }
  for (int i = 0; i < 2; ++i) {
    const BatchInputs inputs = RandomBatchInputs(config, 2, 8, 600 + i);
    BackwardBatch batch = inputs.View();
    batch.mode = v1::GRADIENT_MODE_ACCUMULATE;
    auto result = (*client)->Backward(batch);
    ASSERT_TRUE(result.ok()) << result.status();
  }
  {
    const BatchInputs inputs = RandomBatchInputs(config, 1, 8, 700);
    BackwardBatch batch = inputs.View();
    batch.scaling = std::nanf("");
    auto result = (*client)->Backward(batch);
    ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  }

  // The exposition itself, and promtool's verdict on it.
  TempDir dir;
  auto metrics = HttpGet((*server)->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  ASSERT_EQ(metrics->status, 200);
  for (const char* name :
       {"attngrad_batches_total", "attngrad_tokens_total", "attngrad_batch_duration_seconds_bucket",
        "attngrad_stage_duration_seconds_bucket", "attngrad_rpc_duration_seconds_bucket",
        "attngrad_errors_total", "attngrad_received_bytes_total", "attngrad_sent_bytes_total",
        "attngrad_inflight_batches", "attngrad_queue_depth", "attngrad_weights_version",
        "attngrad_accumulated_batches", "attngrad_build_info"}) {
    EXPECT_NE(metrics->body.find(name), std::string::npos) << name << " missing from /metrics";
  }
  const std::string exposition = dir.path() + "/metrics.txt";
  std::ofstream(exposition) << metrics->body;
  std::string promtool_output;
  EXPECT_EQ(RunCommand({kPromtool, "check", "metrics"}, &promtool_output, exposition), 0)
      << "promtool check metrics:\n"
      << promtool_output;

  // A real Prometheus scraping the server every second.
  const std::string config_path = dir.path() + "/prometheus.yml";
  std::ofstream(config_path) << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                             << "scrape_configs:\n  - job_name: attngrad\n"
                             << "    scrape_interval: 1s\n    static_configs:\n"
                             << "      - targets: ['127.0.0.1:" << (*server)->metrics_port()
                             << "']\n";
  std::unique_ptr<Subprocess> prometheus;
  int prometheus_port = 0;
  for (int attempt = 0; attempt < 5 && prometheus == nullptr; ++attempt) {
    prometheus_port = PickPort();
    auto process = Subprocess::Start(
        {kPrometheus, "--config.file=" + config_path,
         "--storage.tsdb.path=" + dir.path() + "/data-" + std::to_string(attempt),
         absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port), "--log.level=warn"},
        dir.path() + "/prometheus.log");
    ASSERT_TRUE(process.ok()) << process.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    bool ready = false;
    while (!ready && (*process)->Running() && absl::Now() < deadline) {
      auto response = HttpGet(prometheus_port, "/-/ready");
      ready = response.ok() && response->status == 200;
      if (!ready) absl::SleepFor(absl::Milliseconds(200));
    }
    if (ready) prometheus = *std::move(process);
  }
  ASSERT_NE(prometheus, nullptr) << "prometheus did not become ready";

  struct Expectation {
    std::string query;
    double value;
  };
  const std::vector<Expectation> expectations = {
      {"up{job=\"attngrad\"}", 1},
      {"sum(attngrad_batches_total{mode=\"return\"})", 3},
      {"sum(attngrad_batches_total{mode=\"accumulate\"})", 2},
      {"sum(attngrad_tokens_total{mode=\"return\"})", 24},
      {"sum(attngrad_tokens_total{mode=\"accumulate\"})", 32},
      {"sum(attngrad_batch_duration_seconds_count)", 5},
      {"sum(attngrad_stage_duration_seconds_count{stage=\"compute\"})", 5},
      {"sum(attngrad_errors_total{code=\"INVALID_ARGUMENT\"})", 1},
      {"sum(attngrad_accumulated_batches)", 2},
      {"sum(attngrad_accumulated_tokens)", 32},
      {"sum(attngrad_inflight_batches)", 0},
      {"count(attngrad_build_info)", 1},
  };
  for (const Expectation& e : expectations) {
    absl::StatusOr<double> value = absl::NotFoundError("not queried");
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      value = QueryValue(prometheus_port, e.query);
      if (value.ok() && *value == e.value) break;
      absl::SleepFor(absl::Milliseconds(500));
    }
    ASSERT_TRUE(value.ok()) << e.query << ": " << value.status() << "\nprometheus log:\n"
                            << prometheus->LogTail();
    EXPECT_EQ(*value, e.value) << e.query;
  }
  // Histograms have buckets Prometheus can compute quantiles from.
  auto p50 =
      QueryValue(prometheus_port,
                 "histogram_quantile(0.5, sum by (le) (attngrad_batch_duration_seconds_bucket))");
  ASSERT_TRUE(p50.ok()) << p50.status();
  EXPECT_GT(*p50, 0);
}

}  // namespace
}  // namespace attngrad
