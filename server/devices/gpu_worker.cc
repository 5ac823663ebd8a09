// GPU device worker. Everything CUDA happens on the worker's own thread. Per device: fp32 resident
// weights, weight-gradient accumulator sets (one per client window holding sums, allocated when a
// batch or a control first addresses it), one device workspace, and three streams (all owned by
// the types of attngrad/cuda_resources.h, released when the worker's thread drops them):
// copy-in, compute and copy-out. Each batch in flight owns a slot (pinned host staging buffers,
// device input/output buffers, timing events); with three slots the copy-in of batch n+1, the
// compute of batch n and the copy-out of batch n-1 overlap. The host side of a batch is one copy
// in and none out: the activations go from gRPC's receive slices into page-locked staging as
// they arrived (fp32/fp16/bf16; fp16/bf16 widened on the GPU, wire_convert.h), copied on arrival
// by the receiving thread (BatchJob::Arrival::staged_inputs, scheduling/staging.h; the copies of
// several streams run at once) or else here, in parallel on the worker's copy threads, into the
// slot's staging; the answer, in the response dtype (narrowed on the GPU), is copied by the GPU
// straight into the job's answer buffer, page-locked memory of the worker's pool
// (devices/pinned_pool.h), which gRPC sends as it is. Kernels run in order on the compute stream,
// so the accumulators and the shared workspace need no further synchronisation. Every batch
// computes its weight gradients into its slot's buffer; the finite check (attngrad/finite_check.h)
// then counts their NaN/Inf values on the device and, for ACCUMULATE, adds them to the client's
// accumulator set only when there are none.
//
// Resident weights: per served layer, the fp32 weights and their fp16 copies (a PreparedWeights,
// attngrad/prepared_weights.h), made at startup and again, in the same memory, whenever the layer
// gets a new version (a control, with nothing in flight); every batch reads them, so no batch
// converts weights. A layer whose upload or preparation failed refuses its batches until a new
// version uploads (ResidentLayer::resident), so no batch ever sees a stale or partial copy.
//
// Cross-device sums at a fetch (a control that reads the accumulators): with two or more workers
// and NCCL usable, each worker, on its own thread and its own NCCL stream, calls ncclReduce (sum,
// fp32, root = the first worker) of its accumulator buffer into the root's receive buffer, and
// only the root copies the sum to the host; the others report their batch and token counts. The
// reduction of a fixed communicator and size is deterministic (NCCL picks the same algorithm and
// order every time), so equal accumulators give bit-equal sums. Collectives must be issued in the
// same order on every rank: GradientCore queues every control to all workers under one mutex, so
// each worker meets the reads in the same global order, and a worker blocks in a collective only
// once every worker has reached that same control (a host barrier before it, which also lets a
// worker whose device failed earlier call the reduction off for everyone instead of leaving the
// others waiting inside NCCL). The accumulators are zeroed (fetch-and-zero) only after a second
// barrier has confirmed that every worker's part succeeded; when one failed, none zeroes. A rank
// does not block in the reduction: it polls (nccl_abort.h), and a part that fails or hangs aborts
// every rank's communicator; from then on fetches sum on the host.
// Without NCCL (one device, no nccl.h at build time, no libnccl.so.2 at run time, --nccl=off)
// every worker copies its accumulators to the host and GradientCore adds them in worker order.
#include "devices/gpu_worker.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attngrad/common/parallel_tasks.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/cuda_resources.h"
#include "attngrad/forward.h"
#include "attngrad/prepared_weights.h"
#include "attngrad/v1/tensor.pb.h"
#include "attngrad/wire/dtype.h"
#include "devices/cuda_ipc_memory.h"
#include "devices/cuda_status.h"
#include "devices/nccl_abort.h"
#include "devices/nccl_library.h"
#include "devices/pinned_pool.h"
#include "devices/stream_memory_operations.h"
#include "devices/wire_convert.h"
#include "scheduling/nonfinite_gradients.h"
#include "scheduling/staging.h"

namespace attngrad::server {
namespace {

#ifdef ATTNGRAD_HAVE_NCCL_HEADER
// What the GPU workers share when NCCL sums their accumulators: the communicators (rank i is
// worker i) and a host barrier. Destroyed with the last worker, after every worker thread ended.
class NcclSum {
 public:
  explicit NcclSum(std::unique_ptr<NcclCommunicators> communicators)
      : communicators_(std::move(communicators)) {}

  const NcclLibrary& library() const { return communicators_->library(); }
  ncclComm_t comm(int rank) const { return communicators_->comm(rank); }
  int size() const { return communicators_->size(); }
  NcclCommunicators& communicators() { return *communicators_; }
  // Requested when a reduction failed or hung on some rank (nccl_abort.h): the communicators are
  // aborted and every later fetch sums on the host. Every rank sees it at the same control (it is
  // requested before the failing rank reaches the barrier that ends the reduction).
  CollectiveAbort& abort() { return abort_; }
  bool usable() const { return !abort_.requested(); }

  // Every rank calls this once per reading control, in the same order (a reusable barrier);
  // returns, once all have arrived, whether every rank passed ok = true.
  bool AllAgree(bool ok) {
    std::unique_lock<std::mutex> lock(mutex_);
    all_ok_ = all_ok_ && ok;
    if (++arrived_ == size()) {
      const bool result = result_ = all_ok_;
      arrived_ = 0;
      all_ok_ = true;
      ++generation_;
      lock.unlock();
      arrived_all_.notify_all();
      return result;
    }
    // result_ stays this round's until the waiters have read it: the next round cannot complete
    // without them.
    const std::uint64_t generation = generation_;
    arrived_all_.wait(lock, [&] { return generation_ != generation; });
    return result_;
  }

 private:
  std::unique_ptr<NcclCommunicators> communicators_;
  CollectiveAbort abort_;
  std::mutex mutex_;
  std::condition_variable arrived_all_;
  int arrived_ = 0;
  bool all_ok_ = true;
  bool result_ = true;
  std::uint64_t generation_ = 0;
};
#else
class NcclSum {};  // never made: this build has no nccl.h
#endif

// How long a rank waits for its part of an NCCL reduction before it aborts the communicators
// (a fetch's reduction of even a 27B model's layer takes milliseconds).
#ifdef ATTNGRAD_HAVE_NCCL_HEADER
const CollectiveWaitOptions kNcclWait = {std::chrono::seconds(60), std::chrono::microseconds(200)};
#endif

// Free page-locked answer memory a GPU worker keeps for reuse: a RETURN answer of the SPEC layer is
// ~113 MB (fp32), and the answers in flight (16 of them in a bench of 8 streams) must not each
// allocate and lock their memory again.
constexpr std::size_t kPinnedAnswerPoolBytes = std::size_t{4} << 30;
// Free page-locked staging memory the server keeps for batches staged on arrival (a 4x1024 fp32
// batch of the SPEC layer stages 27 MB).
constexpr std::size_t kArrivalStagingPoolBytes = std::size_t{1} << 30;

// How often the worker looks at the gates of stream-ordered batches
// (BatchJob::Request::stream_gate) while some are closed: the delay between a client's stream
// reaching a batch and its launch.
constexpr std::chrono::microseconds kGatePollInterval{20};

class GpuWorker final : public DeviceWorker {
 public:
  // `nccl`: null for host-side sums; else this worker is rank `rank` of it (rank 0 is the root).
  GpuWorker(int cuda_device, const LayerSlots& layers, int pipeline_depth, ServerMetrics* metrics,
            std::shared_ptr<NcclSum> nccl, int rank)
      : DeviceWorker(absl::StrCat("cuda:", cuda_device), metrics, std::max(pipeline_depth, 3)),
        nccl_(std::move(nccl)),
        rank_(rank),
        cuda_device_(cuda_device) {
    for (const std::shared_ptr<const LayerWeights>& weights : layers) {
      layers_.push_back(std::make_unique<ResidentLayer>(weights));
      largest_layer_elements_ =
          std::max(largest_layer_elements_, layers_.back()->layout.total_elements);
    }
  }

  ~GpuWorker() override { StopAndJoin(); }

  DeviceDescription Describe() const override {
    DeviceDescription description;
    description.index = cuda_device_;
    description.name = name_;
    description.backend = "cuda";
    description.memory_total_bytes = memory_total_.load();
    description.memory_used_bytes = memory_used_.load();
    description.stream_ordered_batches = stream_ordered_batches_.load();
    return description;
  }

 private:
  // The weight-gradient sums of one client window on this device.
  struct AccumulatorSet {
    cuda::DeviceBuffer<float> buffer;  // layout_; null until first used
    long long batches = 0;
    long long tokens = 0;
  };

  // One served layer on this device: its weights uploaded once (and again only when replaced), with
  // their fp16 copies, and its accumulator sets.
  struct ResidentLayer {
    explicit ResidentLayer(std::shared_ptr<const LayerWeights> layer_weights)
        : weights(std::move(layer_weights)), config(weights->config), layout(config) {}
    std::shared_ptr<const LayerWeights> weights;  // the version batches must be computed with
    const LayerConfig config;
    const PackedWeightLayout layout;
    cuda::DeviceBuffer<float> device_weights;  // layout
    // The fp16 copies of device_weights' projections (1.5x the fp32 memory in all), re-made in the
    // same memory at every upload; empty where the kernels do not support the layer.
    PreparedWeights prepared;
    // The version that device_weights and `prepared` hold: `weights` once both its upload and its
    // preparation have completed; null while one is under way or after one failed (then every
    // batch of the layer is refused with `upload_status`, never computed with a mix of versions).
    std::shared_ptr<const LayerWeights> resident;
    absl::Status upload_status;
    std::vector<AccumulatorSet> accumulator_sets;  // one per client window holding sums
  };

  // One batch in flight and the buffers it uses (grown as batches need, never shrunk).
  struct Slot {
    std::unique_ptr<BatchJob> job;
    // The staging layout (scheduling/staging.h), for a job not staged on arrival.
    cuda::PinnedBuffer<float> host_in;
    // A job's inputs staged on arrival, kept until its copy-in is done (the batch retires).
    common::BufferPool::Buffer staged_inputs;
    cuda::DeviceBuffer<float> device_in;      // hidden_states | grad_output | cos | sin, all fp32
    cuda::DeviceBuffer<float> device_raw;     // fp16/bf16 activations before widening (2 per float)
    cuda::DeviceBuffer<float> device_answer;  // a fp16/bf16 answer after narrowing (2 per float)
    cuda::DeviceBuffer<float> device_grad_hidden;
    cuda::DeviceBuffer<float> device_weight_gradients;  // this batch's own weight gradients
    // The finite check's counts (attngrad/finite_check.h): on the device, and copied out.
    cuda::DeviceBuffer<unsigned long long> device_non_finite;
    cuda::PinnedBuffer<unsigned long long> host_non_finite;
    cuda::Event copy_in_start, copy_in_done, compute_start, compute_done, copy_out_start,
        copy_out_done;
    double host_copy_in_seconds = 0;
    // The batch's activations in a client's GPU memory (CUDA IPC), kept open until it retires.
    WireTensor device_hidden_states, device_grad_output;
  };

  // Where a stream-ordered batch waits for its client's stream. The worker's thread polls the
  // client's ready word: a copy of it into `word` (page-locked) on `stream`, with `copied`
  // recorded behind, looked at once the copy is done. No stream of the server ever waits on a
  // client's memory, so nothing the server does on the device (an allocation or a free that
  // synchronises the device, another client's batch, a control) can be held up by a client whose
  // stream never gets there.
  struct Gate {
    cuda::Stream stream;
    cuda::Event copied;
    cuda::PinnedBuffer<std::uint32_t> word;
  };
  struct ParkedJob {
    std::unique_ptr<BatchJob> job;
    std::unique_ptr<Gate> gate;
  };

  absl::Status Initialize() override {
    absl::Status status = InitializeDevice();
    if (!status.ok()) Release();
    return status;
  }

  absl::Status InitializeDevice() {
    ATTNGRAD_CUDA_RETURN(cudaSetDevice(cuda_device_));
    cudaDeviceProp properties;
    ATTNGRAD_CUDA_RETURN(cudaGetDeviceProperties(&properties, cuda_device_));
    name_ = properties.name;
    for (cuda::Stream* stream : {&copy_in_stream_, &compute_stream_, &copy_out_stream_}) {
      ATTNGRAD_CUDA_RETURN(cuda::Stream::Create(stream));
    }
    stream_memory_ = std::make_unique<StreamMemoryOperations>();
    stream_ordered_batches_ = stream_memory_->usable();
    const std::size_t weight_elements = largest_layer_elements_;
    for (std::unique_ptr<ResidentLayer>& layer : layers_) {
      const cudaError_t allocated =
          cuda::DeviceBuffer<float>::Create(layer->layout.total_elements, &layer->device_weights);
      if (allocated != cudaSuccess) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the weights of ", layers_.size(), " layers do not fit on ", device(), ": ",
            cudaGetErrorString(allocated), " (serve fewer layers per server with --layers)"));
      }
    }
    // cudaMemset and pageable cudaMemcpy run on the legacy stream, which our non-blocking streams
    // do not wait for: finish them before any batch.
    ATTNGRAD_CUDA_RETURN(cudaDeviceSynchronize());
    for (std::unique_ptr<ResidentLayer>& layer : layers_) {
      absl::Status status = UploadWeights(*layer);
      if (!status.ok()) return status;
    }
    slots_.resize(static_cast<std::size_t>(pipeline_depth()));
    for (Slot& slot : slots_) {
      ATTNGRAD_CUDA_RETURN(
          cuda::DeviceBuffer<float>::Create(weight_elements, &slot.device_weight_gradients));
      ATTNGRAD_CUDA_RETURN(
          cuda::DeviceBuffer<unsigned long long>::Create(kCheckedCounts, &slot.device_non_finite));
      ATTNGRAD_CUDA_RETURN(
          cuda::PinnedBuffer<unsigned long long>::Create(kCheckedCounts, &slot.host_non_finite));
      for (cuda::Event* event : {&slot.copy_in_start, &slot.copy_in_done, &slot.compute_start,
                                 &slot.compute_done, &slot.copy_out_start}) {
        ATTNGRAD_CUDA_RETURN(cuda::Event::Create(event));
      }
      // Retire waits on this one: blocking, so that the worker's thread sleeps until the batch is
      // done instead of spinning a core for every batch's copies and kernels (the default wait of
      // a process with fewer CUDA contexts than cores spins).
      ATTNGRAD_CUDA_RETURN(cuda::Event::Create(&slot.copy_out_done, cudaEventBlockingSync));
    }
    if (nccl_ != nullptr) {
      ATTNGRAD_CUDA_RETURN(cuda::Stream::Create(&nccl_stream_));
      if (rank_ == 0) {
        ATTNGRAD_CUDA_RETURN(cuda::DeviceBuffer<float>::Create(weight_elements, &reduce_buffer_));
      }
    }
    UpdateMemoryGauges();
    return absl::OkStatus();
  }

  // Drops every CUDA resource (on the worker's thread, after the last batch, once the device is
  // idle); their destructors release them.
  void Release() {
    cudaDeviceSynchronize();
    parked_.clear();
    free_gates_.clear();
    slots_.clear();
    workspace_ = cuda::DeviceBuffer<unsigned char>();
    layers_.clear();
    reduce_buffer_ = cuda::DeviceBuffer<float>();
    for (cuda::Stream* stream :
         {&copy_in_stream_, &compute_stream_, &copy_out_stream_, &nccl_stream_}) {
      *stream = cuda::Stream();
    }
  }

  // Synchronous upload of layer.weights and their fp16 copies (the pipeline is drained when this
  // runs); layer.resident says whether it completed.
  absl::Status UploadWeights(ResidentLayer& layer) {
    layer.resident = nullptr;
    layer.upload_status = CopyAndPrepareWeights(layer);
    if (layer.upload_status.ok()) layer.resident = layer.weights;
    return layer.upload_status;
  }

  absl::Status CopyAndPrepareWeights(ResidentLayer& layer) {
    const LayerWeights& weights = *layer.weights;
    if (weights.on_device()) {
      // The server's own GPU copy (weights by reference), on this or another device.
      ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(
          layer.device_weights.get(), weights.device_values->data(),
          layer.layout.total_elements * sizeof(float), cudaMemcpyDefault, compute_stream_.get()));
      ATTNGRAD_CUDA_RETURN(cudaStreamSynchronize(compute_stream_.get()));
    } else {
      for (Weight weight : kAllWeights) {
        ATTNGRAD_CUDA_RETURN(cudaMemcpy(layer.device_weights.get() + layer.layout.offsets[weight],
                                        weights.values[weight].data(),
                                        weights.values[weight].size() * sizeof(float),
                                        cudaMemcpyHostToDevice));
      }
      // A pageable host-to-device cudaMemcpy may return before its DMA lands, on the legacy
      // stream.
      ATTNGRAD_CUDA_RETURN(cudaDeviceSynchronize());
    }
    const Status prepared = layer.prepared.Prepare(
        layer.config, layer.layout.Pointers<const float>(layer.device_weights.get()),
        compute_stream_.get());
    // A layer the kernels do not support keeps no copies (its batches are refused by the kernels).
    if (prepared.code == ATTNGRAD_UNSUPPORTED) return absl::OkStatus();
    if (!prepared.ok()) {
      return absl::InternalError(absl::StrCat(
          "the fp16 copies of a layer's weights on ", device(), ": ", prepared.message,
          " (each served layer needs 1.5x its fp32 weights' memory; serve fewer layers per server "
          "with --layers)"));
    }
    ATTNGRAD_CUDA_RETURN(cudaStreamSynchronize(compute_stream_.get()));
    return absl::OkStatus();
  }

  void UpdateMemoryGauges() {
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return;
    memory_total_ = static_cast<long long>(total_bytes);
    memory_used_ = static_cast<long long>(total_bytes - free_bytes);
    metrics()->DeviceMemoryTotal(device()).Set(static_cast<double>(total_bytes));
    metrics()->DeviceMemoryUsed(device()).Set(static_cast<double>(total_bytes - free_bytes));
  }

  void Run() override {
    std::deque<Slot*> in_flight;
    while (true) {
      LaunchOpenedGates(in_flight);
      // With batches in flight, look for more work without blocking; when there is none, finish
      // the oldest batch instead. With closed gates, look again soon.
      std::optional<Item> item =
          parked_.empty() ? Pop(/*wait=*/in_flight.empty()) : PopWithin(kGatePollInterval);
      if (!item) {
        if (!in_flight.empty()) {
          RetireOldest(in_flight);
        } else if (parked_.empty()) {
          break;  // stopping and drained
        }
        continue;
      }
      if (item->job == nullptr) {
        // A control runs after every batch queued before it that it concerns, stream-ordered
        // ones included (ControlFollows); the other parked batches stay parked meanwhile.
        while (HasParkedBefore(*item->control)) {
          LaunchOpenedGates(in_flight);
          if (HasParkedBefore(*item->control)) std::this_thread::sleep_for(kGatePollInterval);
        }
        while (!in_flight.empty()) RetireOldest(in_flight);
        Control(*item->control);
        continue;
      }
      if (item->job->request.stream_gate.ready != nullptr) {
        Park(std::move(item->job));
      } else {
        LaunchInSlot(std::move(item->job), in_flight);
      }
    }
    Release();
  }

  // Whether a control must wait for a parked batch: it replaces the weights of the batch's layer,
  // or reads or zeroes the sums the batch adds to. Other clients' and layers' parked batches never
  // hold a control up.
  static bool ControlFollows(const WorkerControl& control, const BatchJob& job) {
    if (job.request.layer_slot != control.layer_slot) return false;
    if (control.new_weights != nullptr) return true;
    return job.admission.accumulate && job.admission.accumulator_set == control.accumulator_set;
  }

  bool HasParkedBefore(const WorkerControl& control) const {
    return std::any_of(parked_.begin(), parked_.end(), [&control](const ParkedJob& parked) {
      return ControlFollows(control, *parked.job);
    });
  }

  void RetireOldest(std::deque<Slot*>& in_flight) {
    Retire(*in_flight.front());
    in_flight.pop_front();
  }

  // Launches `job` in a free slot (retiring the oldest batch when none is free), or finishes it
  // with the error that stopped its launch (or CANCELLED when nobody can observe it).
  void LaunchInSlot(std::unique_ptr<BatchJob> job, std::deque<Slot*>& in_flight) {
    if (SkipIfUnobservable(job)) return;
    if (in_flight.size() == slots_.size()) RetireOldest(in_flight);
    Slot* slot = nullptr;
    for (Slot& candidate : slots_) {
      if (candidate.job == nullptr) {
        slot = &candidate;
        break;
      }
    }
    slot->job = std::move(job);
    absl::Status status = Launch(*slot);
    if (status.ok()) {
      in_flight.push_back(slot);
      return;
    }
    // Nothing of this batch may still be running before its buffers are reused.
    cudaStreamSynchronize(copy_in_stream_.get());
    cudaStreamSynchronize(compute_stream_.get());
    cudaStreamSynchronize(copy_out_stream_.get());
    slot->device_hidden_states = WireTensor();
    slot->device_grad_output = WireTensor();
    slot->staged_inputs = common::BufferPool::Buffer();
    slot->job->result.status = status;
    FinishJob(std::move(slot->job));
  }

  // Queues the first read of a stream-ordered batch's ready word on a gate of its own and parks
  // the batch until the word has reached its value (LaunchOpenedGates); finishes it with the error
  // otherwise.
  void Park(std::unique_ptr<BatchJob> job) {
    absl::StatusOr<std::unique_ptr<Gate>> gate = CloseGate(job->request.stream_gate);
    if (!gate.ok()) {
      job->result.status = gate.status();
      FinishJob(std::move(job));
      return;
    }
    parked_.push_back(ParkedJob{std::move(job), *std::move(gate)});
  }

  absl::StatusOr<std::unique_ptr<Gate>> CloseGate(const BatchJob::Request::StreamGate& order) {
    if (!stream_memory_->usable()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stream_order: the CUDA driver of ", device(),
          " has no stream memory operations (cuStreamWriteValue32); send the batch without it"));
    }
    std::unique_ptr<Gate> gate;
    if (!free_gates_.empty()) {
      gate = std::move(free_gates_.back());
      free_gates_.pop_back();
    } else {
      gate = std::make_unique<Gate>();
      ATTNGRAD_CUDA_RETURN(cuda::Stream::Create(&gate->stream));
      ATTNGRAD_CUDA_RETURN(cuda::Event::Create(&gate->copied, cudaEventDisableTiming));
      ATTNGRAD_CUDA_RETURN(cuda::PinnedBuffer<std::uint32_t>::Create(1, &gate->word));
    }
    ATTNGRAD_RETURN_IF_ERROR(QueueGateRead(*gate, order));
    return gate;
  }

  // Queues a copy of the client's ready word into the gate's page-locked word.
  absl::Status QueueGateRead(Gate& gate, const BatchJob::Request::StreamGate& order) {
    ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(gate.word.get(), order.ready, sizeof(std::uint32_t),
                                         cudaMemcpyDeviceToHost, gate.stream.get()));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(gate.copied.get(), gate.stream.get()));
    return absl::OkStatus();
  }

  // Whether the batch's ready word has reached its value ((int32_t)(word - value) >= 0: values
  // wrap around), as far as the last finished read shows; queues the next read when it has not.
  absl::StatusOr<bool> GateOpened(ParkedJob& parked) {
    const cudaError_t state = cudaEventQuery(parked.gate->copied.get());
    if (state == cudaErrorNotReady) return false;
    ATTNGRAD_CUDA_RETURN(state);
    const std::uint32_t seen = *static_cast<volatile std::uint32_t*>(parked.gate->word.get());
    const BatchJob::Request::StreamGate& order = parked.job->request.stream_gate;
    if (static_cast<std::int32_t>(seen - order.value) >= 0) return true;
    ATTNGRAD_RETURN_IF_ERROR(QueueGateRead(*parked.gate, order));
    return false;
  }

  // Launches the parked batches whose gate has opened, in the order they came; fails those whose
  // deadline has passed.
  void LaunchOpenedGates(std::deque<Slot*>& in_flight) {
    for (auto parked = parked_.begin(); parked != parked_.end();) {
      absl::StatusOr<bool> opened = GateOpened(*parked);
      if (opened.ok() && !*opened &&
          std::chrono::steady_clock::now() < parked->job->request.stream_gate.deadline) {
        ++parked;
        continue;
      }
      ParkedJob leaving = std::move(*parked);
      parked = parked_.erase(parked);
      // Its last read is finished before the gate serves another batch (a read of a few bytes).
      cudaStreamSynchronize(leaving.gate->stream.get());
      free_gates_.push_back(std::move(leaving.gate));
      if (opened.ok() && *opened) {
        // Its stages count from here: the time before was the client's stream's, not the server's.
        leaving.job->result.submitted = std::chrono::steady_clock::now();
        LaunchInSlot(std::move(leaving.job), in_flight);
        continue;
      }
      leaving.job->result.status =
          opened.ok() ? absl::DeadlineExceededError(
                            "stream_order.ready: the client's CUDA stream did not reach the batch "
                            "before its deadline (--stream_order_timeout_seconds after it "
                            "arrived); it was not computed")
                      : opened.status();
      FinishJob(std::move(leaving.job));
    }
  }

  // Grows a buffer (pinned or device) to hold `elements` (its user is idle): the old one is
  // released before the new one is made.
  template <typename Buffer>
  static absl::Status EnsureCapacity(Buffer* buffer, std::size_t elements, const char* what) {
    if (buffer->size() >= elements) return absl::OkStatus();
    *buffer = Buffer();
    return CudaStatus(Buffer::Create(elements, buffer), what);
  }

  // The slot's host staging (scheduling/staging.h), in parts on the copy threads.
  absl::Status StageInputs(Slot& slot, BatchJob& job) {
    return CopyToStaging(job, slot.host_in.get(), copy_threads_.get(),
                         common::ParallelTasks::kCopyPartBytes);
  }

  // Where the kernels read one activation tensor (`dtype`, `count` elements): fp32 in the client's
  // GPU memory (`in_gpu_memory`, CUDA IPC) as it is; otherwise its place in device_in (`device`),
  // filled on the copy-in stream from the host staging (`host`; in_gpu_memory is empty then) or,
  // for fp16/bf16 in GPU memory, widened from there.
  absl::StatusOr<const float*> ActivationsOnDevice(const WireTensor& in_gpu_memory, int dtype,
                                                   const float* host, std::size_t count,
                                                   float* device, std::uint16_t* device_raw,
                                                   cudaStream_t stream) {
    const WireTensor& tensor = in_gpu_memory;
    if (tensor.cuda_device() < 0) {
      ATTNGRAD_RETURN_IF_ERROR(CopyActivationsIn(host, dtype, count, device, device_raw, stream));
      return device;
    }
    if (tensor.dtype() == v1::DTYPE_FLOAT32) {
      return reinterpret_cast<const float*>(tensor.device_data());
    }
    ATTNGRAD_CUDA_RETURN(WidenToFloat(reinterpret_cast<const std::uint16_t*>(tensor.device_data()),
                                      HalfFormatOf(tensor.dtype()), count, device, stream));
    return device;
  }

  // Queues the copy of one activation tensor to device_in (its place there is `device`), widened
  // on the device when it arrived as fp16/bf16 (through `device_raw`).
  absl::Status CopyActivationsIn(const float* host, int dtype, std::size_t count, float* device,
                                 std::uint16_t* device_raw, cudaStream_t stream) {
    if (dtype == v1::DTYPE_FLOAT32) {
      return CudaStatus(
          cudaMemcpyAsync(device, host, count * sizeof(float), cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync(activations)");
    }
    ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(device_raw, host, count * sizeof(std::uint16_t),
                                         cudaMemcpyHostToDevice, stream));
    return CudaStatus(WidenToFloat(device_raw, HalfFormatOf(dtype), count, device, stream),
                      "WidenToFloat(activations)");
  }

  static HalfFormat HalfFormatOf(int dtype) {
    return dtype == v1::DTYPE_BFLOAT16 ? HalfFormat::kBFloat16 : HalfFormat::kFloat16;
  }

  // Where the kernels read a batch's inputs on the device (QueueCopyIn): fp32 each, in the slot's
  // device_in or in the client's GPU memory. grad_output is null for a FORWARD batch.
  struct DeviceInputs {
    const float* hidden_states = nullptr;
    const float* grad_output = nullptr;
    const float* cos = nullptr;
    const float* sin = nullptr;
  };

  // Where the compute left a batch's fp32 results (QueueBackward / QueueForward): the answer's
  // [B,S,hidden] tensor (grad_hidden_states, or a FORWARD batch's output) and, for a backward
  // batch, the weight gradients. Either may already be the client's GPU memory (an fp32
  // destination), which QueueCopyOut then leaves alone.
  struct DeviceResults {
    float* activations = nullptr;
    float* weight_gradients = nullptr;  // null for a FORWARD batch
  };

  // Stages the slot's batch and queues its copy-in, compute and copy-out: the steps below, in
  // order, each of which may fail the batch (LaunchInSlot then waits until nothing of it runs).
  absl::Status Launch(Slot& slot) {
    BatchJob& job = *slot.job;
    ResidentLayer& layer = *layers_[static_cast<std::size_t>(job.request.layer_slot)];
    job.result.stages.queue = SecondsSince(job.result.submitted);
    ATTNGRAD_RETURN_IF_ERROR(PrepareSlot(slot, layer));
    ATTNGRAD_ASSIGN_OR_RETURN(const DeviceInputs inputs, QueueCopyIn(slot));
    ATTNGRAD_ASSIGN_OR_RETURN(
        const DeviceResults results,
        job.forward() ? QueueForward(slot, layer, inputs) : QueueBackward(slot, layer, inputs));
    return QueueCopyOut(slot, layer, results);
  }

  // Elements of the answer's tensors in fp32: the [B,S,hidden] tensor and, RETURN, the weight
  // gradients.
  static std::size_t OutputElements(const BatchJob& job, const ResidentLayer& layer) {
    return job.activations() +
           (job.request.return_weight_gradients ? layer.layout.total_elements : 0);
  }

  // The workspace the batch's computation needs, with the layer's fp16 copies when it has them.
  static std::size_t WorkspaceSizeOf(const BatchJob& job, const ResidentLayer& layer) {
    if (job.forward()) {
      return layer.prepared.ready()
                 ? ForwardWorkspaceSize(layer.prepared, job.request.batch, job.request.seq_len,
                                        job.request.precision)
                 : ForwardWorkspaceSize(layer.config, job.request.batch, job.request.seq_len,
                                        job.request.precision);
    }
    return layer.prepared.ready() ? DeviceWorkspaceSize(layer.prepared, job.request.batch,
                                                        job.request.seq_len, job.request.precision)
                                  : DeviceWorkspaceSize(layer.config, job.request.batch,
                                                        job.request.seq_len, job.request.precision);
  }

  // The memory the batch needs, before anything of it is queued: the answer's page-locked buffer,
  // the slot's buffers and the shared workspace grown to its size, and the layer's weights checked
  // to be usable.
  absl::Status PrepareSlot(Slot& slot, const ResidentLayer& layer) {
    BatchJob& job = *slot.job;
    const std::size_t activations = job.activations();
    const std::size_t input_elements = StagingElements(job);
    const bool half_inputs =
        job.request.hidden_states.dtype() != v1::DTYPE_FLOAT32 ||
        (!job.forward() && job.request.grad_output.dtype() != v1::DTYPE_FLOAT32);
    if (job.arrival.staged_inputs.data() == nullptr) {
      ATTNGRAD_RETURN_IF_ERROR(
          EnsureCapacity(&slot.host_in, input_elements, "cudaMallocHost(host_in)"));
    }
    // The answer's page-locked memory, which the GPU copies it into and gRPC sends from.
    job.result.answer.size = job.AnswerBytes();
    job.result.answer.bytes = answer_pool_->Acquire(job.result.answer.size);
    if (job.result.answer.bytes.data() == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("no page-locked host memory on ", device(), " for the answer (",
                       job.result.answer.size, " bytes): send fewer or smaller batches at once"));
    }
    ATTNGRAD_RETURN_IF_ERROR(
        EnsureCapacity(&slot.device_in, input_elements, "cudaMalloc(device_in)"));
    if (half_inputs) {  // 2 * activations 16-bit values
      ATTNGRAD_RETURN_IF_ERROR(
          EnsureCapacity(&slot.device_raw, activations, "cudaMalloc(device_raw)"));
    }
    if (job.request.response_dtype != v1::DTYPE_FLOAT32) {  // OutputElements 16-bit values
      ATTNGRAD_RETURN_IF_ERROR(EnsureCapacity(
          &slot.device_answer, (OutputElements(job, layer) + 1) / 2, "cudaMalloc(device_answer)"));
    }
    ATTNGRAD_RETURN_IF_ERROR(
        EnsureCapacity(&slot.device_grad_hidden, activations, "cudaMalloc(device_grad_hidden)"));
    // Weights that did not finish uploading (or preparing) are never used.
    if (layer.resident != layer.weights) {
      return absl::FailedPreconditionError(
          absl::StrCat("the weights of this layer on ", device(), " are not usable: ",
                       layer.upload_status.ok() ? "their upload is incomplete"
                                                : std::string(layer.upload_status.message()),
                       " (upload them again with LoadWeights)"));
    }
    const std::size_t workspace_size = WorkspaceSizeOf(job, layer);
    if (workspace_size <= workspace_.size()) return absl::OkStatus();
    // The workspace is shared by every batch on the compute stream: wait until it is unused.
    ATTNGRAD_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(compute_stream_.get()), "cudaStreamSynchronize"));
    return EnsureCapacity(&workspace_, workspace_size, "cudaMalloc(workspace)");
  }

  // The batch's host inputs staged (on arrival already, or here), the received bytes let go, and
  // the copy-in queued: the activations to device_in (widened there when fp16/bf16) unless they are
  // in the client's GPU memory, then the rotary tables unless they are too.
  absl::StatusOr<DeviceInputs> QueueCopyIn(Slot& slot) {
    BatchJob& job = *slot.job;
    const std::size_t activations = job.activations();
    const auto copy_start = std::chrono::steady_clock::now();
    const bool staged = job.arrival.staged_inputs.data() != nullptr;
    absl::Status status = absl::OkStatus();
    if (staged) {
      slot.staged_inputs = std::move(job.arrival.staged_inputs);
    } else {
      status = StageInputs(slot, job);
    }
    // The received bytes are no longer needed; GPU memory is read from where it is.
    const int hidden_dtype = job.request.hidden_states.dtype();
    const int grad_dtype = job.request.grad_output.dtype();
    slot.device_hidden_states = job.request.hidden_states.cuda_device() >= 0
                                    ? std::move(job.request.hidden_states)
                                    : WireTensor();
    slot.device_grad_output = job.request.grad_output.cuda_device() >= 0
                                  ? std::move(job.request.grad_output)
                                  : WireTensor();
    job.request.hidden_states = WireTensor();
    job.request.grad_output = WireTensor();
    job.arrival.request_reservation.Release();
    if (!status.ok()) return status;
    // On arrival already (its seconds in stages.copy_in), or here as well.
    slot.host_copy_in_seconds =
        job.result.stages.copy_in + (staged ? 0.0 : SecondsSince(copy_start));
    const float* const host_in =
        staged ? reinterpret_cast<const float*>(slot.staged_inputs.data()) : slot.host_in.get();

    const cudaStream_t copy_in = copy_in_stream_.get();
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_in_start.get(), copy_in));
    std::uint16_t* const device_raw = reinterpret_cast<std::uint16_t*>(slot.device_raw.get());
    DeviceInputs inputs;
    ATTNGRAD_ASSIGN_OR_RETURN(
        inputs.hidden_states,
        ActivationsOnDevice(slot.device_hidden_states, hidden_dtype, host_in, activations,
                            slot.device_in.get(), device_raw, copy_in));
    if (!job.forward()) {
      ATTNGRAD_ASSIGN_OR_RETURN(
          inputs.grad_output,
          ActivationsOnDevice(slot.device_grad_output, grad_dtype, host_in + activations,
                              activations, slot.device_in.get() + activations,
                              device_raw == nullptr ? nullptr : device_raw + activations, copy_in));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(std::tie(inputs.cos, inputs.sin),
                              QueueRotaryCopyIn(slot, host_in, copy_in));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_in_done.get(), copy_in));
    return inputs;
  }

  // Where the kernels read the rotary tables: in the client's GPU memory (fp32, CUDA IPC), which
  // the job keeps open until it is finished, or in device_in after the activations (the staging
  // layout's place), copied there on `copy_in`.
  absl::StatusOr<std::pair<const float*, const float*>> QueueRotaryCopyIn(const Slot& slot,
                                                                          const float* host_in,
                                                                          cudaStream_t copy_in) {
    const BatchJob& job = *slot.job;
    if (job.request.device_cos.cuda_device() >= 0) {
      return std::pair(reinterpret_cast<const float*>(job.request.device_cos.device_data()),
                       reinterpret_cast<const float*>(job.request.device_sin.device_data()));
    }
    const std::size_t first = StagedActivationTensors(job) * job.activations();
    const std::size_t rotary = job.request.cos.size();
    float* const device = slot.device_in.get() + first;
    ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(device, host_in + first, 2 * rotary * sizeof(float),
                                         cudaMemcpyHostToDevice, copy_in));
    return std::pair<const float*, const float*>(device, device + rotary);
  }

  // Where the answer's [B,S,hidden] tensor is computed: straight into the client's GPU memory when
  // it goes there as fp32 (CUDA IPC), else into the slot (narrowed into the client's memory, or
  // copied out, by QueueCopyOut).
  static float* ActivationsResult(Slot& slot) {
    const BatchJob& job = *slot.job;
    const BatchJob::Request::DeviceDestination& destination =
        job.request.grad_hidden_states_destination;
    if (destination.data != nullptr && job.request.response_dtype == v1::DTYPE_FLOAT32) {
      return reinterpret_cast<float*>(destination.data);
    }
    return slot.device_grad_hidden.get();
  }

  // Queues a backward batch on the compute stream behind its copy-in: BackwardDevice, then the
  // finite check (which, ACCUMULATE, adds the weight gradients to the client's set when finite).
  absl::StatusOr<DeviceResults> QueueBackward(Slot& slot, ResidentLayer& layer,
                                              const DeviceInputs& inputs) {
    BatchJob& job = *slot.job;
    const cudaStream_t compute = compute_stream_.get();
    ATTNGRAD_CUDA_RETURN(cudaStreamWaitEvent(compute, slot.copy_in_done.get(), 0));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.compute_start.get(), compute));
    BackwardInputs in;
    in.hidden_states = inputs.hidden_states;
    in.grad_output = inputs.grad_output;
    in.cos = inputs.cos;
    in.sin = inputs.sin;
    in.weights = layer.layout.Pointers<const float>(layer.device_weights.get());
    const bool add = job.admission.accumulate && !job.request.return_weight_gradients;
    // Every batch computes its weight gradients into the slot (or, RETURN as fp32 into a client's
    // GPU memory, straight there); an ACCUMULATE batch's are added to its accumulator set after
    // the finite check, on the device (QueueFiniteCheck).
    const BatchJob::Request::DeviceDestination& weights_destination =
        job.request.weight_gradients_destination;
    DeviceResults results;
    results.weight_gradients =
        weights_destination.data != nullptr && job.request.response_dtype == v1::DTYPE_FLOAT32
            ? reinterpret_cast<float*>(weights_destination.data)
            : slot.device_weight_gradients.get();
    results.activations = ActivationsResult(slot);
    AccumulatorSet* accumulator_set = nullptr;
    if (add) {
      ATTNGRAD_RETURN_IF_ERROR(
          AccumulatorSetAt(layer, job.admission.accumulator_set, &accumulator_set));
    }
    BackwardOutputs out;
    out.grad_hidden_states = results.activations;
    out.weight_gradients = layer.layout.Pointers(results.weight_gradients);
    // With the layer's fp16 copies (of the resident version, checked in PrepareSlot) when it has
    // them.
    const Status computed =
        layer.prepared.ready()
            ? BackwardDevice(layer.prepared, job.request.batch, job.request.seq_len,
                             job.request.scalars, job.request.precision,
                             /*accumulate=*/false, in, out, workspace_.get(), workspace_.size(),
                             compute)
            : BackwardDevice(layer.config, job.request.batch, job.request.seq_len,
                             job.request.scalars, job.request.precision,
                             /*accumulate=*/false, in, out, workspace_.get(), workspace_.size(),
                             compute);
    // The message names the check or the step that failed ("cos is not 16-byte aligned", ...).
    ATTNGRAD_RETURN_IF_ERROR(KernelStatus(computed, "BackwardDevice"));
    ATTNGRAD_RETURN_IF_ERROR(QueueFiniteCheck(
        slot, layer, results.activations, results.weight_gradients, job.activations(),
        add ? accumulator_set->buffer.get() : nullptr, compute));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.compute_done.get(), compute));
    return results;
  }

  // Queues a FORWARD batch on the compute stream behind its copy-in: ForwardDevice (with the
  // layer's fp16 copies when it has them, as the backward), then the count of the output's
  // non-finite values into the slot's counts ([0]; Retire turns it into the answer).
  absl::StatusOr<DeviceResults> QueueForward(Slot& slot, const ResidentLayer& layer,
                                             const DeviceInputs& inputs) {
    BatchJob& job = *slot.job;
    const cudaStream_t compute = compute_stream_.get();
    ATTNGRAD_CUDA_RETURN(cudaStreamWaitEvent(compute, slot.copy_in_done.get(), 0));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.compute_start.get(), compute));
    ForwardInputs in;
    in.hidden_states = inputs.hidden_states;
    in.cos = inputs.cos;
    in.sin = inputs.sin;
    in.weights = layer.layout.Pointers<const float>(layer.device_weights.get());
    DeviceResults results;
    results.activations = ActivationsResult(slot);
    const Status computed =
        layer.prepared.ready()
            ? ForwardDevice(layer.prepared, job.request.batch, job.request.seq_len,
                            job.request.scalars, job.request.precision, in, results.activations,
                            workspace_.get(), workspace_.size(), compute)
            : ForwardDevice(layer.config, job.request.batch, job.request.seq_len,
                            job.request.scalars, job.request.precision, in, results.activations,
                            workspace_.get(), workspace_.size(), compute);
    ATTNGRAD_RETURN_IF_ERROR(KernelStatus(computed, "ForwardDevice"));
    ATTNGRAD_CUDA_RETURN(
        cudaMemsetAsync(slot.device_non_finite.get(), 0, slot.device_non_finite.bytes(), compute));
    // The output alone: a layer of zero sizes has six empty weight tensors, which are not read
    // (their pointers only need to be non-null).
    const LayerConfig no_weights{0, 0, 0, 0};
    PerWeight<const float*> empty;
    for (Weight weight : kAllWeights) empty[weight] = results.activations;
    ATTNGRAD_RETURN_IF_ERROR(
        KernelStatus(CountNonFiniteDevice(no_weights, results.activations, job.activations(), empty,
                                          slot.device_non_finite.get(), compute),
                     "CountNonFiniteDevice"));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.compute_done.get(), compute));
    return results;
  }

  // Queues the copy-out behind the compute: the finite check's counts, then the answer's tensors
  // that are not in the client's GPU memory yet (fp32 copied; fp16/bf16 narrowed on the device,
  // into the client's memory or the slot's device_answer, and copied from there) into the answer
  // buffer, then a stream-ordered batch's `done` word.
  absl::Status QueueCopyOut(Slot& slot, const ResidentLayer& layer, const DeviceResults& results) {
    BatchJob& job = *slot.job;
    const std::size_t activations = job.activations();
    const cudaStream_t copy_out = copy_out_stream_.get();
    char* const host_out = job.result.answer.bytes.data();
    const bool activations_on_device = job.request.grad_hidden_states_destination.data != nullptr;
    const bool weights_on_device = job.request.weight_gradients_destination.data != nullptr;
    ATTNGRAD_CUDA_RETURN(cudaStreamWaitEvent(copy_out, slot.compute_done.get(), 0));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_out_start.get(), copy_out));
    ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(slot.host_non_finite.get(), slot.device_non_finite.get(),
                                         slot.device_non_finite.bytes(), cudaMemcpyDeviceToHost,
                                         copy_out));
    if (job.request.response_dtype == v1::DTYPE_FLOAT32) {
      if (!activations_on_device) {
        ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(host_out, results.activations,
                                             activations * sizeof(float), cudaMemcpyDeviceToHost,
                                             copy_out));
      }
      if (job.request.return_weight_gradients && !weights_on_device) {
        ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(
            host_out + activations * sizeof(float), results.weight_gradients,
            layer.layout.total_elements * sizeof(float), cudaMemcpyDeviceToHost, copy_out));
      }
    } else {
      ATTNGRAD_RETURN_IF_ERROR(QueueNarrowedCopyOut(slot, layer, results));
    }
    // A stream-ordered batch: the client's stream goes on once the outputs are in its memory.
    if (job.request.stream_gate.done != nullptr) {
      ATTNGRAD_RETURN_IF_ERROR(stream_memory_->Write(copy_out, job.request.stream_gate.done,
                                                     job.request.stream_gate.value));
    }
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_out_done.get(), copy_out));
    return absl::OkStatus();
  }

  // A fp16/bf16 answer: narrowed on the device (the weight gradients' layout is the answer's
  // order) into the client's GPU memory or device_answer, then the parts in device_answer copied
  // into the answer buffer.
  absl::Status QueueNarrowedCopyOut(Slot& slot, const ResidentLayer& layer,
                                    const DeviceResults& results) {
    BatchJob& job = *slot.job;
    const std::size_t activations = job.activations();
    const cudaStream_t copy_out = copy_out_stream_.get();
    const BatchJob::Request::DeviceDestination& destination =
        job.request.grad_hidden_states_destination;
    const BatchJob::Request::DeviceDestination& weights_destination =
        job.request.weight_gradients_destination;
    const HalfFormat format = HalfFormatOf(job.request.response_dtype);
    std::uint16_t* const answer = reinterpret_cast<std::uint16_t*>(slot.device_answer.get());
    ATTNGRAD_CUDA_RETURN(NarrowFromFloat(
        results.activations, format, activations,
        destination.data != nullptr ? reinterpret_cast<std::uint16_t*>(destination.data) : answer,
        copy_out));
    if (job.request.return_weight_gradients) {
      ATTNGRAD_CUDA_RETURN(
          NarrowFromFloat(results.weight_gradients, format, layer.layout.total_elements,
                          weights_destination.data != nullptr
                              ? reinterpret_cast<std::uint16_t*>(weights_destination.data)
                              : answer + activations,
                          copy_out));
    }
    // Without the parts that went into the client's GPU memory.
    const std::size_t first = destination.data != nullptr ? activations : 0;
    const std::size_t end =
        weights_destination.data != nullptr ? activations : OutputElements(job, layer);
    if (end <= first) return absl::OkStatus();
    return CudaStatus(
        cudaMemcpyAsync(reinterpret_cast<std::uint16_t*>(job.result.answer.bytes.data()) + first,
                        answer + first, (end - first) * sizeof(std::uint16_t),
                        cudaMemcpyDeviceToHost, copy_out),
        "cudaMemcpyAsync(answer)");
  }

  // On the compute stream after the batch: counts the non-finite values of its grad_hidden_states
  // and weight gradients into the slot's counts and, for an ACCUMULATE batch (`accumulators` set),
  // the sums the add would make non-finite, and adds its gradients there only when every count is
  // 0. Retire turns the counts into the answer.
  absl::Status QueueFiniteCheck(Slot& slot, const ResidentLayer& layer,
                                const float* grad_hidden_states, const float* weight_gradients,
                                std::size_t activations, float* accumulators,
                                cudaStream_t compute) {
    ATTNGRAD_CUDA_RETURN(
        cudaMemsetAsync(slot.device_non_finite.get(), 0, slot.device_non_finite.bytes(), compute));
    const PerWeight<const float*> gradients = layer.layout.Pointers<const float>(weight_gradients);
    ATTNGRAD_RETURN_IF_ERROR(
        KernelStatus(CountNonFiniteDevice(layer.config, grad_hidden_states, activations, gradients,
                                          slot.device_non_finite.get(), compute),
                     "CountNonFiniteDevice"));
    if (accumulators == nullptr) return absl::OkStatus();
    ATTNGRAD_RETURN_IF_ERROR(
        KernelStatus(CountOverflowingSumsDevice(layer.config, gradients,
                                                layer.layout.Pointers<const float>(accumulators),
                                                slot.device_non_finite.get(), compute),
                     "CountOverflowingSumsDevice"));
    return KernelStatus(
        AccumulateIfFiniteDevice(layer.config, gradients, layer.layout.Pointers(accumulators),
                                 slot.device_non_finite.get(), compute),
        "AccumulateIfFiniteDevice");
  }

  static double ElapsedSeconds(const cuda::Event& start, const cuda::Event& end) {
    float milliseconds = 0.f;
    if (cudaEventElapsedTime(&milliseconds, start.get(), end.get()) != cudaSuccess) return 0.0;
    return milliseconds * 1e-3;
  }

  // Waits for the slot's copy-out, hands the results to the job and the job back.
  void Retire(Slot& slot) {
    BatchJob& job = *slot.job;
    ResidentLayer& layer = *layers_[static_cast<std::size_t>(job.request.layer_slot)];
    job.result.status =
        CudaStatus(cudaEventSynchronize(slot.copy_out_done.get()), "batch on the GPU");
    if (job.result.status.ok()) {
      NonFiniteCounts counts;
      std::copy(slot.host_non_finite.get(), slot.host_non_finite.get() + counts.size(),
                counts.begin());
      // Not accumulated then (QueueFiniteCheck); a FORWARD batch counted its output alone.
      job.result.status =
          job.forward() ? NonFiniteOutputStatus(counts[0]) : NonFiniteGradientsStatus(counts);
    }
    if (job.result.status.ok()) {
      // The answer is in job.result.answer already (the GPU copied it there, in the response dtype
      // and order; a part that went into the client's GPU memory is not, and is not sent).
      job.result.stages.copy_in =
          slot.host_copy_in_seconds + ElapsedSeconds(slot.copy_in_start, slot.copy_in_done);
      job.result.stages.compute = ElapsedSeconds(slot.compute_start, slot.compute_done);
      job.result.stages.copy_out = ElapsedSeconds(slot.copy_out_start, slot.copy_out_done);
      if (job.admission.accumulate && !job.request.return_weight_gradients) {
        AccumulatorSet& accumulator_set =
            layer.accumulator_sets[static_cast<std::size_t>(job.admission.accumulator_set)];
        ++accumulator_set.batches;
        accumulator_set.tokens += job.tokens();
      }
    }
    if (++retired_since_gauges_ >= 16) {
      retired_since_gauges_ = 0;
      UpdateMemoryGauges();
    }
    slot.device_hidden_states = WireTensor();
    slot.device_grad_output = WireTensor();
    slot.staged_inputs = common::BufferPool::Buffer();
    FinishJob(std::move(slot.job));
  }

  void Control(WorkerControl& control) {
    // Runs with nothing in flight.
    absl::Status status =
        CudaStatus(cudaStreamSynchronize(compute_stream_.get()), "cudaStreamSynchronize");
    ResidentLayer& layer = *layers_[static_cast<std::size_t>(control.layer_slot)];
    if (status.ok() && control.new_weights != nullptr) {
      layer.weights = control.new_weights;
      status = UploadWeights(layer);
    }
    AccumulatorSnapshot snapshot;
    if (!control.read_accumulators && !control.zero_accumulators) {
      FinishControl(control, std::move(status), std::move(snapshot));
      return;
    }
    // Every rank allocates the set when a control first addresses it (zeros), so that the NCCL
    // reduction finds a buffer on every rank.
    AccumulatorSet* accumulator_set = nullptr;
    if (status.ok()) status = AccumulatorSetAt(layer, control.accumulator_set, &accumulator_set);
    if (status.ok()) {
      status = CudaStatus(cudaStreamSynchronize(compute_stream_.get()), "cudaStreamSynchronize");
    }
    bool may_zero = true;
    if (NcclSumUsable() && control.read_accumulators) {
      status = ReduceAccumulators(std::move(status), layer, accumulator_set, &snapshot, &may_zero);
    } else if (status.ok() && control.read_accumulators) {
      status = CopyAccumulators(layer, accumulator_set->buffer.get(), &snapshot);
    }
    if (accumulator_set != nullptr) {
      snapshot.batches = accumulator_set->batches;
      snapshot.tokens = accumulator_set->tokens;
    }
    if (status.ok() && may_zero && control.zero_accumulators) {
      status =
          CudaStatus(cudaMemset(accumulator_set->buffer.get(), 0, accumulator_set->buffer.bytes()),
                     "cudaMemset(accumulators)");
      // cudaMemset is asynchronous on the legacy stream: finish it before the next batch.
      if (status.ok()) status = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (status.ok()) {
        accumulator_set->batches = 0;
        accumulator_set->tokens = 0;
      }
    }
    FinishControl(control, std::move(status), std::move(snapshot));
  }

  // The accumulator set `index`, allocated and zeroed when first used (on the compute stream, so
  // a batch queued on it after this sees zeros).
  absl::Status AccumulatorSetAt(ResidentLayer& layer, int index, AccumulatorSet** accumulator_set) {
    const std::size_t position = static_cast<std::size_t>(std::max(0, index));
    if (layer.accumulator_sets.size() <= position) layer.accumulator_sets.resize(position + 1);
    AccumulatorSet& set = layer.accumulator_sets[position];
    if (set.buffer.get() == nullptr) {
      const cudaError_t allocated =
          cuda::DeviceBuffer<float>::Create(layer.layout.total_elements, &set.buffer);
      if (allocated != cudaSuccess) {
        return absl::ResourceExhaustedError(
            absl::StrCat("accumulators of another client window on ", device(), ": ",
                         cudaGetErrorString(allocated),
                         " (lower --max_clients_with_sums, or fetch-and-zero idle windows)"));
      }
      ATTNGRAD_CUDA_RETURN(
          cudaMemsetAsync(set.buffer.get(), 0, set.buffer.bytes(), compute_stream_.get()));
      UpdateMemoryGauges();
    }
    *accumulator_set = &set;
    return absl::OkStatus();
  }

  // The six tensors of a device buffer (the layer's layout) into snapshot->gradients.
  absl::Status CopyAccumulators(const ResidentLayer& layer, const float* device_buffer,
                                AccumulatorSnapshot* snapshot) {
    snapshot->gradients = ZeroWeights<std::vector<float>>(layer.config);
    for (Weight weight : kAllWeights) {
      ATTNGRAD_CUDA_RETURN(cudaMemcpy(
          snapshot->gradients[weight].data(), device_buffer + layer.layout.offsets[weight],
          snapshot->gradients[weight].size() * sizeof(float), cudaMemcpyDeviceToHost));
    }
    return absl::OkStatus();
  }

  // The NCCL read (every rank calls this for every reading control, in the same order; see the
  // top of the file). `prior`: how this control went so far on this rank. The root's snapshot gets
  // the sum over all ranks; the others' none. *may_zero is false unless every rank succeeded.
  // A rank that succeeded while another failed returns OK (the failing rank reports the error).
  absl::Status ReduceAccumulators(absl::Status prior, const ResidentLayer& layer,
                                  AccumulatorSet* accumulator_set, AccumulatorSnapshot* snapshot,
                                  bool* may_zero) {
#ifdef ATTNGRAD_HAVE_NCCL_HEADER
    *may_zero = false;
    if (!nccl_->AllAgree(prior.ok())) return prior;  // someone cannot take part: nobody starts
    const NcclLibrary& nccl = nccl_->library();
    // recvbuff is only used on the root ("may be NULL on all calls except for root", nccl.h).
    absl::Status status = nccl.Check(
        nccl.reduce(accumulator_set->buffer.get(), rank_ == 0 ? reduce_buffer_.get() : nullptr,
                    layer.layout.total_elements, ncclFloat32, ncclSum, /*root=*/0,
                    nccl_->comm(rank_), nccl_stream_.get()),
        absl::StrCat("ncclReduce of the accumulators (", device(), ")"));
    // Returns once this rank's part of the reduction is done, or has been aborted (this device
    // failed or hung, or another rank did: nccl_abort.h), so no rank waits for a lost peer.
    if (status.ok()) {
      NcclReductionOnStream reduction(nccl_->communicators(), rank_, nccl_stream_.get());
      status = WaitForCollective(reduction, nccl_->abort(), device(),
                                 "ncclReduce of the accumulators", kNcclWait);
    }
    if (status.ok() && rank_ == 0) {
      status = CopyAccumulators(layer, reduce_buffer_.get(), snapshot);
    }
    *may_zero = nccl_->AllAgree(status.ok());
    if (!status.ok()) snapshot->gradients = LayerTensors();
    return status;
#else
    *may_zero = false;
    (void)layer;
    (void)accumulator_set;
    (void)snapshot;
    return prior.ok() ? absl::InternalError("NCCL sum without nccl.h") : prior;
#endif
  }

  // Whether this control sums with NCCL: not after an abort (then this rank's communicator, if it
  // is still there, is aborted too and the host sums).
  bool NcclSumUsable() {
#ifdef ATTNGRAD_HAVE_NCCL_HEADER
    if (nccl_ == nullptr) return false;
    if (nccl_->usable()) return true;
    nccl_->communicators().Abort(rank_);
#endif
    return false;
  }

  const std::shared_ptr<NcclSum> nccl_;  // null: host-side sums
  const int rank_;
  const int cuda_device_;
  // Every served layer, by slot (unique_ptr: their addresses stay put).
  std::vector<std::unique_ptr<ResidentLayer>> layers_;
  std::size_t largest_layer_elements_ = 0;  // sizes the slots' gradients and the NCCL buffer
  std::string name_;
  std::atomic<long long> memory_total_{0};
  std::atomic<long long> memory_used_{0};
  cuda::Stream copy_in_stream_, compute_stream_, copy_out_stream_;
  cuda::Stream nccl_stream_;                     // NCCL only
  cuda::DeviceBuffer<float> reduce_buffer_;      // NCCL root only: the summed accumulators
  cuda::DeviceBuffer<unsigned char> workspace_;  // shared by every batch on compute_stream_
  std::vector<Slot> slots_;
  // Stream-ordered batches: their driver operations (made on the worker's thread), the batches
  // waiting for their client's stream, in arrival order, and the gates free for reuse.
  std::unique_ptr<StreamMemoryOperations> stream_memory_;
  std::atomic<bool> stream_ordered_batches_{false};
  std::deque<ParkedJob> parked_;
  std::vector<std::unique_ptr<Gate>> free_gates_;
  int retired_since_gauges_ = 0;
  // The host copies (staging in, answers out), in parts on these threads.
  std::unique_ptr<common::ParallelTasks> copy_threads_ =
      std::make_unique<common::ParallelTasks>(common::ParallelTasks::CopyThreads());
  // The answers' page-locked memory, reused once gRPC has sent them (see AnswerBuffer).
  std::shared_ptr<common::BufferPool> answer_pool_ = MakePinnedBufferPool(kPinnedAnswerPoolBytes);
};

}  // namespace

namespace {

// The NCCL communicators of `devices` (null with the reason in *why_not when NCCL is not usable).
std::shared_ptr<NcclSum> MakeNcclSum(const std::vector<int>& devices, std::string* version,
                                     absl::Status* why_not) {
#ifdef ATTNGRAD_HAVE_NCCL_HEADER
  absl::StatusOr<std::unique_ptr<NcclLibrary>> library = NcclLibrary::Load();
  if (!library.ok()) {
    *why_not = library.status();
    return nullptr;
  }
  *version = (*library)->version();
  // NVLink multicast (NVLS) is of no use to ncclReduce, costs device memory at ncclCommInitAll and
  // on shared hosts can take the GPUs out of service: keep it off unless the operator set it.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  absl::StatusOr<std::unique_ptr<NcclCommunicators>> communicators =
      NcclCommunicators::Create(std::shared_ptr<const NcclLibrary>(*std::move(library)), devices);
  if (!communicators.ok()) {
    *why_not = communicators.status();
    return nullptr;
  }
  return std::make_shared<NcclSum>(*std::move(communicators));
#else
  (void)devices;
  (void)version;
  *why_not = absl::UnavailableError(
      "this server was built without nccl.h (it was not in the CUDA include directories)");
  return nullptr;
#endif
}

}  // namespace

absl::StatusOr<GpuWorkers> CreateGpuWorkers(const std::vector<int>& devices,
                                            const LayerSlots& layers, int pipeline_depth,
                                            NcclMode nccl_mode, ServerMetrics* metrics) {
  const int count = DeviceCount();
  for (int device : devices) {
    if (device < 0 || device >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: CUDA device ", device, " does not exist (", count, " usable)"));
    }
  }
  GpuWorkers result;
  const std::string list = absl::StrCat("cuda:", absl::StrJoin(devices, ",cuda:"));
  std::shared_ptr<NcclSum> nccl;
  if (devices.size() < 2) {
    result.sum.description =
        absl::StrCat("gradients: one device (", list, "), nothing to sum across devices");
  } else if (nccl_mode == NcclMode::kOff) {
    result.sum.description =
        absl::StrCat("gradients summed on the host across ", list, " (--nccl=off)");
  } else {
    std::string version;
    absl::Status why_not;
    nccl = MakeNcclSum(devices, &version, &why_not);
    if (nccl == nullptr) {
      if (nccl_mode == NcclMode::kOn) {
        return absl::Status(why_not.code(), absl::StrCat("--nccl=on: ", why_not.message()));
      }
      result.sum.description = absl::StrCat("gradients summed on the host across ", list,
                                            " (NCCL not used: ", why_not.message(), ")");
    } else {
      result.sum.nccl = true;
      result.sum.nccl_version = version;
      result.sum.description = absl::StrCat("gradients summed with NCCL ", version, " across ",
                                            list, " (ncclReduce onto cuda:", devices.front(), ")");
    }
  }
  for (std::size_t rank = 0; rank < devices.size(); ++rank) {
    const int device = devices[rank];
    auto worker = std::make_unique<GpuWorker>(device, layers, pipeline_depth, metrics, nccl,
                                              static_cast<int>(rank));
    absl::Status status = worker->Start();
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("cuda:", device, ": ", status.message()));
    }
    result.workers.push_back(std::move(worker));
  }
  result.device_memory = MakeCudaIpcMemoryOpener(devices);
  result.arrival_staging = MakePinnedBufferPool(kArrivalStagingPoolBytes);
  return result;
}

}  // namespace attngrad::server
