// The service's state, independent of gRPC: the weights and their version, the accumulation window
// (id, weights version, batch ids already accumulated), the server instance id, and the device
// workers batches are spread over. Every decision that orders batches against weight changes and
// window changes is made here under one mutex, and the matching work is queued to the workers in
// that same order.
#ifndef ATTNGRAD_SERVER_GRADIENT_CORE_H_
#define ATTNGRAD_SERVER_GRADIENT_CORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "scheduling/device_worker.h"
#include "weights/layer_weights.h"
#include "metrics/metrics.h"

namespace attngrad::server {

// What a fetch or a zero reports about a window.
struct WindowState {
  std::string server_instance_id;
  std::uint64_t window_id = 0;
  std::uint64_t weights_version = 0;
  long long batches = 0;
  long long tokens = 0;
};

struct FetchResult {
  WindowState state;
  LayerTensors gradients;  // summed over the devices
};

struct ZeroResult {
  WindowState previous;
  WindowState current;
};

// How a batch was taken in.
struct Admission {
  std::uint64_t weights_version = 0;
  std::uint64_t window_id = 0;  // ACCUMULATE only
  bool duplicate = false;       // ACCUMULATE: already in this window; computed but not added
};

class GradientCore {
 public:
  // Takes started workers (at least one) that hold `weights`.
  GradientCore(std::shared_ptr<const LayerWeights> weights,
               std::vector<std::unique_ptr<DeviceWorker>> workers, ServerMetrics* metrics);
  ~GradientCore();  // drains and stops the workers

  const LayerConfig& config() const { return config_; }
  const std::string& instance_id() const { return instance_id_; }
  std::uint64_t weights_version() const;
  std::uint64_t window_id() const;
  std::string weights_source() const;
  std::vector<DeviceDescription> Devices() const;

  // Checks the version and window rules, assigns the batch to the least busy worker and queues it.
  // `job->on_done` runs on that worker's thread when the batch is done. ACCUMULATE batches with a
  // batch id already in the window are queued as duplicates (computed, not added). Errors:
  // FAILED_PRECONDITION (expected_weights_version, accumulation_window_id, or weights changed
  // within a non-empty window); nothing is queued then.
  absl::StatusOr<Admission> Admit(std::unique_ptr<BatchJob> job, std::uint64_t batch_id,
                                  std::uint64_t expected_weights_version,
                                  std::uint64_t expected_window_id);

  // Installs new weights (checked: shapes of config(), every value finite) and bumps the version.
  // FAILED_PRECONDITION when expected_version is not 0 and differs from the current version.
  absl::StatusOr<std::uint64_t> ReplaceWeights(LayerWeights weights, std::uint64_t expected_version);

  // The accumulated sums of the current window (FAILED_PRECONDITION when expected_window_id is not
  // 0 and differs), optionally zeroed atomically (a new window starts). `done` runs on a worker's
  // thread once every device has reported.
  void Fetch(bool zero_after_fetch, std::uint64_t expected_window_id,
             std::function<void(absl::StatusOr<FetchResult>)> done);
  void Zero(std::uint64_t expected_window_id, std::function<void(absl::StatusOr<ZeroResult>)> done);

 private:
  struct Window {
    std::uint64_t id = 0;
    std::uint64_t weights_version = 0;  // of the batches in it (0 while empty)
    std::unordered_set<std::uint64_t> batch_ids;
  };

  DeviceWorker& LeastBusyWorker();
  // Starts a new window (caller holds mutex_).
  void StartWindowLocked();
  // Queues a read/zero control on every worker (caller holds mutex_: one global order of
  // controls on all workers, which the NCCL collectives need); `done` gets the summed snapshot.
  void Collect(bool read, bool zero,
               std::function<void(absl::Status, AccumulatorSnapshot)> done);

  const LayerConfig config_;
  const std::string instance_id_;
  ServerMetrics* const metrics_;
  std::vector<std::unique_ptr<DeviceWorker>> workers_;

  mutable std::mutex mutex_;
  std::shared_ptr<const LayerWeights> weights_;
  std::uint64_t weights_version_ = 1;
  std::shared_ptr<Window> window_;
  std::uint64_t next_window_id_;
  long long window_batches_ = 0;  // for the gauges: completed batches of the current window
  long long window_tokens_ = 0;
};

// A random 128-bit id in hex (std::random_device).
std::string RandomInstanceId();

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GRADIENT_CORE_H_
