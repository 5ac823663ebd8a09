// GradientCore with several workers, without gRPC and without a GPU: three CPU workers stand in for
// three devices, so the cross-device combination of a fetch (the host path, in worker order) and
// fetch-and-zero on every worker are checked on any machine.
#include <cmath>
#include <future>

#include "devices/cpu_worker.h"
#include "scheduling/gradient_core.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

// ResolveLayer gives a request's layer its slot, index, shape and settings in one call, the same
// ones as SlotOf, config and settings one by one.
TEST(GradientCoreTest, ResolveLayerGivesSlotIndexConfigAndSettings) {
  const LayerConfig config = SmallConfig();
  auto weights = std::make_shared<const LayerWeights>(RandomLayerWeights(config, 7));
  ServerMetrics metrics("test");
  std::vector<std::unique_ptr<DeviceWorker>> workers;
  workers.push_back(std::make_unique<CpuWorker>(LayerSlots{weights, weights}, 1, &metrics));
  ASSERT_TRUE(workers.back()->Start().ok());
  ServedModel model;
  LayerSettings third, fifth;
  third.index = 3;
  fifth.index = 5;
  fifth.rope_theta = 1e6;
  model.layers.push_back(ServedLayer{third, weights});
  model.layers.push_back(ServedLayer{fifth, weights});
  GradientCore core(model, std::move(workers), &metrics);

  absl::StatusOr<ResolvedLayer> layer = core.ResolveLayer(5, "layer");
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ(layer->slot, 1);
  EXPECT_EQ(layer->index(), 5);
  EXPECT_EQ(&layer->settings, &core.settings(1));
  EXPECT_EQ(&layer->config, &core.config(1));
  EXPECT_EQ(layer->settings.rope_theta, 1e6);

  absl::StatusOr<ResolvedLayer> first = core.ResolveLayer(std::nullopt, "layer");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->slot, 0);
  EXPECT_EQ(first->index(), 3);

  absl::StatusOr<ResolvedLayer> missing = core.ResolveLayer(4, "layers[2]");
  EXPECT_TRUE(absl::IsInvalidArgument(missing.status())) << missing.status();
  EXPECT_NE(missing.status().message().find("layers[2]"), std::string::npos) << missing.status();
}

TEST(GradientCoreTest, FetchSumsEveryWorkerInWorkerOrder) {
  const LayerConfig config = SmallConfig();
  auto weights = std::make_shared<const LayerWeights>(RandomLayerWeights(config, 5));
  ServerMetrics metrics("test");
  // Each worker first runs a control that waits for `gate`, so every batch is admitted while all
  // are busy and the least-busy scheduler deals them out 0, 1, 2, 0, 1, 2, ...
  std::promise<void> open_gate;
  std::shared_future<void> gate = open_gate.get_future().share();
  std::vector<std::unique_ptr<DeviceWorker>> workers;
  for (int i = 0; i < 3; ++i) {
    auto worker = std::make_unique<CpuWorker>(LayerSlots{weights}, 1, &metrics);
    ASSERT_TRUE(worker->Start().ok());
    WorkerControl wait;
    wait.on_done = [gate](absl::Status, AccumulatorSnapshot) { gate.wait(); };
    worker->SubmitControl(std::move(wait));
    workers.push_back(std::move(worker));
  }
  std::vector<DeviceWorker*> raw;
  for (auto& worker : workers) raw.push_back(worker.get());
  ServedModel model;
  model.layers.push_back(ServedLayer{LayerSettings{}, weights});
  GradientCore core(model, std::move(workers), &metrics);
  // Opens the gate if an assertion leaves early (before core stops its workers, which wait for it).
  struct GateGuard {
    std::promise<void>* gate;
    bool open = false;
    void Open() {
      if (!open) gate->set_value();
      open = true;
    }
    ~GateGuard() { Open(); }
  } guard{&open_gate};

  constexpr int kBatches = 12;
  std::vector<Batch> batches;
  std::vector<std::future<absl::Status>> finished;
  LayerTensors expected = ZeroWeights<std::vector<float>>(config);
  for (int i = 0; i < kBatches; ++i) {
    batches.push_back(MakeBatch(config, 1 + i % 2, 5 + i % 3, 900 + i));
    const Batch& batch = batches.back();
    auto job = std::make_unique<BatchJob>();
    job->request.batch = batch.batch;
    job->request.seq_len = batch.seq_len;
    job->request.scalars.scaling = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
    job->request.precision = Precision::kFp32;
    job->admission.accumulate = true;
    job->request.config = config;
    job->request.hidden_states = WireTensor::FromFloats(batch.hidden_states);
    job->request.grad_output = WireTensor::FromFloats(batch.grad_output);
    job->request.cos = batch.cos;
    job->request.sin = batch.sin;
    auto done = std::make_shared<std::promise<absl::Status>>();
    finished.push_back(done->get_future());
    job->on_done = [done](std::unique_ptr<BatchJob> job) { done->set_value(job->result.status); };
    ASSERT_TRUE(core.Admit(std::move(job), "default", i, 0, 0).ok());
    const Gradients reference = Reference(*weights, batch);
    for (Weight w : kAllWeights) {
      for (std::size_t j = 0; j < expected[w].size(); ++j) {
        expected[w][j] += reference.weights[w][j];
      }
    }
  }
  for (DeviceWorker* worker : raw) EXPECT_EQ(worker->Outstanding(), kBatches / 3u);
  guard.Open();
  for (auto& status : finished) ASSERT_TRUE(status.get().ok());

  auto fetch = [&core](bool zero) {
    std::promise<absl::StatusOr<FetchResult>> promise;
    core.Fetch("default", /*slot=*/0, zero, 0, [&promise](absl::StatusOr<FetchResult> result) {
      promise.set_value(std::move(result));
    });
    return promise.get_future().get();
  };
  const absl::StatusOr<FetchResult> first = fetch(/*zero=*/false);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->state.batches, kBatches);
  long long tokens = 0;
  for (const Batch& batch : batches) tokens += static_cast<long long>(batch.batch) * batch.seq_len;
  EXPECT_EQ(first->state.tokens, tokens);
  EXPECT_TRUE(Close(first->gradients, expected, 1e-5, "sum over 3 workers"));

  const absl::StatusOr<FetchResult> second = fetch(/*zero=*/true);
  ASSERT_TRUE(second.ok()) << second.status();
  for (Weight w : kAllWeights) {
    EXPECT_EQ(second->gradients[w], first->gradients[w])
        << WeightModuleName(w) << ": two fetches of the same accumulators differ";
  }
  const absl::StatusOr<FetchResult> after = fetch(/*zero=*/false);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->state.batches, 0);
  EXPECT_NE(after->state.window_id, first->state.window_id);
  for (Weight w : kAllWeights) {
    for (float value : after->gradients[w]) ASSERT_EQ(value, 0.f);
  }
}

}  // namespace
}  // namespace attngrad::server::testing
