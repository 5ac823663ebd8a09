// Admission, weights versions, accumulation windows and the cross-device sums (the devices'
// snapshots combined in worker order; with NCCL the root worker's snapshot already holds the sum).
#include "scheduling/gradient_core.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attngrad/wire/status_macros.h"
#include "attngrad/wire/tensor.h"

namespace attngrad::server {

std::string RandomInstanceId() {
  std::random_device device;
  std::uint64_t high = (static_cast<std::uint64_t>(device()) << 32) | device();
  std::uint64_t low = (static_cast<std::uint64_t>(device()) << 32) | device();
  return absl::StrFormat("%016x%016x", high, low);
}

GradientCore::GradientCore(std::shared_ptr<const LayerWeights> weights,
                           std::vector<std::unique_ptr<DeviceWorker>> workers,
                           ServerMetrics* metrics, int max_clients_with_sums)
    : config_(weights->config),
      instance_id_(RandomInstanceId()),
      metrics_(metrics),
      workers_(std::move(workers)),
      weights_(std::move(weights)) {
  // Window ids start at a random point (below 2^52, so they stay exact as JSON numbers), so a
  // window id of an earlier server instance is refused by a restarted server rather than matched.
  std::random_device device;
  next_window_id_ = ((static_cast<std::uint64_t>(device()) << 32 | device()) & ((1ull << 51) - 1)) + 1;
  for (int set = std::max(1, max_clients_with_sums) - 1; set >= 0; --set) {
    free_accumulator_sets_.push_back(set);  // set 0 is taken first
  }
  std::lock_guard<std::mutex> lock(mutex_);
  metrics_->weights_version().Set(static_cast<double>(weights_version_));
  UpdateGaugesLocked();
}

GradientCore::~GradientCore() {
  for (auto& worker : workers_) worker->StopAndJoin();
}

std::uint64_t GradientCore::weights_version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return weights_version_;
}

std::uint64_t GradientCore::window_id(const std::string& client_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  absl::StatusOr<std::shared_ptr<Window>> window = WindowOfLocked(client_id);
  return window.ok() ? (*window)->id : 0;
}

std::string GradientCore::weights_source() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return weights_->source;
}

std::vector<DeviceDescription> GradientCore::Devices() const {
  std::vector<DeviceDescription> devices;
  for (const auto& worker : workers_) devices.push_back(worker->Describe());
  return devices;
}

absl::StatusOr<std::shared_ptr<GradientCore::Window>> GradientCore::WindowOfLocked(
    const std::string& client_id) {
  auto found = windows_.find(client_id);
  if (found != windows_.end()) return found->second;
  if (windows_.size() >= kMaxClientWindows) {
    // Forget one empty window (its client starts a new window id at its next call).
    auto empty = std::find_if(windows_.begin(), windows_.end(), [](const auto& entry) {
      return entry.second->accumulator_set < 0 && entry.second->batch_ids.empty();
    });
    if (empty == windows_.end()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "accumulation windows: ", windows_.size(), " clients hold windows with sums; fetch-and-"
          "zero or zero some of them"));
    }
    windows_.erase(empty);
  }
  StartWindowLocked(client_id);
  return windows_[client_id];
}

void GradientCore::StartWindowLocked(const std::string& client_id) {
  std::shared_ptr<Window>& slot = windows_[client_id];
  if (slot != nullptr && slot->accumulator_set >= 0) {
    free_accumulator_sets_.push_back(slot->accumulator_set);
  }
  auto window = std::make_shared<Window>();
  window->id = next_window_id_++;
  slot = std::move(window);
  metrics_->accumulation_window_id().Set(static_cast<double>(slot->id));
  UpdateGaugesLocked();
}

WindowState GradientCore::StateOfLocked(const Window& window) const {
  WindowState state;
  state.server_instance_id = instance_id_;
  state.window_id = window.id;
  state.weights_version = window.batch_ids.empty() ? weights_version_ : window.weights_version;
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

absl::StatusOr<Admission> GradientCore::Admit(std::unique_ptr<BatchJob> job,
                                              const std::string& client_id,
                                              std::uint64_t batch_id,
                                              std::uint64_t expected_weights_version,
                                              std::uint64_t expected_window_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (expected_weights_version != 0 && expected_weights_version != weights_version_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "expected_weights_version: the request expects weights version ", expected_weights_version,
        " but the server has version ", weights_version_,
        " (the weights were replaced, or the server restarted; see GetModelInfo)"));
  }
  Admission admission;
  admission.weights_version = weights_version_;
  bool counts = false;  // a new batch of the window: it adds to the accumulators
  std::shared_ptr<Window> window;
  if (job->accumulate) {
    ATTNGRAD_ASSIGN_OR_RETURN(window, WindowOfLocked(client_id));
    if (expected_window_id != 0 && expected_window_id != window->id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "accumulation_window_id: the batch names window ", expected_window_id,
          " but the current window of client '", client_id, "' is ", window->id,
          " of server instance ", instance_id_,
          " (the window was zeroed or fetched-and-zeroed, or the server restarted)"));
    }
    if (window->batch_ids.count(batch_id) != 0) {
      admission.duplicate = true;
      job->accumulate = false;  // computed (the response is answered again), not added
    } else {
      if (!window->batch_ids.empty() && window->weights_version != weights_version_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "weights: accumulation window ", window->id, " holds gradients of weights version ",
            window->weights_version, " but the weights are now version ", weights_version_,
            "; fetch-and-zero or zero the window before accumulating against the new weights"));
      }
      if (window->accumulator_set < 0) {
        if (free_accumulator_sets_.empty()) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "ACCUMULATE: every accumulator set is held by another client's window "
              "(--max_clients_with_sums); retry after some client fetches-and-zeroes or zeroes "
              "its window, or send RETURN batches"));
        }
        window->accumulator_set = free_accumulator_sets_.back();
        free_accumulator_sets_.pop_back();
      }
      window->weights_version = weights_version_;
      window->batch_ids.insert(batch_id);
      counts = true;
    }
    admission.window_id = window->id;
    job->accumulator_set = window->accumulator_set < 0 ? 0 : window->accumulator_set;
  }
  if (counts) {
    auto on_done = std::move(job->on_done);
    job->on_done = [this, window, batch_id, on_done = std::move(on_done)](std::unique_ptr<BatchJob> done) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!done->status.ok()) {
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
  job->weights_version = admission.weights_version;
  job->window_id = admission.window_id;
  job->duplicate = admission.duplicate;
  LeastBusyWorker().Submit(std::move(job));
  return admission;
}

absl::StatusOr<std::uint64_t> GradientCore::ReplaceWeights(LayerWeights weights,
                                                           std::uint64_t expected_version) {
  ATTNGRAD_RETURN_IF_ERROR(CheckShapes(weights.values, config_));
  for (Weight weight : kAllWeights) {
    ATTNGRAD_RETURN_IF_ERROR(wire::CheckFinite(weights.values[weight], WeightModuleName(weight)));
  }
  weights.config = config_;
  auto shared = std::make_shared<const LayerWeights>(std::move(weights));
  std::lock_guard<std::mutex> lock(mutex_);
  if (expected_version != 0 && expected_version != weights_version_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "expected_weights_version: the upload expects to replace version ", expected_version,
        " but the server has version ", weights_version_));
  }
  ++weights_version_;
  weights_ = shared;
  for (auto& worker : workers_) {
    WorkerControl control;
    control.new_weights = shared;
    worker->SubmitControl(std::move(control));
  }
  metrics_->weights_version().Set(static_cast<double>(weights_version_));
  return weights_version_;
}

void GradientCore::Collect(int accumulator_set, bool read, bool zero,
                           std::function<void(absl::Status, AccumulatorSnapshot)> done) {
  // The caller holds mutex_, which every path that queues work to the workers (Admit,
  // ReplaceWeights, Fetch, Zero) holds while it queues: every worker sees the controls in one
  // global order. The NCCL sum (gpu_worker.cc) relies on that: its collectives must be issued in
  // the same order on every rank.
  struct Gather {
    std::mutex mutex;
    std::size_t remaining;
    std::vector<absl::Status> statuses;         // per worker
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
        if (snapshot.gradients[Weight::kQProj].empty()) continue;  // not read, or a non-root NCCL rank
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

void GradientCore::Fetch(const std::string& client_id, bool zero_after_fetch,
                         std::uint64_t expected_window_id,
                         std::function<void(absl::StatusOr<FetchResult>)> done) {
  std::unique_lock<std::mutex> lock(mutex_);
  absl::StatusOr<std::shared_ptr<Window>> found = WindowOfLocked(client_id);
  if (!found.ok()) {
    lock.unlock();
    done(found.status());
    return;
  }
  const std::shared_ptr<Window> window = *std::move(found);
  if (expected_window_id != 0 && expected_window_id != window->id) {
    const std::uint64_t current = window->id;
    lock.unlock();
    done(absl::FailedPreconditionError(absl::StrCat(
        "expected_window_id: the fetch names window ", expected_window_id,
        " but the current window of client '", client_id, "' is ", current,
        " of server instance ", instance_id_)));
    return;
  }
  const WindowState state = StateOfLocked(*window);
  const int accumulator_set = window->accumulator_set;
  if (zero_after_fetch) StartWindowLocked(client_id);
  if (accumulator_set < 0) {  // nothing accumulated: zeros, without asking the devices
    lock.unlock();
    FetchResult result;
    result.state = state;
    result.gradients = ZeroWeights<std::vector<float>>(config_);
    done(std::move(result));
    return;
  }
  // Queued under the lock: every batch admitted to this window before is ahead of it on its worker.
  Collect(accumulator_set, /*read=*/true, zero_after_fetch,
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

void GradientCore::Zero(const std::string& client_id, std::uint64_t expected_window_id,
                        std::function<void(absl::StatusOr<ZeroResult>)> done) {
  std::unique_lock<std::mutex> lock(mutex_);
  absl::StatusOr<std::shared_ptr<Window>> found = WindowOfLocked(client_id);
  if (!found.ok()) {
    lock.unlock();
    done(found.status());
    return;
  }
  const std::shared_ptr<Window> window = *std::move(found);
  if (expected_window_id != 0 && expected_window_id != window->id) {
    const std::uint64_t current = window->id;
    lock.unlock();
    done(absl::FailedPreconditionError(absl::StrCat(
        "expected_window_id: the request names window ", expected_window_id,
        " but the current window of client '", client_id, "' is ", current,
        " of server instance ", instance_id_)));
    return;
  }
  ZeroResult result;
  result.previous = StateOfLocked(*window);
  const int accumulator_set = window->accumulator_set;
  StartWindowLocked(client_id);
  result.current = StateOfLocked(*windows_[client_id]);
  if (accumulator_set < 0) {
    lock.unlock();
    done(std::move(result));
    return;
  }
  Collect(accumulator_set, /*read=*/false, /*zero=*/true,
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
