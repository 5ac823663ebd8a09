// The service's state, independent of gRPC: the served decoder layers (a whole model, a range of
// one, or a single layer), each with its weights and their version, one accumulation window per
// client and layer (id, weights version, batch ids already accumulated, the accumulator set on the
// devices that holds its sums), the server instance id, and the device workers batches are spread
// over. Layers are addressed by slot (0 .. layer_count()-1, ascending decoder-layer index); SlotOf
// maps a request's layer index to its slot. Every decision that orders batches against weight
// changes and window changes is made here under one mutex, and the matching work is queued to the
// workers in that same order.
//
// Clients are named by the id the RPC layer authenticated (rpc/auth.h). A client's window of a
// layer takes one of that layer's accumulator sets (0 .. max_clients_with_sums-1) at its first
// counted ACCUMULATE batch and gives it back when the window is zeroed (ZeroGradients,
// fetch-and-zero): per layer at most max_clients_with_sums clients hold sums at once, and the
// devices' accumulator memory is that many sets of each layer at most (each allocated by the
// workers when first used).
#ifndef ATTNGRAD_SERVER_GRADIENT_CORE_H_
#define ATTNGRAD_SERVER_GRADIENT_CORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "metrics/metrics.h"
#include "scheduling/device_worker.h"
#include "weights/model.h"
#include "weights/served_weights.h"

namespace attngrad::server {

// What a fetch or a zero reports about a window.
struct WindowState {
  std::string server_instance_id;
  std::uint64_t window_id = 0;
  std::uint64_t weights_version = 0;
  long long batches = 0;
  long long tokens = 0;
  int layer = 0;  // the decoder layer
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

// A served layer, resolved in one call: its slot (LayerSlots index), its decoder-layer index
// (settings.index) and its constant shape and settings, which GradientCore holds for its lifetime.
struct ResolvedLayer {
  int slot = 0;
  const LayerSettings& settings;
  const LayerConfig& config;
  int index() const { return settings.index; }
};

class GradientCore {
 public:
  // Clients whose windows are remembered at most (an empty window of a client is forgotten
  // beyond this; its next call starts a new window id).
  static constexpr std::size_t kMaxClientWindows = 65536;  // (client, layer) windows

  // A served layer as GetModelInfo reports it.
  struct LayerDescription {
    LayerSettings settings;
    LayerConfig config;
    std::uint64_t weights_version = 0;
    std::string weights_source;
  };

  // Takes started workers (at least one) that hold the weights of `model`'s layers in slot order
  // (LayerSlotsOf(model)); max_clients_with_sums >= 1.
  GradientCore(const ServedModel& model, std::vector<std::unique_ptr<DeviceWorker>> workers,
               ServerMetrics* metrics, int max_clients_with_sums = 4);
  ~GradientCore();  // drains and stops the workers

  // The served layers' weights in slot order (what the workers are made with).
  static LayerSlots LayerSlotsOf(const ServedModel& model);

  int layer_count() const { return static_cast<int>(settings_.size()); }
  // The slot of decoder layer `layer` (unset: the first served layer, slot 0). INVALID_ARGUMENT
  // naming `field` and the layers this server holds when it holds no such layer.
  absl::StatusOr<int> SlotOf(std::optional<int> layer, const std::string& field) const;
  // SlotOf and LayerAt in one call: the slot, index, shape and settings of decoder layer `layer`.
  absl::StatusOr<ResolvedLayer> ResolveLayer(std::optional<int> layer,
                                             const std::string& field) const;
  ResolvedLayer LayerAt(int slot) const {
    return ResolvedLayer{slot, settings(slot), config(slot)};
  }
  // Constant per slot.
  const LayerSettings& settings(int slot) const {
    return settings_[static_cast<std::size_t>(slot)];
  }
  const LayerConfig& config(int slot = 0) const { return configs_[static_cast<std::size_t>(slot)]; }
  const std::string& model_name() const { return model_name_; }
  int num_hidden_layers() const { return num_hidden_layers_; }
  const std::string& instance_id() const { return instance_id_; }
  std::uint64_t weights_version(int slot = 0) const;
  // The current window of `client_id` for the layer (started when the client has none).
  std::uint64_t window_id(const std::string& client_id, int slot = 0);
  std::string weights_source() const;  // of the first layer, or of the model
  std::vector<LayerDescription> Layers() const;
  std::vector<DeviceDescription> Devices() const;

  // Checks the version and window rules of the job's layer (job->request.layer_slot), assigns the
  // batch to the least busy worker and queues it. `job->on_done` runs on that worker's thread when
  // the batch is done. ACCUMULATE batches go to `client_id`'s window; those with a batch id already
  // in that window are queued as duplicates (computed, not added). Errors: FAILED_PRECONDITION
  // (expected_weights_version, accumulation_window_id, or weights changed within a non-empty
  // window), RESOURCE_EXHAUSTED (max_clients_with_sums other clients hold sums); nothing is queued
  // then.
  absl::StatusOr<Admission> Admit(std::unique_ptr<BatchJob> job, const std::string& client_id,
                                  std::uint64_t batch_id, std::uint64_t expected_weights_version,
                                  std::uint64_t expected_window_id);

  // Installs new weights of a layer (checked: shapes of config(slot), every value finite) and bumps
  // its version. FAILED_PRECONDITION when expected_version is not 0 and differs from the layer's,
  // or for weights in GPU memory (LayerWeights::device_values, checked when they were copied)
  // while a worker computes on the CPU.
  absl::StatusOr<std::uint64_t> ReplaceWeights(int slot, LayerWeights weights,
                                               std::uint64_t expected_version);

  // The accumulated sums of `client_id`'s current window (FAILED_PRECONDITION when
  // expected_window_id is not 0 and differs), optionally zeroed atomically (a new window starts).
  // `done` runs on a worker's thread once every device has reported (at once, on the caller's
  // thread, when the window holds no sums). Other clients' windows are not touched.
  void Fetch(const std::string& client_id, int slot, bool zero_after_fetch,
             std::uint64_t expected_window_id,
             std::function<void(absl::StatusOr<FetchResult>)> done);
  void Zero(const std::string& client_id, int slot, std::uint64_t expected_window_id,
            std::function<void(absl::StatusOr<ZeroResult>)> done);

 private:
  // FAILED_PRECONDITION unless every worker computes on a GPU.
  absl::Status CheckEveryWorkerOnGpu() const;
  struct Window {
    int slot = 0;  // the layer
    std::uint64_t id = 0;
    std::uint64_t weights_version = 0;  // of the batches in it (0 while empty)
    std::unordered_set<std::uint64_t> batch_ids;
    int accumulator_set = -1;  // the workers' set holding its sums; -1 until its first batch
    long long batches = 0;     // for the gauges: completed batches
    long long tokens = 0;
  };

  DeviceWorker& LeastBusyWorker();
  // The worker of `device` ("cuda:0"), or null.
  DeviceWorker* WorkerOf(const std::string& device);
  // The worker that computes `job`: its GPU's for a batch in a client's GPU memory, else the least
  // busy (FAILED_PRECONDITION for a GPU this server does not compute on).
  absl::StatusOr<DeviceWorker*> WorkerForLocked(const BatchJob& job);
  // The client's window, started when it has none (caller holds mutex_). RESOURCE_EXHAUSTED when
  // kMaxClientWindows clients have windows and none of them is empty.
  using WindowKey = std::pair<std::string, int>;  // (client id, layer slot)
  absl::StatusOr<std::shared_ptr<Window>> WindowOfLocked(const WindowKey& key);
  // WindowOfLocked, and FAILED_PRECONDITION when expected_window_id (0: any) is not its id.
  absl::StatusOr<std::shared_ptr<Window>> ExpectedWindowLocked(const WindowKey& key,
                                                               std::uint64_t expected_window_id);
  // Starts a new window for the client; the old one's accumulator set goes back to the free list
  // (caller holds mutex_ and has queued the zeroing of that set).
  void StartWindowLocked(const WindowKey& key);
  // An ACCUMULATE batch's place in the client's window: true when it adds to the window's sums
  // (a new batch id, its accumulator set taken), false for a duplicate (computed, not added).
  // FAILED_PRECONDITION for another window or weights changed within a non-empty window.
  absl::StatusOr<bool> AdmitToWindowLocked(BatchJob& job, Window& window,
                                           const std::string& client_id, std::uint64_t batch_id,
                                           std::uint64_t expected_window_id,
                                           std::uint64_t layer_version);
  // Gives the window an accumulator set of its layer (RESOURCE_EXHAUSTED when none is free).
  absl::Status TakeAccumulatorSetLocked(Window& window);
  // Counts the batch into the window when it is done, or forgets its id when it failed (a retry
  // must count).
  void CountWhenDone(BatchJob& job, std::shared_ptr<Window> window, std::uint64_t batch_id);
  // The state of a window before any device reported.
  WindowState StateOfLocked(const Window& window) const;
  void UpdateGaugesLocked();
  // Queues a read/zero control of one accumulator set on every worker (caller holds mutex_: one
  // global order of controls on all workers, which the NCCL collectives need); `done` gets the
  // summed snapshot.
  void Collect(int slot, int accumulator_set, bool read, bool zero,
               std::function<void(absl::Status, AccumulatorSnapshot)> done);

  // What changes of a layer (under mutex_).
  struct LayerState {
    std::shared_ptr<const LayerWeights> weights;
    std::uint64_t weights_version = 1;
    std::vector<int> free_accumulator_sets;  // back = next taken
  };
  void UpdateVersionGaugeLocked();

  const std::vector<LayerSettings> settings_;  // by slot
  const std::vector<LayerConfig> configs_;     // by slot
  const std::string model_name_;
  const int num_hidden_layers_;
  const std::string instance_id_;
  ServerMetrics* const metrics_;
  std::vector<std::unique_ptr<DeviceWorker>> workers_;

  mutable std::mutex mutex_;
  std::vector<LayerState> layers_;  // by slot
  std::map<WindowKey, std::shared_ptr<Window>> windows_;
  std::uint64_t next_window_id_;
};

// A random 128-bit id in hex (std::random_device).
std::string RandomInstanceId();

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GRADIENT_CORE_H_
