// The service's state, independent of gRPC: the weights and their version, one accumulation window
// per client (id, weights version, batch ids already accumulated, the accumulator set on the
// devices that holds its sums), the server instance id, and the device workers batches are spread
// over. Every decision that orders batches against weight changes and window changes is made here
// under one mutex, and the matching work is queued to the workers in that same order.
//
// Clients are named by the id the RPC layer authenticated (rpc/auth.h). A client's window takes
// one of the workers' accumulator sets (0 .. max_clients_with_sums-1) at its first counted
// ACCUMULATE batch and gives it back when the window is zeroed (ZeroGradients, fetch-and-zero):
// at most max_clients_with_sums clients hold sums at once, and the devices' accumulator memory is
// that many sets at most (each allocated by the workers when first used).
#ifndef ATTNGRAD_SERVER_GRADIENT_CORE_H_
#define ATTNGRAD_SERVER_GRADIENT_CORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <map>
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
  // Clients whose windows are remembered at most (an empty window of a client is forgotten
  // beyond this; its next call starts a new window id).
  static constexpr std::size_t kMaxClientWindows = 4096;

  // Takes started workers (at least one) that hold `weights`; max_clients_with_sums >= 1.
  GradientCore(std::shared_ptr<const LayerWeights> weights,
               std::vector<std::unique_ptr<DeviceWorker>> workers, ServerMetrics* metrics,
               int max_clients_with_sums = 4);
  ~GradientCore();  // drains and stops the workers

  const LayerConfig& config() const { return config_; }
  const std::string& instance_id() const { return instance_id_; }
  std::uint64_t weights_version() const;
  // The current window of `client_id` (started when the client has none).
  std::uint64_t window_id(const std::string& client_id);
  std::string weights_source() const;
  std::vector<DeviceDescription> Devices() const;

  // Checks the version and window rules, assigns the batch to the least busy worker and queues it.
  // `job->on_done` runs on that worker's thread when the batch is done. ACCUMULATE batches go to
  // `client_id`'s window; those with a batch id already in that window are queued as duplicates
  // (computed, not added). Errors: FAILED_PRECONDITION (expected_weights_version,
  // accumulation_window_id, or weights changed within a non-empty window), RESOURCE_EXHAUSTED
  // (max_clients_with_sums other clients hold sums); nothing is queued then.
  absl::StatusOr<Admission> Admit(std::unique_ptr<BatchJob> job, const std::string& client_id,
                                  std::uint64_t batch_id,
                                  std::uint64_t expected_weights_version,
                                  std::uint64_t expected_window_id);

  // Installs new weights (checked: shapes of config(), every value finite) and bumps the version.
  // FAILED_PRECONDITION when expected_version is not 0 and differs from the current version.
  absl::StatusOr<std::uint64_t> ReplaceWeights(LayerWeights weights, std::uint64_t expected_version);

  // The accumulated sums of `client_id`'s current window (FAILED_PRECONDITION when
  // expected_window_id is not 0 and differs), optionally zeroed atomically (a new window starts).
  // `done` runs on a worker's thread once every device has reported (at once, on the caller's
  // thread, when the window holds no sums). Other clients' windows are not touched.
  void Fetch(const std::string& client_id, bool zero_after_fetch, std::uint64_t expected_window_id,
             std::function<void(absl::StatusOr<FetchResult>)> done);
  void Zero(const std::string& client_id, std::uint64_t expected_window_id,
            std::function<void(absl::StatusOr<ZeroResult>)> done);

 private:
  struct Window {
    std::uint64_t id = 0;
    std::uint64_t weights_version = 0;  // of the batches in it (0 while empty)
    std::unordered_set<std::uint64_t> batch_ids;
    int accumulator_set = -1;  // the workers' set holding its sums; -1 until its first batch
    long long batches = 0;     // for the gauges: completed batches
    long long tokens = 0;
  };

  DeviceWorker& LeastBusyWorker();
  // The client's window, started when it has none (caller holds mutex_). RESOURCE_EXHAUSTED when
  // kMaxClientWindows clients have windows and none of them is empty.
  absl::StatusOr<std::shared_ptr<Window>> WindowOfLocked(const std::string& client_id);
  // Starts a new window for the client; the old one's accumulator set goes back to the free list
  // (caller holds mutex_ and has queued the zeroing of that set).
  void StartWindowLocked(const std::string& client_id);
  // The state of a window before any device reported.
  WindowState StateOfLocked(const Window& window) const;
  void UpdateGaugesLocked();
  // Queues a read/zero control of one accumulator set on every worker (caller holds mutex_: one
  // global order of controls on all workers, which the NCCL collectives need); `done` gets the
  // summed snapshot.
  void Collect(int accumulator_set, bool read, bool zero,
               std::function<void(absl::Status, AccumulatorSnapshot)> done);

  const LayerConfig config_;
  const std::string instance_id_;
  ServerMetrics* const metrics_;
  std::vector<std::unique_ptr<DeviceWorker>> workers_;

  mutable std::mutex mutex_;
  std::shared_ptr<const LayerWeights> weights_;
  std::uint64_t weights_version_ = 1;
  std::map<std::string, std::shared_ptr<Window>> windows_;  // by client id
  std::vector<int> free_accumulator_sets_;                  // back = next taken
  std::uint64_t next_window_id_;
};

// A random 128-bit id in hex (std::random_device).
std::string RandomInstanceId();

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GRADIENT_CORE_H_
