// The service around the math: model info, grpc.health.v1, reflection, Prometheus metrics, the
// stream limit and a graceful shutdown that finishes the batch in flight, ends idle kept-open
// streams at once and refuses batches that arrive after it began.
#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include <grpcpp/generic/generic_stub.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

class ServerServiceTest : public ServerTest {};

TEST_F(ServerServiceTest, ModelInfoDescribesTheServer) {
  if (TestOnGpu()) GTEST_SKIP() << "expects the CPU backend";
  v1::GetModelInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.config().hidden_size(), 3072);
  EXPECT_EQ(info.config().num_heads(), 24);
  EXPECT_EQ(info.config().num_kv_heads(), 8);
  EXPECT_EQ(info.config().head_dim(), 128);
  EXPECT_EQ(info.weights_version(), 1u);
  EXPECT_EQ(info.weights_source(), "random:seed=11");
  EXPECT_EQ(info.server_instance_id(), server().instance_id());
  EXPECT_EQ(info.server_instance_id().size(), 32u);
  ASSERT_EQ(info.devices_size(), 1);
  EXPECT_EQ(info.devices(0).backend(), "cpu");
  EXPECT_FALSE(info.devices(0).stream_ordered_batches());  // a GPU's stream orders those
  EXPECT_EQ(info.supported_wire_dtypes_size(), 3);
  EXPECT_EQ(info.max_batch_tokens(), 65536);
  EXPECT_EQ(info.max_message_bytes(), 1073741824);
  EXPECT_GT(info.accumulation_window_id(), 0u);
  EXPECT_NEAR(info.default_scaling(), 0.08838834764831845, 1e-7);
  EXPECT_EQ(info.default_softcap(), 50.f);
  EXPECT_EQ(info.default_eps(), 1e-6f);
}

TEST_F(ServerServiceTest, HealthCheckAndReflection) {
  auto health = grpc::health::v1::Health::NewStub(channel());
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(health->Check(&context, request, &response).ok());
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }

  // grpc.reflection.v1alpha ListServices, encoded by hand: ServerReflectionRequest field 7
  // (list_services, a string) empty = bytes 0x3a 0x00.
  grpc::GenericStub generic(channel());
  grpc::CompletionQueue queue;
  grpc::ClientContext context;
  auto call = generic.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &queue);
  auto wait = [&queue](std::intptr_t expected) {
    void* tag;
    bool ok;
    EXPECT_TRUE(queue.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<std::intptr_t>(tag), expected);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(wait(1));
  const char bytes[] = {0x3a, 0x00};
  grpc::Slice slice(bytes, sizeof bytes);
  grpc::ByteBuffer message(&slice, 1);
  call->Write(message, reinterpret_cast<void*>(2));
  ASSERT_TRUE(wait(2));
  call->WritesDone(reinterpret_cast<void*>(3));
  ASSERT_TRUE(wait(3));
  grpc::ByteBuffer reply;
  call->Read(&reply, reinterpret_cast<void*>(4));
  ASSERT_TRUE(wait(4));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(reply.Dump(&slices).ok());
  std::string text;
  for (const grpc::Slice& part : slices)
    text.append(reinterpret_cast<const char*>(part.begin()), part.size());
  EXPECT_NE(text.find("attngrad.v1.AttentionGradient"), std::string::npos);
  EXPECT_NE(text.find("grpc.health.v1.Health"), std::string::npos);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  wait(5);
  EXPECT_TRUE(status.ok()) << status.error_message();
  queue.Shutdown();
  void* tag;
  bool ok;
  while (queue.Next(&tag, &ok)) {
  }
}

TEST_F(ServerServiceTest, MetricsAreExported) {
  if (TestOnGpu()) GTEST_SKIP() << "expects the CPU backend's device label";
  ASSERT_GT(server().metrics_port(), 0);
  const Batch batch = MakeBatch(config(), 1, 2, 1300);
  ASSERT_FALSE(
      RunOne(stub(), MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_ACCUMULATE)).has_error());
  v1::BackwardRequest bad = MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_ACCUMULATE);
  bad.clear_grad_output();
  ASSERT_TRUE(RunOne(stub(), bad).has_error());
  const std::vector<std::string> expected_lines = {
      "attngrad_batch_duration_seconds_bucket{device=\"cpu\",mode=\"accumulate\"",
      "attngrad_stage_duration_seconds_count{device=\"cpu\",stage=\"compute\"} 1",
      "attngrad_stage_duration_seconds_count{device=\"cpu\",stage=\"queue\"} 1",
      "attngrad_stage_duration_seconds_count{device=\"cpu\",stage=\"copy_in\"} 1",
      "attngrad_stage_duration_seconds_count{device=\"cpu\",stage=\"copy_out\"} 1",
      "attngrad_rpc_duration_seconds_count{code=\"OK\",method=\"Backward\"} 2",
      "attngrad_rpc_duration_seconds_count{code=\"OK\",method=\"GetModelInfo\"} 1",
      "attngrad_batches_total{device=\"cpu\",mode=\"accumulate\"} 1",
      "attngrad_tokens_total{device=\"cpu\",mode=\"accumulate\"} 2",
      "attngrad_received_bytes_total{method=\"Backward\"}",
      "attngrad_sent_bytes_total{method=\"Backward\"} 24576",
      "attngrad_errors_total{code=\"INVALID_ARGUMENT\",method=\"Backward\"} 1",
      "attngrad_inflight_batches{device=\"cpu\"} 0",
      "attngrad_queue_depth{device=\"cpu\"} 0",
      "attngrad_queue_capacity{device=\"cpu\"}",
      "attngrad_device_memory_used_bytes{device=\"cpu\"}",
      "attngrad_device_memory_total_bytes{device=\"cpu\"}",
      "attngrad_weights_version 1",
      "attngrad_accumulated_batches 1",
      "attngrad_accumulated_tokens 2",
      "attngrad_accumulation_window_id ",
      "attngrad_build_info{version=\"",
      "attngrad_gradient_sum_info{nccl_version=\"\",path=\"host\"} 1",
  };
  // A call is recorded when gRPC closes it (rpc_metrics_interceptor.h), which can come just after
  // the client saw its status: scrape again until everything is there (at most 5 s).
  std::string text;
  for (int attempt = 0; attempt < 100; ++attempt) {
    text = HttpGet(server().metrics_port(), "/metrics");
    if (std::all_of(expected_lines.begin(), expected_lines.end(), [&](const std::string& line) {
          return text.find(line) != std::string::npos;
        })) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (const std::string& expected : expected_lines) {
    EXPECT_NE(text.find(expected), std::string::npos) << "missing: " << expected;
  }
  if (HasFailure()) std::cerr << text << "\n";
}

// A Backward stream that has answered one small ACCUMULATE batch and is left open (not
// half-closed).
class AnsweredStream {
 public:
  AnsweredStream(v1::AttentionGradient::Stub& stub, const LayerConfig& config,
                 std::uint64_t batch_id)
      : stream_(stub.Backward(&context_)) {
    const Batch batch = MakeBatch(config, 1, 2, 1400 + batch_id);
    EXPECT_TRUE(stream_->Write(MakeRequest(config, batch, batch_id, v1::GRADIENT_MODE_ACCUMULATE)));
    v1::BackwardResponse response;
    EXPECT_TRUE(stream_->Read(&response));
    EXPECT_FALSE(response.has_error()) << response.error().message();
  }
  grpc::ClientReaderWriter<v1::BackwardRequest, v1::BackwardResponse>* operator->() {
    return stream_.get();
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::BackwardRequest, v1::BackwardResponse>> stream_;
};

class ServerStreamLimitTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override { options.max_concurrent_streams = 1; }
};

TEST_F(ServerStreamLimitTest, StreamsBeyondTheLimitAreRefused) {
  AnsweredStream open(stub(), config(), 1);  // the first stream is established
  ASSERT_FALSE(HasFailure());

  v1::BackwardResponse response;
  auto other_stub = NewStub();
  grpc::ClientContext other_context;
  auto refused = other_stub->Backward(&other_context);
  EXPECT_FALSE(refused->Read(&response));
  const grpc::Status status = refused->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("--max_concurrent_streams"), std::string::npos);

  open->WritesDone();
  EXPECT_TRUE(open->Finish().ok());
  // Once the first stream is done, a new one is accepted.
  const Batch batch = MakeBatch(config(), 1, 1, 1400);
  EXPECT_FALSE(RunOne(*other_stub, MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_ACCUMULATE))
                   .has_error());
}

TEST_F(ServerServiceTest, ShutdownFinishesTheBatchInFlight) {
  const Batch batch = MakeBatch(config(), 2, 8, 1500);
  grpc::ClientContext context;
  auto stream = stub().Backward(&context);
  ASSERT_TRUE(stream->Write(MakeRequest(config(), batch, 5, v1::GRADIENT_MODE_ACCUMULATE)));
  ASSERT_TRUE(stream->WritesDone());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::thread stopper([this] { server().Shutdown(absl::Seconds(20)); });
  v1::BackwardResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(response.batch_id(), 5u);
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_TRUE(stream->Finish().ok());
  stopper.join();
  // The server is gone: new calls fail.
  grpc::ClientContext late;
  late.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::GetModelInfoResponse info;
  EXPECT_FALSE(stub().GetModelInfo(&late, {}, &info).ok());
}

// Shutdown(grace) on its own thread, timed.
class TimedShutdown {
 public:
  TimedShutdown(GradientServer& server, absl::Duration grace)
      : start_(std::chrono::steady_clock::now()), thread_([this, &server, grace] {
          server.Shutdown(grace);
          seconds_ =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
        }) {}
  ~TimedShutdown() {
    if (thread_.joinable()) thread_.join();
  }
  // Waits for the shutdown; the seconds it took.
  double Seconds() {
    thread_.join();
    return seconds_;
  }

 private:
  const std::chrono::steady_clock::time_point start_;
  double seconds_ = 0;
  std::thread thread_;
};

// A client's kept-open stream (answered, not half-closed, idle) does not hold the shutdown for the
// grace period: it ends at once with UNAVAILABLE naming the shutdown, which clients retry.
TEST_F(ServerServiceTest, ShutdownEndsAnIdleOpenStreamAtOnce) {
  AnsweredStream stream(stub(), config(), 7);
  ASSERT_FALSE(HasFailure());

  TimedShutdown shutdown(server(), absl::Seconds(20));
  v1::BackwardResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_NE(status.error_message().find("shutting down"), std::string::npos)
      << status.error_message();
  EXPECT_LT(shutdown.Seconds(), 2.0);
}

// A batch computing when the shutdown begins is answered (its ACCUMULATE sum counted) on a stream
// the client has not half-closed; a batch sent after the shutdown began is answered UNAVAILABLE;
// then the stream ends UNAVAILABLE, well within the grace period.
// Compressed messages are refused before they are inflated (a few kB of gzip can expand to GBs
// ahead of any memory budget), and the server goes on serving.
TEST_F(ServerServiceTest, CompressedMessagesAreRefused) {
  grpc::ClientContext context;
  context.set_compression_algorithm(GRPC_COMPRESS_GZIP);
  v1::LoadWeightsResponse response;
  auto writer = stub().LoadWeights(&context, &response);
  v1::LoadWeightsRequest chunk;
  chunk.set_name(v1::WEIGHT_NAME_Q_PROJ);
  chunk.set_dtype(v1::DTYPE_FLOAT32);
  chunk.set_data(std::string(8 << 20, '\0'));  // 8 MiB of zeros: a few kB compressed
  writer->Write(chunk);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  grpc::ClientContext info_context;
  v1::GetModelInfoResponse info;
  EXPECT_TRUE(stub().GetModelInfo(&info_context, {}, &info).ok());
  EXPECT_EQ(info.weights_version(), 1u) << "the refused upload changed the weights";
}

// Whether /metrics on `port` shows a batch queued or computing (attngrad_inflight_batches > 0),
// polled for up to `timeout`: the server has the batch, however loaded the machine is.
bool WaitForABatchInFlight(int port, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::istringstream metrics(HttpGet(port, "/metrics"));
    for (std::string line; std::getline(metrics, line);) {
      if (line.rfind("attngrad_inflight_batches", 0) != 0) continue;
      if (std::stod(line.substr(line.rfind(' ') + 1)) > 0) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Whether the server's health turns NOT_SERVING (or stops answering: it refuses new calls once
// shutting down) within `timeout`.
bool WaitUntilNotServing(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout) {
  auto health = grpc::health::v1::Health::NewStub(channel);
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, {}, &response);
    if (!status.ok() || response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST_F(ServerServiceTest, ShutdownAnswersTheBatchInFlightAndRefusesLaterOnes) {
  // 1 x 512 tokens: seconds of work for the CPU backend, so it is computing when the
  // shutdown begins (a GPU answers it sooner; then only the refusal is checked).
  const Batch in_flight = MakeBatch(config(), 1, 512, 1700);
  const Batch late = MakeBatch(config(), 1, 2, 1701);
  grpc::ClientContext context;
  auto stream = stub().Backward(&context);
  ASSERT_TRUE(stream->Write(MakeRequest(config(), in_flight, 8, v1::GRADIENT_MODE_ACCUMULATE)));
  ASSERT_TRUE(WaitForABatchInFlight(server().metrics_port(), absl::Seconds(60)))
      << "the server never showed the batch in flight";

  // The grace is far longer than the batch takes even on a loaded machine: the shutdown must
  // end when the batch is answered, not when the grace runs out.
  constexpr double kGraceSeconds = 120;
  TimedShutdown shutdown(server(), absl::Seconds(kGraceSeconds));
  ASSERT_TRUE(WaitUntilNotServing(channel(), absl::Seconds(60))) << "the shutdown never began";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // and its streams are draining
  const bool late_written =
      stream->Write(MakeRequest(config(), late, 9, v1::GRADIENT_MODE_ACCUMULATE));
  std::map<std::uint64_t, v1::BackwardResponse> answers;
  v1::BackwardResponse response;
  while (stream->Read(&response)) answers[response.batch_id()] = response;
  const grpc::Status status = stream->Finish();
  const double seconds = shutdown.Seconds();

  ASSERT_EQ(answers.count(8), 1u) << "the batch in flight was not answered";
  EXPECT_FALSE(answers[8].has_error()) << answers[8].error().message();
  EXPECT_FALSE(answers[8].duplicate());
  EXPECT_GT(answers[8].accumulation_window_id(), 0u);
  if (!TestOnGpu()) {
    EXPECT_TRUE(late_written);
    ASSERT_EQ(answers.count(9), 1u) << "the batch sent after the shutdown began got no answer";
  }
  if (answers.count(9) == 1) {
    EXPECT_EQ(answers[9].error().code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
    EXPECT_NE(answers[9].error().message().find("shutting down"), std::string::npos)
        << answers[9].error().message();
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_NE(status.error_message().find("shutting down"), std::string::npos)
      << status.error_message();
  EXPECT_LT(seconds, kGraceSeconds / 2);
}

}  // namespace
}  // namespace attngrad::server::testing
