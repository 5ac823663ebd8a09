// Admission, weights versions, accumulation windows and the cross-device sums (the devices'
// snapshots combined in worker order; with NCCL the root worker's snapshot already holds the sum).
#include "scheduling/gradient_core.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/tensor.h"

namespace attngrad::server {

std::string RandomInstanceId() {
  std::random_device device;
  std::uint64_t high = (static_cast<std::uint64_t>(device()) << 32) | device();
  std::uint64_t low = (static_cast<std::uint64_t>(device()) << 32) | device();
  return absl::StrFormat("%016x%016x", high, low);
}

namespace {

std::vector<LayerSettings> SettingsOf(const ServedModel& model) {
  std::vector<LayerSettings> settings;
  for (const ServedLayer& layer : model.layers) settings.push_back(layer.settings);
  return settings;
}

std::vector<LayerConfig> ConfigsOf(const ServedModel& model) {
  std::vector<LayerConfig> configs;
  for (const ServedLayer& layer : model.layers) configs.push_back(layer.weights->config);
  return configs;
}

}  // namespace

LayerSlots GradientCore::LayerSlotsOf(const ServedModel& model) {
  LayerSlots slots;
  for (const ServedLayer& layer : model.layers) slots.push_back(layer.weights);
  return slots;
}

GradientCore::GradientCore(const ServedModel& model,
                           std::vector<std::unique_ptr<DeviceWorker>> workers,
                           ServerMetrics* metrics, int max_clients_with_sums)
    : settings_(SettingsOf(model)),
      configs_(ConfigsOf(model)),
      model_name_(model.name),
      num_hidden_layers_(model.num_hidden_layers),
      instance_id_(RandomInstanceId()),
      metrics_(metrics),
      workers_(std::move(workers)) {
  // Window ids start at a random point (below 2^52, so they stay exact as JSON numbers), so a
  // window id of an earlier server instance is refused by a restarted server rather than matched.
  std::random_device device;
  next_window_id_ =
      ((static_cast<std::uint64_t>(device()) << 32 | device()) & ((1ull << 51) - 1)) + 1;
  for (const ServedLayer& layer : model.layers) {
    LayerState state;
    state.weights = layer.weights;
    for (int set = std::max(1, max_clients_with_sums) - 1; set >= 0; --set) {
      state.free_accumulator_sets.push_back(set);  // set 0 is taken first
    }
    layers_.push_back(std::move(state));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  UpdateVersionGaugeLocked();
  UpdateGaugesLocked();
}

void GradientCore::UpdateVersionGaugeLocked() {
  // The highest weights version of any layer (every change of any layer raises it or keeps it).
  std::uint64_t highest = 0;
  for (const LayerState& layer : layers_) highest = std::max(highest, layer.weights_version);
  metrics_->weights_version().Set(static_cast<double>(highest));
}

absl::StatusOr<int> GradientCore::SlotOf(std::optional<int> layer, const std::string& field) const {
  if (!layer.has_value()) return 0;
  for (std::size_t slot = 0; slot < settings_.size(); ++slot) {
    if (settings_[slot].index == *layer) return static_cast<int>(slot);
  }
  const int first = settings_.front().index;
  const int last = settings_.back().index;
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": this server has no decoder layer ", *layer, "; it holds layer",
      first == last ? absl::StrCat(" ", first) : absl::StrCat("s ", first, "-", last),
      model_name_.empty() ? ""
                          : absl::StrCat(" of ", model_name_, " (", num_hidden_layers_, " layers)"),
      " (GetModelInfo.layers)"));
}

absl::StatusOr<ResolvedLayer> GradientCore::ResolveLayer(std::optional<int> layer,
                                                         const std::string& field) const {
  ATTNGRAD_ASSIGN_OR_RETURN(const int slot, SlotOf(layer, field));
  return LayerAt(slot);
}

GradientCore::~GradientCore() {
  for (auto& worker : workers_) worker->StopAndJoin();
}

std::uint64_t GradientCore::weights_version(int slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layers_[static_cast<std::size_t>(slot)].weights_version;
}

std::uint64_t GradientCore::window_id(const std::string& client_id, int slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  absl::StatusOr<std::shared_ptr<Window>> window = WindowOfLocked({client_id, slot});
  return window.ok() ? (*window)->id : 0;
}

std::string GradientCore::weights_source() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (layers_.size() == 1) return layers_.front().weights->source;
  return absl::StrCat(model_name_.empty() ? std::string("model") : model_name_,
                      ":layers=", settings_.front().index, "-", settings_.back().index, " (",
                      layers_.front().weights->source, ", ...)");
}

std::vector<GradientCore::LayerDescription> GradientCore::Layers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LayerDescription> layers;
  for (std::size_t slot = 0; slot < layers_.size(); ++slot) {
    LayerDescription description;
    description.settings = settings_[slot];
    description.config = configs_[slot];
    description.weights_version = layers_[slot].weights_version;
    description.weights_source = layers_[slot].weights->source;
    layers.push_back(std::move(description));
  }
  return layers;
}

std::vector<DeviceDescription> GradientCore::Devices() const {
  std::vector<DeviceDescription> devices;
  for (const auto& worker : workers_) devices.push_back(worker->Describe());
  return devices;
}

absl::StatusOr<std::shared_ptr<GradientCore::Window>> GradientCore::WindowOfLocked(
    const WindowKey& key) {
  auto found = windows_.find(key);
  if (found != windows_.end()) return found->second;
  if (windows_.size() >= kMaxClientWindows) {
    // Forget one empty window (its client starts a new window id at its next call).
    auto empty = std::find_if(windows_.begin(), windows_.end(), [](const auto& entry) {
      return entry.second->accumulator_set < 0 && entry.second->batch_ids.empty();
    });
    if (empty == windows_.end()) {
      return absl::ResourceExhaustedError(absl::StrCat("accumulation windows: ", windows_.size(),
                                                       " clients hold windows with sums; fetch-and-"
                                                       "zero or zero some of them"));
    }
    windows_.erase(empty);
  }
  StartWindowLocked(key);
  return windows_[key];
}

void GradientCore::StartWindowLocked(const WindowKey& key) {
  std::shared_ptr<Window>& slot = windows_[key];
  if (slot != nullptr && slot->accumulator_set >= 0) {
    layers_[static_cast<std::size_t>(key.second)].free_accumulator_sets.push_back(
        slot->accumulator_set);
  }
  auto window = std::make_shared<Window>();
  window->slot = key.second;
  window->id = next_window_id_++;
  slot = std::move(window);
  metrics_->accumulation_window_id().Set(static_cast<double>(slot->id));
  UpdateGaugesLocked();
}

WindowState GradientCore::StateOfLocked(const Window& window) const {
  WindowState state;
  state.server_instance_id = instance_id_;
  state.window_id = window.id;
  state.weights_version = window.batch_ids.empty()
                              ? layers_[static_cast<std::size_t>(window.slot)].weights_version
                              : window.weights_version;
  state.layer = settings_[static_cast<std::size_t>(window.slot)].index;
  return state;
}

void GradientCore::UpdateGaugesLocked() {
  // Summed over the clients' windows.
  long long batches = 0, tokens = 0;
  for (const auto& [client_id, window] : windows_) {
    batches += window->batches;
    tokens += window->tokens;
  }
  metrics_->accumulated_batches().Set(static_cast<double>(batches));
  metrics_->accumulated_tokens().Set(static_cast<double>(tokens));
}

DeviceWorker& GradientCore::LeastBusyWorker() {
  DeviceWorker* best = workers_.front().get();
  std::size_t best_load = best->Outstanding();
  for (std::size_t i = 1; i < workers_.size(); ++i) {
    const std::size_t load = workers_[i]->Outstanding();
    if (load < best_load) {
      best = workers_[i].get();
      best_load = load;
    }
  }
  return *best;
}

DeviceWorker* GradientCore::WorkerOf(const std::string& device) {
  for (const std::unique_ptr<DeviceWorker>& worker : workers_) {
    if (worker->device() == device) return worker.get();
  }
  return nullptr;
}

absl::StatusOr<Admission> GradientCore::Admit(std::unique_ptr<BatchJob> job,
                                              const std::string& client_id, std::uint64_t batch_id,
                                              std::uint64_t expected_weights_version,
                                              std::uint64_t expected_window_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  ATTNGRAD_ASSIGN_OR_RETURN(DeviceWorker * worker, WorkerForLocked(*job));
  const int slot = job->request.layer_slot;
  const std::uint64_t layer_version = layers_[static_cast<std::size_t>(slot)].weights_version;
  if (expected_weights_version != 0 && expected_weights_version != layer_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "expected_weights_version: the request expects weights version ", expected_weights_version,
        " but layer ", settings_[static_cast<std::size_t>(slot)].index, " has version ",
        layer_version, " (the weights were replaced, or the server restarted; see GetModelInfo)"));
  }
  Admission admission;
  admission.weights_version = layer_version;
  if (job->admission.accumulate) {
    ATTNGRAD_ASSIGN_OR_RETURN(std::shared_ptr<Window> window, WindowOfLocked({client_id, slot}));
    ATTNGRAD_ASSIGN_OR_RETURN(
        const bool counts,
        AdmitToWindowLocked(*job, *window, client_id, batch_id, expected_window_id, layer_version));
    admission.window_id = window->id;
    admission.duplicate = !counts;
    if (counts) CountWhenDone(*job, std::move(window), batch_id);
  }
  job->admission.weights_version = admission.weights_version;
  job->admission.window_id = admission.window_id;
  job->admission.duplicate = admission.duplicate;
  worker->Submit(std::move(job));
  return admission;
}

absl::StatusOr<DeviceWorker*> GradientCore::WorkerForLocked(const BatchJob& job) {
  // A batch in a client's GPU memory (CUDA IPC) runs on that GPU's worker.
  if (job.cuda_device() < 0) return &LeastBusyWorker();
  DeviceWorker* worker = WorkerOf(absl::StrCat("cuda:", job.cuda_device()));
  if (worker == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the batch's CUDA IPC regions are on cuda:", job.cuda_device(),
                     ", which this server does not compute on"));
  }
  return worker;
}

absl::StatusOr<bool> GradientCore::AdmitToWindowLocked(BatchJob& job, Window& window,
                                                       const std::string& client_id,
                                                       std::uint64_t batch_id,
                                                       std::uint64_t expected_window_id,
                                                       std::uint64_t layer_version) {
  const int slot = job.request.layer_slot;
  if (expected_window_id != 0 && expected_window_id != window.id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "accumulation_window_id: the batch names window ", expected_window_id,
        " but the current window of client '", client_id, "' for layer ",
        settings_[static_cast<std::size_t>(slot)].index, " is ", window.id, " of server instance ",
        instance_id_, " (the window was zeroed or fetched-and-zeroed, or the server restarted)"));
  }
  bool counts = false;
  if (window.batch_ids.count(batch_id) != 0) {
    job.admission.accumulate = false;  // computed (the response is answered again), not added
  } else {
    if (!window.batch_ids.empty() && window.weights_version != layer_version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "weights: accumulation window ", window.id, " holds gradients of weights version ",
          window.weights_version, " but the weights are now version ", layer_version,
          "; fetch-and-zero or zero the window before accumulating against the new weights"));
    }
    ATTNGRAD_RETURN_IF_ERROR(TakeAccumulatorSetLocked(window));
    window.weights_version = layer_version;
    window.batch_ids.insert(batch_id);
    counts = true;
  }
  job.admission.accumulator_set = window.accumulator_set < 0 ? 0 : window.accumulator_set;
  return counts;
}

absl::Status GradientCore::TakeAccumulatorSetLocked(Window& window) {
  if (window.accumulator_set >= 0) return absl::OkStatus();
  LayerState& layer = layers_[static_cast<std::size_t>(window.slot)];
  if (layer.free_accumulator_sets.empty()) {
    return absl::ResourceExhaustedError(
        "ACCUMULATE: every accumulator set is held by another client's window "
        "(--max_clients_with_sums); retry after some client fetches-and-zeroes or zeroes its "
        "window, or send RETURN batches");
  }
  window.accumulator_set = layer.free_accumulator_sets.back();
  layer.free_accumulator_sets.pop_back();
  return absl::OkStatus();
}

void GradientCore::CountWhenDone(BatchJob& job, std::shared_ptr<Window> window,
                                 std::uint64_t batch_id) {
  auto on_done = std::move(job.on_done);
  job.on_done = [this, window = std::move(window), batch_id,
                 on_done = std::move(on_done)](std::unique_ptr<BatchJob> done) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!done->result.status.ok()) {
        window->batch_ids.erase(batch_id);  // not accumulated: a retry must count
      } else {
        ++window->batches;
        window->tokens += done->tokens();
        UpdateGaugesLocked();
      }
    }
    on_done(std::move(done));
  };
}

absl::StatusOr<std::uint64_t> GradientCore::ReplaceWeights(int slot, LayerWeights weights,
                                                           std::uint64_t expected_version) {
  const LayerConfig& config = configs_[static_cast<std::size_t>(slot)];
  if (weights.on_device()) {
    // Checked for shape and finiteness when they were copied (devices/device_weights.h).
    ATTNGRAD_RETURN_IF_ERROR(CheckEveryWorkerOnGpu());
  } else {
    ATTNGRAD_RETURN_IF_ERROR(CheckShapes(weights.values, config));
    for (Weight weight : kAllWeights) {
      ATTNGRAD_RETURN_IF_ERROR(wire::CheckFinite(weights.values[weight], WeightModuleName(weight)));
    }
  }
  weights.config = config;
  auto shared = std::make_shared<const LayerWeights>(std::move(weights));
  std::lock_guard<std::mutex> lock(mutex_);
  LayerState& layer = layers_[static_cast<std::size_t>(slot)];
  if (expected_version != 0 && expected_version != layer.weights_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "expected_weights_version: the upload expects to replace version ", expected_version,
        " but layer ", settings_[static_cast<std::size_t>(slot)].index, " has version ",
        layer.weights_version));
  }
  ++layer.weights_version;
  layer.weights = shared;
  for (auto& worker : workers_) {
    WorkerControl control;
    control.layer_slot = slot;
    control.new_weights = shared;
    worker->SubmitControl(std::move(control));
  }
  UpdateVersionGaugeLocked();
  return layer.weights_version;
}

absl::Status GradientCore::CheckEveryWorkerOnGpu() const {
  for (const auto& worker : workers_) {
    if (worker->Describe().backend != "cuda") {
      return absl::FailedPreconditionError(absl::StrCat(
          "region: weights in GPU memory can only be served by GPU workers, and this server also "
          "computes on ",
          worker->device(), "; upload the weights' bytes instead"));
    }
  }
  return absl::OkStatus();
}

void GradientCore::Collect(int slot, int accumulator_set, bool read, bool zero,
                           std::function<void(absl::Status, AccumulatorSnapshot)> done) {
  // The caller holds mutex_, which every path that queues work to the workers (Admit,
  // ReplaceWeights, Fetch, Zero) holds while it queues: every worker sees the controls in one
  // global order. The NCCL sum (gpu_worker.cc) relies on that: its collectives must be issued in
  // the same order on every rank.
  struct Gather {
    std::mutex mutex;
    std::size_t remaining;
    std::vector<absl::Status> statuses;          // per worker
    std::vector<AccumulatorSnapshot> snapshots;  // per worker
    std::function<void(absl::Status, AccumulatorSnapshot)> done;
  };
  auto gather = std::make_shared<Gather>();
  gather->remaining = workers_.size();
  gather->statuses.resize(workers_.size());
  gather->snapshots.resize(workers_.size());
  gather->done = std::move(done);
  for (std::size_t index = 0; index < workers_.size(); ++index) {
    WorkerControl control;
    control.layer_slot = slot;
    control.accumulator_set = accumulator_set;
    control.read_accumulators = read;
    control.zero_accumulators = zero;
    control.on_done = [gather, index](absl::Status status, AccumulatorSnapshot snapshot) {
      {
        std::lock_guard<std::mutex> lock(gather->mutex);
        gather->statuses[index] = std::move(status);
        gather->snapshots[index] = std::move(snapshot);
        if (--gather->remaining != 0) return;
      }
      // The last worker to report: combine in worker order, so the sum does not depend on which
      // worker finished first. With NCCL only the root worker's snapshot holds gradients (the
      // NCCL sum over all devices); on the host path each worker's does and they are added here.
      absl::Status combined;
      AccumulatorSnapshot sum;
      bool have_gradients = false;
      for (std::size_t i = 0; i < gather->snapshots.size(); ++i) {
        combined.Update(gather->statuses[i]);
        AccumulatorSnapshot& snapshot = gather->snapshots[i];
        sum.batches += snapshot.batches;
        sum.tokens += snapshot.tokens;
        if (snapshot.gradients[Weight::kQProj].empty())
          continue;  // not read, or a non-root NCCL rank
        if (!have_gradients) {
          sum.gradients = std::move(snapshot.gradients);
          have_gradients = true;
          continue;
        }
        for (Weight weight : kAllWeights) {
          std::vector<float>& into = sum.gradients[weight];
          const std::vector<float>& from = snapshot.gradients[weight];
          for (std::size_t j = 0; j < into.size() && j < from.size(); ++j) into[j] += from[j];
        }
      }
      gather->done(std::move(combined), std::move(sum));
    };
    workers_[index]->SubmitControl(std::move(control));
  }
}

absl::StatusOr<std::shared_ptr<GradientCore::Window>> GradientCore::ExpectedWindowLocked(
    const WindowKey& key, std::uint64_t expected_window_id) {
  ATTNGRAD_ASSIGN_OR_RETURN(std::shared_ptr<Window> window, WindowOfLocked(key));
  if (expected_window_id != 0 && expected_window_id != window->id) {
    return absl::FailedPreconditionError(
        absl::StrCat("expected_window_id: the request names window ", expected_window_id,
                     " but the current window of client '", key.first, "' for layer ",
                     settings_[static_cast<std::size_t>(key.second)].index, " is ", window->id,
                     " of server instance ", instance_id_));
  }
  return window;
}

void GradientCore::Fetch(const std::string& client_id, int slot, bool zero_after_fetch,
                         std::uint64_t expected_window_id,
                         std::function<void(absl::StatusOr<FetchResult>)> done) {
  std::unique_lock<std::mutex> lock(mutex_);
  const WindowKey key{client_id, slot};
  absl::StatusOr<std::shared_ptr<Window>> found = ExpectedWindowLocked(key, expected_window_id);
  if (!found.ok()) {
    lock.unlock();
    done(found.status());
    return;
  }
  const std::shared_ptr<Window> window = *std::move(found);
  const WindowState state = StateOfLocked(*window);
  const int accumulator_set = window->accumulator_set;
  if (zero_after_fetch) StartWindowLocked(key);
  if (accumulator_set < 0) {  // nothing accumulated: zeros, without asking the devices
    lock.unlock();
    FetchResult result;
    result.state = state;
    result.gradients = ZeroWeights<std::vector<float>>(configs_[static_cast<std::size_t>(slot)]);
    done(std::move(result));
    return;
  }
  // Queued under the lock: every batch admitted to this window before is ahead of it on its worker.
  Collect(
      slot, accumulator_set, /*read=*/true, zero_after_fetch,
      [state, done = std::move(done)](absl::Status status, AccumulatorSnapshot snapshot) mutable {
        if (!status.ok()) {
          done(std::move(status));
          return;
        }
        FetchResult result;
        result.state = state;
        result.state.batches = snapshot.batches;
        result.state.tokens = snapshot.tokens;
        result.gradients = std::move(snapshot.gradients);
        done(std::move(result));
      });
}

void GradientCore::Zero(const std::string& client_id, int slot, std::uint64_t expected_window_id,
                        std::function<void(absl::StatusOr<ZeroResult>)> done) {
  std::unique_lock<std::mutex> lock(mutex_);
  const WindowKey key{client_id, slot};
  absl::StatusOr<std::shared_ptr<Window>> found = ExpectedWindowLocked(key, expected_window_id);
  if (!found.ok()) {
    lock.unlock();
    done(found.status());
    return;
  }
  const std::shared_ptr<Window> window = *std::move(found);
  ZeroResult result;
  result.previous = StateOfLocked(*window);
  const int accumulator_set = window->accumulator_set;
  StartWindowLocked(key);
  result.current = StateOfLocked(*windows_[key]);
  if (accumulator_set < 0) {
    lock.unlock();
    done(std::move(result));
    return;
  }
  Collect(
      slot, accumulator_set, /*read=*/false, /*zero=*/true,
      [result, done = std::move(done)](absl::Status status, AccumulatorSnapshot snapshot) mutable {
        if (!status.ok()) {
          done(std::move(status));
          return;
        }
        result.previous.batches = snapshot.batches;
        result.previous.tokens = snapshot.tokens;
        done(std::move(result));
      });
}

}  // namespace attngrad::server
