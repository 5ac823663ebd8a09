// The queued batches of a cancelled Backward stream (BatchJob::Arrival::stream_cancelled): a worker
// skips those whose result nobody can observe (RETURN, FORWARD and ACCUMULATE duplicates, answered
// to a stream nobody reads) and computes the ACCUMULATE batches that count, since one of them may
// already have been answered, on another stream, as its retry's duplicate. Checked on GradientCore
// and a CPU worker held by a control until the stream is cancelled (no timing involved), and on a
// server whose shutdown finds a queue of cancelled RETURN batches.
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <thread>

#include "devices/cpu_worker.h"
#include "scheduling/gradient_core.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

enum class Kind { kAccumulate, kReturn, kForward };

// A job of `batch` sent on the stream whose cancelled flag is `cancelled`; its status arrives in
// `finished` when the worker is done with it.
std::unique_ptr<BatchJob> JobOf(const LayerConfig& config, const Batch& batch, Kind kind,
                                const std::shared_ptr<std::atomic<bool>>& cancelled,
                                std::future<absl::Status>* finished) {
  auto job = std::make_unique<BatchJob>();
  job->request.batch = batch.batch;
  job->request.seq_len = batch.seq_len;
  job->request.config = config;
  job->request.scalars.scaling = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
  job->request.precision = Precision::kFp32;
  job->request.computation =
      kind == Kind::kForward ? Computation::kForward : Computation::kBackward;
  job->admission.accumulate = kind == Kind::kAccumulate;
  job->request.return_weight_gradients = kind == Kind::kReturn;
  job->request.hidden_states = WireTensor::FromFloats(batch.hidden_states);
  if (kind != Kind::kForward) job->request.grad_output = WireTensor::FromFloats(batch.grad_output);
  job->request.cos = batch.cos;
  job->request.sin = batch.sin;
  job->arrival.stream_cancelled = cancelled;
  auto done = std::make_shared<std::promise<absl::Status>>();
  *finished = done->get_future();
  job->on_done = [done](std::unique_ptr<BatchJob> job) { done->set_value(job->result.status); };
  return job;
}

// GradientCore over one CPU worker that first runs a control waiting for Open(), so that every
// batch admitted before it stays queued.
class HeldWorker {
 public:
  HeldWorker() : weights_(std::make_shared<const LayerWeights>(RandomLayerWeights(config_, 5))) {
    auto worker = std::make_unique<CpuWorker>(LayerSlots{weights_}, 1, &metrics_);
    EXPECT_TRUE(worker->Start().ok());
    WorkerControl wait;
    wait.on_done = [gate = gate_.get_future().share()](absl::Status, AccumulatorSnapshot) {
      gate.wait();
    };
    worker->SubmitControl(std::move(wait));
    worker_ = worker.get();
    std::vector<std::unique_ptr<DeviceWorker>> workers;
    workers.push_back(std::move(worker));
    ServedModel model;
    model.layers.push_back(ServedLayer{LayerSettings{}, weights_});
    core_ = std::make_unique<GradientCore>(model, std::move(workers), &metrics_);
  }
  ~HeldWorker() { Open(); }  // before the core stops its worker, which waits for the gate

  void Open() {
    if (!open_) gate_.set_value();
    open_ = true;
  }
  // Admits a batch of `kind` with id `batch_id` into the client's window; its admission.
  Admission Admit(const Batch& batch, Kind kind, std::uint64_t batch_id,
                  const std::shared_ptr<std::atomic<bool>>& cancelled,
                  std::future<absl::Status>* finished) {
    absl::StatusOr<Admission> admission =
        core_->Admit(JobOf(config_, batch, kind, cancelled, finished), "default", batch_id, 0, 0);
    EXPECT_TRUE(admission.ok()) << admission.status();
    return admission.value_or(Admission{});
  }
  absl::StatusOr<FetchResult> Fetch() {
    std::promise<absl::StatusOr<FetchResult>> promise;
    core_->Fetch(
        "default", /*slot=*/0, /*zero_after_fetch=*/false, 0,
        [&promise](absl::StatusOr<FetchResult> result) { promise.set_value(std::move(result)); });
    return promise.get_future().get();
  }

  const LayerConfig& config() const { return config_; }
  const LayerWeights& weights() const { return *weights_; }
  const DeviceWorker& worker() const { return *worker_; }

 private:
  const LayerConfig config_ = SmallConfig();
  ServerMetrics metrics_{"test"};
  std::shared_ptr<const LayerWeights> weights_;
  std::promise<void> gate_;
  bool open_ = false;
  DeviceWorker* worker_ = nullptr;
  std::unique_ptr<GradientCore> core_;
};

LayerTensors SumOfReferences(const LayerWeights& weights, const std::vector<Batch>& batches) {
  LayerTensors sum = ZeroWeights<std::vector<float>>(weights.config);
  for (const Batch& batch : batches) {
    const Gradients reference = Reference(weights, batch);
    for (Weight w : kAllWeights) {
      for (std::size_t i = 0; i < sum[w].size(); ++i) sum[w][i] += reference.weights[w][i];
    }
  }
  return sum;
}

TEST(CancelledStreamTest, ItsQueuedBatchesThatNobodyObservesAreSkippedAndItsSumsAreComputed) {
  HeldWorker held;
  const LayerConfig& config = held.config();
  const std::vector<Batch> batches = {MakeBatch(config, 1, 6, 901), MakeBatch(config, 2, 5, 902),
                                      MakeBatch(config, 1, 7, 903)};
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  auto other = std::make_shared<std::atomic<bool>>(false);  // a stream that goes on
  std::future<absl::Status> first, second, returned, forward, duplicate, other_returned;
  held.Admit(batches[0], Kind::kAccumulate, 1, cancelled, &first);
  held.Admit(batches[1], Kind::kAccumulate, 2, cancelled, &second);
  held.Admit(batches[2], Kind::kReturn, 3, cancelled, &returned);
  held.Admit(batches[2], Kind::kForward, 4, cancelled, &forward);
  EXPECT_TRUE(held.Admit(batches[0], Kind::kAccumulate, 1, cancelled, &duplicate).duplicate);
  held.Admit(batches[2], Kind::kReturn, 5, other, &other_returned);
  cancelled->store(true);
  held.Open();

  EXPECT_TRUE(first.get().ok());
  EXPECT_TRUE(second.get().ok());
  EXPECT_EQ(returned.get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(forward.get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(duplicate.get().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(other_returned.get().ok()) << "a RETURN batch of a stream not cancelled is computed";
  EXPECT_EQ(held.worker().skipped_batches(), 3);

  const absl::StatusOr<FetchResult> fetched = held.Fetch();
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->state.batches, 2);
  EXPECT_TRUE(Close(fetched->gradients, SumOfReferences(held.weights(), {batches[0], batches[1]}),
                    1e-5, "the cancelled stream's ACCUMULATE batches"));
}

// What the first attempt at skipping got wrong (SoakTest.AcknowledgedBatchesCountOnceUnderChaos):
// a client whose stream is cancelled sends its unanswered batch again on a new stream, where it is
// answered as a duplicate of the one still queued; that queued one must be added.
TEST(CancelledStreamTest, AQueuedBatchWhoseRetryWasAnsweredAsItsDuplicateIsAdded) {
  HeldWorker held;
  const Batch batch = MakeBatch(held.config(), 2, 6, 904);
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  auto retry_stream = std::make_shared<std::atomic<bool>>(false);
  std::future<absl::Status> original, retry;
  EXPECT_FALSE(held.Admit(batch, Kind::kAccumulate, 7, cancelled, &original).duplicate);
  EXPECT_TRUE(held.Admit(batch, Kind::kAccumulate, 7, retry_stream, &retry).duplicate);
  cancelled->store(true);
  held.Open();
  EXPECT_TRUE(original.get().ok());
  EXPECT_TRUE(retry.get().ok());
  EXPECT_EQ(held.worker().skipped_batches(), 0);
  const absl::StatusOr<FetchResult> fetched = held.Fetch();
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->state.batches, 1);
  EXPECT_TRUE(Close(fetched->gradients, SumOfReferences(held.weights(), {batch}), 1e-5,
                    "the batch acknowledged as a duplicate"));
}

// A server with one CPU thread and streams that fill its queue with RETURN batches nobody reads:
// the shutdown's grace period ends, gRPC cancels the streams, and the worker computes the batch it
// is on and skips the rest. Before, it computed every queued batch, and gRPC's shutdown (which
// waits for the streams' reactors, which wait for their batches) took as long as all of them.
class CancelledStreamShutdownTest : public ServerTest {
 protected:
  static constexpr int kStreams = 4;   // each with --queue_depth (4) batches in the server
  static constexpr int kSeqLen = 512;  // ~0.3-1 s of one CPU thread per batch

  void Customize(ServerOptions& options) override {
    options.model = "gemma-3-270m";
    options.layers = "0";
    options.cpu_threads = 1;
  }
  // The server's queued batches, as /metrics reports them.
  int QueueDepth() {
    const std::string page = HttpGet(server().metrics_port(), "/metrics");
    const std::string name = "attngrad_queue_depth{device=\"cpu\"} ";
    const std::size_t at = page.find(name);
    return at == std::string::npos ? -1 : std::stoi(page.substr(at + name.size()));
  }
};

TEST_F(CancelledStreamShutdownTest, DoesNotComputeTheQueuedReturnBatchesOfCancelledStreams) {
  if (TestOnGpu()) GTEST_SKIP() << "the GPU pipeline launches queued batches at once";
  const Batch batch = MakeBatch(config(), 1, kSeqLen, 905);
  const v1::BackwardRequest request = MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_RETURN);
  // One batch alone: what the batch being computed at the grace's end may still cost.
  const v1::BackwardResponse alone = RunOne(stub(), request);
  ASSERT_FALSE(alone.has_error()) << alone.error().message();
  const double batch_seconds = alone.timings().compute_seconds();

  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::BackwardRequest, v1::BackwardResponse>>>
      streams;
  for (int s = 0; s < kStreams; ++s) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(stub().Backward(contexts.back().get()));
    for (int i = 0; i < 4; ++i) {
      v1::BackwardRequest numbered = request;
      numbered.set_batch_id(100 * s + i);
      ASSERT_TRUE(streams.back()->Write(numbered));
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (QueueDepth() < 3 * kStreams && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int queued = QueueDepth();
  ASSERT_GE(queued, 3 * kStreams);

  const auto start = std::chrono::steady_clock::now();
  server().Shutdown(absl::Seconds(1));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0 + 2 * batch_seconds + 1.0)
      << queued << " batches were queued, one alone took " << batch_seconds
      << " s: the shutdown computed the cancelled streams' queued RETURN batches";
  for (int s = 0; s < kStreams; ++s) {
    contexts[s]->TryCancel();
    streams[s]->Finish();
  }
}

}  // namespace
}  // namespace attngrad::server::testing
