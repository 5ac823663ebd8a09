// Soak and chaos: attngrad-server as a child process (CPU backend by default) while
// - trainers (each its own client id, so its own accumulation window) stream rounds of ACCUMULATE
//   batches and a RETURN batch; a quarter of their streams are cancelled abruptly mid-stream, and
//   the batches not yet answered are retried on a new stream (a batch the server had already taken
//   answers `duplicate`), so every batch of a round is acknowledged once;
// - an admin replaces the weights (LoadWeights) every few seconds, alternating two sets B and C
//   (version v holds B when even, C when odd), so trainers meet FAILED_PRECONDITION for windows of
//   the old version, fetch-and-zero them and resend;
// - attngrad-cli processes streaming RETURN batches are SIGKILLed mid-stream;
// - at the end a SIGTERM arrives with streams open.
// Checked: after every round each trainer fetches-and-zeroes its window, whose batch count must
// equal the batches acknowledged into it and whose sums must equal the sum of those batches'
// gradients (each input is one of three contents whose gradients under B and C were computed by
// RETURN requests first), so a batch counted twice or lost fails; every RETURN answer equals its
// content's gradients under the version it reports; nothing is NaN or infinite; no unexpected
// error; the server's RSS (/proc/PID/status VmRSS, sampled every second) does not grow after the
// warm-up beyond max(64 MiB, 25 %); the server exits 0 within the grace period + 1.5 s.
//
// Environment (scripts/soak.sh sets them for long runs): ATTNGRAD_SOAK_SECONDS (60),
// ATTNGRAD_SOAK_DEVICES (cpu), ATTNGRAD_SOAK_MODEL (gemma-3-270m; "spec" for the SPEC layer, which
// the GPU kernels serve), ATTNGRAD_SOAK_TRAINERS (3), ATTNGRAD_SOAK_VICTIMS (1 at a time; 0 =
// none), ATTNGRAD_SOAK_BATCHES (6 ACCUMULATE batches per round), ATTNGRAD_SOAK_SEQ_LEN (8),
// ATTNGRAD_SOAK_PAUSE_MS (0, between a trainer's rounds), ATTNGRAD_SOAK_CPU_THREADS (2),
// ATTNGRAD_SOAK_CSV (a file: one line per sample, seconds,rss_kib,acknowledged,windows,errors).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "child_process.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

constexpr int kContents = 3;  // distinct batch inputs; batch id i carries content i % kContents

std::string Environment(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value == nullptr || *value == '\0' ? fallback : value;
}
int EnvironmentInt(const char* name, int fallback) {
  return std::stoi(Environment(name, std::to_string(fallback)));
}

struct SoakSettings {
  double seconds = EnvironmentInt("ATTNGRAD_SOAK_SECONDS", 60);
  std::string devices = Environment("ATTNGRAD_SOAK_DEVICES", "cpu");
  std::string model = Environment("ATTNGRAD_SOAK_MODEL", "gemma-3-270m");
  int trainers = EnvironmentInt("ATTNGRAD_SOAK_TRAINERS", 3);
  int victims = EnvironmentInt("ATTNGRAD_SOAK_VICTIMS", 1);
  int batches_per_round = EnvironmentInt("ATTNGRAD_SOAK_BATCHES", 6);
  int seq_len = EnvironmentInt("ATTNGRAD_SOAK_SEQ_LEN", 8);
  int pause_ms = EnvironmentInt("ATTNGRAD_SOAK_PAUSE_MS", 0);
  int cpu_threads = EnvironmentInt("ATTNGRAD_SOAK_CPU_THREADS", 2);
  std::string csv = Environment("ATTNGRAD_SOAK_CSV", "");
};

long long RssKib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return 0;
}

bool AllFinite(const LayerTensors& tensors) {
  for (const std::vector<float>& tensor : tensors) {
    for (float value : tensor) {
      if (!std::isfinite(value)) return false;
    }
  }
  return true;
}

std::shared_ptr<grpc::Channel> Connect(int port) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), arguments);
}

class SoakTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (ServerBinary().empty()) GTEST_SKIP() << "built without ATTNGRAD_SERVER_BINARY";
    if (settings_.devices != "cpu" && DeviceCount() == 0) GTEST_SKIP() << "no GPU";
  }

  // One of the kContents inputs as a request (position ids 0..S-1, the layer's RoPE base).
  v1::BackwardRequest Request(int content, std::uint64_t batch_id, v1::GradientMode mode) const {
    const std::vector<float>& hidden = hidden_states_[static_cast<std::size_t>(content)];
    const std::vector<float>& grad = grad_outputs_[static_cast<std::size_t>(content)];
    const std::vector<std::int64_t> shape = {1, settings_.seq_len, config_.hidden_size};
    v1::BackwardRequest request;
    request.set_batch_id(batch_id);
    request.set_mode(mode);
    *request.mutable_hidden_states() = wire::MakeTensor(hidden, shape);
    *request.mutable_grad_output() = wire::MakeTensor(grad, shape);
    for (int position = 0; position < settings_.seq_len; ++position) {
      request.mutable_positions()->add_position_ids(position);
    }
    return request;
  }

  void MakeContents() {
    const std::size_t elements = static_cast<std::size_t>(settings_.seq_len) * config_.hidden_size;
    for (int content = 0; content < kContents; ++content) {
      std::mt19937 random(1000 + content);
      std::normal_distribution<float> normal(0.f, 1.f);
      hidden_states_.emplace_back(elements);
      grad_outputs_.emplace_back(elements);
      for (float& value : hidden_states_.back()) value = normal(random);
      for (float& value : grad_outputs_.back()) value = normal(random) * (1.f + content);
    }
  }

  // Replaces the weights; returns the new version (0 on failure, with a test failure).
  std::uint64_t Load(v1::AttentionGradient::Stub& stub, const LayerWeights& weights) {
    grpc::ClientContext context;
    v1::LoadWeightsResponse response;
    auto writer = stub.LoadWeights(&context, &response);
    for (Weight weight : kAllWeights) {
      v1::LoadWeightsRequest chunk;
      chunk.set_name(wire::WireWeightName(weight));
      chunk.set_dtype(v1::DTYPE_FLOAT32);
      for (std::int64_t dimension : WeightShape(config_, weight)) chunk.add_shape(dimension);
      wire::EncodeFromFloat(weights.values[weight], v1::DTYPE_FLOAT32, chunk.mutable_data());
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_TRUE(status.ok()) << "LoadWeights: " << status.error_message();
    return status.ok() ? response.weights_version() : 0;
  }

  // The weight gradients of `content` under the current weights (one RETURN request).
  LayerTensors ReturnGradients(v1::AttentionGradient::Stub& stub, int content,
                               std::uint64_t expected_version) {
    v1::BackwardRequest request = Request(content, 1, v1::GRADIENT_MODE_RETURN);
    request.set_expected_weights_version(expected_version);
    const v1::BackwardResponse response = RunOne(stub, request);
    EXPECT_FALSE(response.has_error()) << response.error().message();
    return ResponseWeightGradients(response);
  }

  const LayerTensors& Expected(std::uint64_t version, int content) const {
    return expected_[version % 2][static_cast<std::size_t>(content)];
  }

  double Tolerance() const { return settings_.devices == "cpu" ? 1e-5 : 1e-3; }

  SoakSettings settings_;
  LayerConfig config_;
  std::vector<std::vector<float>> hidden_states_, grad_outputs_;
  // expected_[version % 2][content]: 0 = weights B (even versions), 1 = C (odd versions).
  std::vector<LayerTensors> expected_[2];

  std::atomic<bool> stop_{false};
  std::atomic<long long> acknowledged_{0};  // ACCUMULATE batches verified in fetched windows
  std::atomic<long long> windows_{0};       // windows fetched and verified
  std::atomic<long long> cancelled_streams_{0};
  std::atomic<long long> refused_for_weights_{0};
  std::atomic<long long> returns_checked_{0};
  std::atomic<long long> weight_loads_{0};
  std::atomic<long long> victims_killed_{0};
  std::mutex errors_mutex_;
  std::vector<std::string> unexpected_errors_;

  void Unexpected(const std::string& what) {
    std::lock_guard<std::mutex> lock(errors_mutex_);
    if (unexpected_errors_.size() < 20) {
      unexpected_errors_.push_back(what);
    } else {
      unexpected_errors_.back() = "... and more";
    }
  }
  long long UnexpectedCount() {
    std::lock_guard<std::mutex> lock(errors_mutex_);
    return static_cast<long long>(unexpected_errors_.size());
  }

  void Trainer(int port, int index);
  void Admin(int port, const LayerWeights& b, const LayerWeights& c, std::uint64_t version);
  void Victims(int port);
};

// One trainer: rounds of batches on its own window, each round verified by a fetch-and-zero.
void SoakTest::Trainer(int port, int index) {
  const std::string client_id = absl::StrCat("trainer-", index);
  auto stub = v1::AttentionGradient::NewStub(Connect(port));
  std::mt19937 random(77 + index);
  std::uint64_t next_id = 1;
  std::map<std::uint64_t, int> window;  // batch id -> content, acknowledged into the window

  auto fetch_and_verify = [&] {
    v1::FetchGradientsRequest request;
    request.set_zero_after_fetch(true);
    request.set_dtype(v1::DTYPE_FLOAT32);
    const Fetched fetched = Fetch(*stub, request, client_id);
    if (!fetched.status.ok()) {
      Unexpected(absl::StrCat(client_id, " fetch: ", fetched.status.error_message()));
      return;
    }
    EXPECT_EQ(fetched.state.batches(), static_cast<long long>(window.size()))
        << client_id << ": the window counts " << fetched.state.batches() << " batches, "
        << window.size() << " were acknowledged into it";
    EXPECT_TRUE(AllFinite(fetched.gradients)) << client_id << ": NaN or Inf in the sums";
    LayerTensors expected = ZeroWeights<std::vector<float>>(config_);
    int counts[kContents] = {};
    for (const auto& [id, content] : window) ++counts[content];
    for (int content = 0; content < kContents; ++content) {
      if (counts[content] == 0) continue;
      const LayerTensors& gradients = Expected(fetched.state.weights_version(), content);
      for (Weight weight : kAllWeights) {
        for (std::size_t i = 0; i < expected[weight].size(); ++i) {
          expected[weight][i] += static_cast<float>(counts[content]) * gradients[weight][i];
        }
      }
    }
    EXPECT_TRUE(Close(fetched.gradients, expected, window.size() > 1 ? 1e-4 : Tolerance(),
                      absl::StrCat(client_id, " window of ", window.size(), " batches")));
    acknowledged_ += static_cast<long long>(window.size());
    ++windows_;
    window.clear();
  };

  while (!stop_) {
    // This round's batches: id -> mode; one RETURN, the rest ACCUMULATE.
    std::map<std::uint64_t, v1::GradientMode> pending;
    for (int i = 0; i < settings_.batches_per_round; ++i) {
      pending[next_id++] = v1::GRADIENT_MODE_ACCUMULATE;
    }
    pending[next_id++] = v1::GRADIENT_MODE_RETURN;
    for (int attempt = 0; !pending.empty(); ++attempt) {
      if (attempt > 50) {
        Unexpected(absl::StrCat(client_id, ": a round did not complete in 50 streams"));
        return;
      }
      // The first stream of a round is cancelled one time in four, after some answers.
      const bool cancel = attempt == 0 && random() % 4 == 0;
      const std::size_t cancel_after = random() % (pending.size() / 2 + 1);
      grpc::ClientContext context;
      context.AddMetadata("attngrad-client-id", client_id);
      auto stream = stub->Backward(&context);
      std::vector<v1::BackwardRequest> requests;
      for (const auto& [id, mode] : pending) {
        requests.push_back(Request(static_cast<int>(id % kContents), id, mode));
      }
      std::thread writer([&] {
        for (const v1::BackwardRequest& request : requests) {
          if (!stream->Write(request)) return;
        }
        stream->WritesDone();
      });
      bool refused_for_weights = false;
      std::size_t answers = 0;
      v1::BackwardResponse response;
      while (!(cancel && answers >= cancel_after) && stream->Read(&response)) {
        ++answers;
        const std::uint64_t id = response.batch_id();
        const auto found = pending.find(id);
        if (found == pending.end()) {
          Unexpected(absl::StrCat(client_id, ": an answer for batch ", id, " not pending"));
          continue;
        }
        const int content = static_cast<int>(id % kContents);
        if (response.has_error()) {
          if (response.error().code() == static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION) &&
              response.error().message().find("weights") != std::string::npos) {
            refused_for_weights = true;  // not in the window; resent after the fetch
            ++refused_for_weights_;
          } else {
            Unexpected(absl::StrCat(client_id, " batch ", id, ": ", response.error().message()));
            pending.erase(found);
          }
          continue;
        }
        if (found->second == v1::GRADIENT_MODE_RETURN) {
          const LayerTensors returned = ResponseWeightGradients(response);
          EXPECT_TRUE(AllFinite(returned)) << client_id << ": NaN or Inf in a RETURN answer";
          EXPECT_TRUE(Close(returned, Expected(response.weights_version(), content), Tolerance(),
                            absl::StrCat(client_id, " RETURN batch ", id)));
          ++returns_checked_;
        } else {
          window[id] = content;  // new, or a duplicate of one taken by a cancelled stream
        }
        pending.erase(found);
      }
      if (cancel) {
        context.TryCancel();
        while (stream->Read(&response)) {
        }
        ++cancelled_streams_;
      }
      writer.join();
      const grpc::Status status = stream->Finish();
      if (!cancel && !status.ok()) {
        Unexpected(absl::StrCat(client_id, " stream: ", status.error_message()));
      }
      // A cancelled stream may have handed batches in that were not answered: they are retried
      // (and answered, new or duplicate) before any fetch. Only then is the window exact.
      if (!cancel && refused_for_weights) fetch_and_verify();
    }
    fetch_and_verify();
    if (settings_.pause_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(settings_.pause_ms));
    }
  }
}

// Replaces the weights every 3 s, alternating B (even versions) and C (odd versions).
void SoakTest::Admin(int port, const LayerWeights& b, const LayerWeights& c,
                     std::uint64_t version) {
  auto stub = v1::AttentionGradient::NewStub(Connect(port));
  while (!stop_) {
    for (int i = 0; i < 30 && !stop_; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (stop_) break;
    const std::uint64_t loaded = Load(*stub, version % 2 == 0 ? c : b);
    EXPECT_EQ(loaded, version + 1);
    version = loaded;
    ++weight_loads_;
  }
}

// attngrad-cli streaming RETURN batches, SIGKILLed after 0.5 to 2 s, again and again.
void SoakTest::Victims(int port) {
  std::mt19937 random(5);
  while (!stop_) {
    ChildProcess victim(ATTNGRAD_CLI_BINARY,
                        {"backward", absl::StrCat("--target=127.0.0.1:", port),
                         absl::StrCat("--client_id=victim-", victims_killed_.load()),
                         "--mode=return", "--count=1000000", "--batch=1",
                         absl::StrCat("--seq_len=", settings_.seq_len), "--in_flight=2"});
    const int milliseconds = 500 + static_cast<int>(random() % 1500);
    for (int waited = 0; waited < milliseconds && !stop_; waited += 50) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    victim.Signal(SIGKILL);
    victim.Wait();
    ++victims_killed_;
  }
}

TEST_F(SoakTest, AcknowledgedBatchesCountOnceUnderChaos) {
  std::vector<std::string> arguments = {"--listen=127.0.0.1:0",
                                        "--metrics_listen=",
                                        "--devices=" + settings_.devices,
                                        "--weights=random",
                                        "--shutdown_grace_seconds=2",
                                        "--max_clients_with_sums=8",
                                        "--cpu_threads=" + std::to_string(settings_.cpu_threads)};
  if (settings_.model != "spec") {
    arguments.push_back("--model=" + settings_.model);
    arguments.push_back("--layers=0");
  }
  ServerProcess server(arguments);
  const int port = server.WaitServing(120);
  ASSERT_GT(port, 0) << server.log();
  auto admin = v1::AttentionGradient::NewStub(Connect(port));
  {
    grpc::ClientContext context;
    v1::GetModelInfoResponse info;
    ASSERT_TRUE(admin->GetModelInfo(&context, {}, &info).ok());
    config_ = wire::LayerConfigFromWire(info.config());
  }
  MakeContents();
  // Weights B (version 2) and C (version 3), and every content's gradients under each.
  const LayerWeights b = RandomLayerWeights(config_, 201), c = RandomLayerWeights(config_, 202);
  ASSERT_EQ(Load(*admin, b), 2u);
  for (int content = 0; content < kContents; ++content) {
    expected_[0].push_back(ReturnGradients(*admin, content, 2));
  }
  ASSERT_EQ(Load(*admin, c), 3u);
  for (int content = 0; content < kContents; ++content) {
    expected_[1].push_back(ReturnGradients(*admin, content, 3));
  }
  for (const auto& per_version : expected_) {
    for (const LayerTensors& gradients : per_version) ASSERT_TRUE(AllFinite(gradients));
  }

  // The chaos.
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < settings_.trainers; ++i) threads.emplace_back([&, i] { Trainer(port, i); });
  threads.emplace_back([&] { Admin(port, b, c, 3); });
  for (int i = 0; i < settings_.victims; ++i) threads.emplace_back([&] { Victims(port); });

  // RSS every second, while the run lasts.
  std::vector<std::pair<double, long long>> samples;
  std::unique_ptr<std::ofstream> csv;
  if (!settings_.csv.empty()) {
    csv = std::make_unique<std::ofstream>(settings_.csv);
    *csv << "seconds,rss_kib,acknowledged,windows,errors\n";
  }
  while (SecondsSince(start) < settings_.seconds && UnexpectedCount() == 0 && !HasFailure()) {
    const double at = SecondsSince(start);
    const long long rss = RssKib(server.pid());
    samples.emplace_back(at, rss);
    if (csv != nullptr) {
      *csv << absl::StrFormat("%.1f", at) << "," << rss << "," << acknowledged_.load() << ","
           << windows_.load() << "," << UnexpectedCount() << std::endl;
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  stop_ = true;
  for (std::thread& thread : threads) thread.join();

  std::printf(
      "soak: %.0f s, %lld ACCUMULATE batches acknowledged and verified in %lld windows, %lld "
      "RETURN answers checked, %lld streams cancelled, %lld batches refused for a weights change, "
      "%lld weight loads, %lld clients killed, %lld unexpected errors\n",
      SecondsSince(start), acknowledged_.load(), windows_.load(), returns_checked_.load(),
      cancelled_streams_.load(), refused_for_weights_.load(), weight_loads_.load(),
      victims_killed_.load(), UnexpectedCount());
  for (const std::string& error : unexpected_errors_) ADD_FAILURE() << error;
  if (HasFailure()) {
    const int exit_status = server.WaitExit(0);
    ADD_FAILURE() << "server " << (exit_status < 0 ? "running" : "exited with ")
                  << (exit_status < 0 ? "" : std::to_string(exit_status)) << "; its log:\n"
                  << server.log();
  }
  EXPECT_GT(acknowledged_.load(), 0);
  EXPECT_GT(cancelled_streams_.load(), 0);
  EXPECT_GT(weight_loads_.load(), 0);
  if (settings_.victims > 0) {
    EXPECT_GT(victims_killed_.load(), 0);
  }

  // RSS flat after the warm-up (the first 40 % of the run).
  const double warm = 0.4 * settings_.seconds;
  long long baseline = 0, peak = 0, first = 0, last = 0;
  for (const auto& [at, rss] : samples) {
    if (first == 0) first = rss;
    last = rss;
    if (at >= 0.2 * settings_.seconds && at < warm) baseline = std::max(baseline, rss);
    if (at >= warm) peak = std::max(peak, rss);
  }
  std::printf(
      "soak: server RSS %lld KiB at start, %lld KiB after the warm-up, %lld KiB peak "
      "after it, %lld KiB at the end\n",
      first, baseline, peak, last);
  if (baseline > 0 && peak > 0) {
    const long long bound = std::max(64LL << 10, baseline / 4);
    EXPECT_LE(peak - baseline, bound) << "the server's RSS grew after the warm-up";
  }

  // SIGTERM with streams open: a trainer-like stream and a client being killed.
  ChildProcess streaming(ATTNGRAD_CLI_BINARY,
                         {"backward", absl::StrCat("--target=127.0.0.1:", port),
                          "--client_id=at-shutdown", "--mode=return", "--count=1000000",
                          "--batch=1", absl::StrCat("--seq_len=", settings_.seq_len)});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto signalled = Clock::now();
  server.Signal(SIGTERM);
  const int exit_status = server.WaitExit(2 + 1.5);
  EXPECT_EQ(exit_status, 0) << "after " << SecondsSince(signalled) << " s\n" << server.log();
}

}  // namespace
}  // namespace attngrad::server::testing
