// A device worker: one thread that owns one device (a GPU or the CPU), its resident copy of the
// weights and its weight-gradient accumulator sets (one per client window holding sums, each
// allocated when first used), and computes the batches queued to it in order.
// gRPC threads only queue work here (Submit/SubmitControl never block on computation); a control
// (new weights, read/zero the accumulators) runs after every batch queued before it, which is what
// makes weight versions and accumulation windows exact.
#ifndef ATTNGRAD_SERVER_DEVICE_WORKER_H_
#define ATTNGRAD_SERVER_DEVICE_WORKER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "attngrad/backward.h"
#include "attngrad/common/buffer_pool.h"
#include "metrics/metrics.h"
#include "scheduling/memory_budget.h"
#include "scheduling/wire_tensor.h"
#include "weights/served_weights.h"

namespace attngrad::server {

// The weights of the layers a server holds, by slot (0 .. count-1: GradientCore's order of the
// served decoder layers). Every worker holds all of them; batches and controls name a slot.
using LayerSlots = std::vector<std::shared_ptr<const LayerWeights>>;

// The answer's tensors in the response dtype, as the worker wrote them: grad_hidden_states
// [B,S,hidden], then (RETURN) the six weight gradients in kAllWeights order. Sent as it is (gRPC
// slices of this memory); holds the batch's share of the in-flight memory budget until then. The
// memory comes from the worker's answer pool (common::BufferPool), to which it goes back once sent:
// a fresh 100 MB answer (RETURN's weight gradients) costs more in page faults than in copying.
// Free answer memory a worker's pool keeps for reuse (beyond the in-flight budget).
inline constexpr std::size_t kAnswerPoolBytes = std::size_t{1} << 30;

struct AnswerBuffer {
  common::BufferPool::Buffer bytes;  // uninitialised until the worker writes it
  std::size_t size = 0;
  MemoryBudget::Reservation reservation;
};

// What a batch computes (attngrad.v1.Computation).
enum class Computation {
  kBackward,  // grad_hidden_states and the weight gradients from hidden_states and grad_output
  kForward,   // the layer's output A Wo^T from hidden_states alone (attngrad/forward.h)
};

// One batch, owned by whoever holds the pointer: its activations as they arrived (copied once by
// the worker, to where the computation reads them), fp32 rotary tables, and the answer the worker
// writes in the response dtype. Its fields are grouped by who writes and who reads them.
struct BatchJob {
  // Written by the request parser (rpc/backward_request.cc, rpc/regions.cc; layer_slot by the
  // Backward reactor), read by GradientCore's admission and the worker.
  struct Request {
    // kForward: grad_output is empty, accumulate and return_weight_gradients are false, and the
    // answer's [B,S,hidden] tensor (the answer buffer's first, grad_hidden_states_destination) is
    // the layer's output instead of grad_hidden_states.
    Computation computation = Computation::kBackward;
    int batch = 0;
    int seq_len = 0;
    int layer_slot = 0;  // which served layer (LayerSlots index)
    LayerConfig config;  // its shape (the answer's tensor shapes)
    Scalars scalars;
    Precision precision = Precision::kAuto;
    // Return this batch's weight gradients in `weight_gradients` (RETURN mode). When neither this
    // nor Admitted::accumulate is set (an ACCUMULATE duplicate), the weight gradients are computed
    // into scratch and dropped.
    bool return_weight_gradients = false;
    // [B,S,hidden] in a wire dtype each. Their values are checked to be finite where the worker
    // copies them (a batch with an Inf or NaN fails with INVALID_ARGUMENT naming the element).
    WireTensor hidden_states, grad_output;
    std::vector<float> cos, sin;        // [B,S,head_dim]; empty when they are in GPU memory:
    WireTensor device_cos, device_sin;  // fp32 [B,S,head_dim] in a client's GPU memory (CUDA IPC)
    int response_dtype = 1;             // attngrad.v1.DType of the answer (FLOAT32 = 1)
    // Same-host zero-copy over CUDA IPC (rpc/regions.h): hidden_states / grad_output may be GPU
    // memory (WireTensor::OnDevice), read there by the GPU worker of their device; and
    // grad_hidden_states (FORWARD: the output) may go to GPU memory instead of the answer buffer
    // (response_dtype, activations() elements), written there by that worker before the job is
    // finished.
    struct DeviceDestination {
      char* data = nullptr;  // null: grad_hidden_states is in the answer buffer
      std::size_t size = 0;
      int cuda_device = -1;
      std::shared_ptr<const void> owner;  // keeps the memory open
    };
    DeviceDestination grad_hidden_states_destination;
    // RETURN: the weight gradients (response_dtype, PackedWeightLayout order) into GPU memory
    // instead of the answer buffer, the same way.
    DeviceDestination weight_gradients_destination;
    // A batch ordered by the caller's CUDA stream (BackwardRequest.stream_order): computed once the
    // 32-bit word at `ready` (GPU memory of the job's device) reaches `value`, after which `value`
    // is written to `done`, behind the batch's last write into the caller's memory.
    // ready == nullptr: computed as it arrives. A gate still closed at `deadline` fails the batch
    // (DEADLINE_EXCEEDED).
    struct StreamGate {
      char* ready = nullptr;
      char* done = nullptr;
      std::uint32_t value = 0;
      std::chrono::steady_clock::time_point deadline;
      std::shared_ptr<const void> ready_owner, done_owner;  // keep the memory open
    };
    StreamGate stream_gate;
  };
  Request request;

  // Written by GradientCore::Admit before the job is queued (accumulate: set by the parser from
  // the mode, cleared for a duplicate), read by the worker and the Backward reactor's answer.
  struct Admitted {
    std::uint64_t weights_version = 0;
    std::uint64_t window_id = 0;  // ACCUMULATE: the window the batch belongs to
    bool duplicate = false;       // ACCUMULATE: already in the window, not added again
    // Add this batch's weight gradients to the worker's accumulator set `accumulator_set`.
    bool accumulate = false;
    int accumulator_set = 0;  // one per client window holding sums (GradientCore assigns them)
  };
  Admitted admission;

  // Written by the Backward reactor on the thread that received the request, read (and given
  // back) by the worker.
  struct Arrival {
    // Set (to true) by the Backward reactor once the stream that sent the batch is cancelled or
    // its client gone: nobody reads the batch's answer any more. Null: not sent on such a stream.
    std::shared_ptr<const std::atomic<bool>> stream_cancelled;
    // The budget reservation of the received request, given back when the worker has copied it.
    MemoryBudget::Reservation request_reservation;
    // GPU servers: the host inputs copied on arrival, by the thread that received them, into
    // page-locked memory in the staging layout (scheduling/staging.h), from which the GPU copies
    // them; hidden_states and grad_output then keep their dtypes but no bytes. Empty otherwise
    // (the worker stages them itself).
    common::BufferPool::Buffer staged_inputs;
  };
  Arrival arrival;

  // Written by the worker (submitted by DeviceWorker::Submit; answer.reservation by the Backward
  // reactor), read by the Backward reactor for the answer.
  struct Result {
    AnswerBuffer answer;
    absl::Status status;
    std::string device;
    StageSeconds stages;
    std::chrono::steady_clock::time_point submitted;
  };
  Result result;

  // Called exactly once, on the worker's thread, when the job is finished (status says how).
  std::function<void(std::unique_ptr<BatchJob>)> on_done;

  long long tokens() const { return static_cast<long long>(request.batch) * request.seq_len; }
  // Elements of one activation tensor, B*S*hidden.
  std::size_t activations() const {
    return static_cast<std::size_t>(tokens()) *
           static_cast<std::size_t>(request.config.hidden_size);
  }
  bool forward() const { return request.computation == Computation::kForward; }
  // Whether nobody can ever observe what computing the batch would give: its stream was cancelled
  // (stream_cancelled), it adds nothing to an accumulation window (RETURN, FORWARD, an ACCUMULATE
  // duplicate: the answer is its only result) and no client's CUDA stream waits for its `done`
  // word (stream_gate). An ACCUMULATE batch that counts is always observed: a retry of it on
  // another stream may already have been answered as its duplicate, so the window needs it.
  bool Unobservable() const;
  // Bytes of the answer: grad_hidden_states (FORWARD: the output) and, RETURN, the weight
  // gradients, in response_dtype.
  std::size_t AnswerBytes() const;
  // The CUDA device of the job's GPU memory (CUDA IPC tensors or destination), which the job must
  // run on; -1 when it has none. The parser makes sure that they are all on one device.
  int cuda_device() const;
};

// What one of a worker's accumulator sets holds: the sums and what they cover.
struct AccumulatorSnapshot {
  LayerTensors gradients;  // empty arrays unless read_accumulators was asked for
  long long batches = 0;   // always reported
  long long tokens = 0;
};

// A control operation, ordered with the batches.
struct WorkerControl {
  int layer_slot = 0;                               // the served layer it addresses
  std::shared_ptr<const LayerWeights> new_weights;  // set: replace that layer's weights
  int accumulator_set = 0;                          // which of its sets reads and zeroes address
  bool read_accumulators = false;                   // copy them out into the snapshot
  bool zero_accumulators = false;                   // then zero them
  std::function<void(absl::Status, AccumulatorSnapshot)> on_done;  // on the worker's thread
};

// A device as GetModelInfo reports it (kept current by the worker's thread).
struct DeviceDescription {
  int index = 0;
  std::string name;
  std::string backend;  // "cuda" or "cpu"
  long long memory_total_bytes = 0;
  long long memory_used_bytes = 0;
  bool stream_ordered_batches = false;  // BatchJob::Request::stream_gate is honoured
};

class DeviceWorker {
 public:
  virtual ~DeviceWorker();
  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;

  // "cpu", "cuda:0", ...: the metrics' device label.
  const std::string& device() const { return device_; }

  // Starts the thread and waits for the device to be set up (weights uploaded, buffers allocated).
  absl::Status Start();
  // Lets the queue drain (every queued batch and control runs and calls back), then joins.
  void StopAndJoin();

  void Submit(std::unique_ptr<BatchJob> job);
  void SubmitControl(WorkerControl control);
  // Batches queued or being computed here (the scheduler sends new batches to the least busy).
  std::size_t Outstanding() const;
  // Batches finished CANCELLED without being computed since the start (SkipIfUnobservable).
  long long skipped_batches() const { return skipped_batches_.load(); }

  virtual DeviceDescription Describe() const = 0;

 protected:
  DeviceWorker(std::string device, ServerMetrics* metrics, int pipeline_depth);

  struct Item {
    std::unique_ptr<BatchJob> job;         // a batch, or
    std::optional<WorkerControl> control;  // a control
  };

  // Sets the device up on the worker's thread (called once before Run).
  virtual absl::Status Initialize() = 0;
  // The thread body: Pop items until Pop(true) returns nothing, which happens once stopping and
  // the queue is empty; every job must go through FinishJob and every control through
  // FinishControl.
  virtual void Run() = 0;

  // The next item; with wait, blocks until there is one (nothing = stop); without, returns nothing
  // at once when the queue is empty.
  std::optional<Item> Pop(bool wait);
  // The next item, waiting at most `timeout` for one (nothing: none came).
  std::optional<Item> PopWithin(std::chrono::microseconds timeout);
  // Records metrics and hands the job back (status set by the caller).
  void FinishJob(std::unique_ptr<BatchJob> job);
  // Finishes `job` CANCELLED without computing it when it is BatchJob::Unobservable, so that a
  // cancelled stream's queued RETURN batches do not hold the worker (and the reactor, and a
  // shutdown, that wait for them): true then (the job is gone); false, the job kept, otherwise.
  bool SkipIfUnobservable(std::unique_ptr<BatchJob>& job);
  static void FinishControl(WorkerControl& control, absl::Status status,
                            AccumulatorSnapshot snapshot);

  ServerMetrics* metrics() const { return metrics_; }
  int pipeline_depth() const { return pipeline_depth_; }

 private:
  void ThreadMain(std::promise<absl::Status>* started);
  std::optional<Item> PopLocked();  // mutex_ held

  const std::string device_;
  ServerMetrics* const metrics_;
  const int pipeline_depth_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Item> queue_;
  std::size_t outstanding_ = 0;  // batches queued + in progress
  std::size_t queued_jobs_ = 0;  // batches queued
  std::atomic<long long> skipped_batches_{0};
  bool stopping_ = false;
  std::thread thread_;
};

// Maps a kernel status to an absl::Status naming what failed.
absl::Status KernelStatus(const Status& status, const std::string& what);

double SecondsSince(std::chrono::steady_clock::time_point start);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_DEVICE_WORKER_H_
