// GPU device worker. Everything CUDA happens on the worker's own thread. Per device: fp32 resident
// weights and weight-gradient accumulators (cudaMalloc), one device workspace, and three streams:
// copy-in, compute and copy-out. Each batch in flight owns a slot (pinned host staging buffers,
// device input/output buffers, timing events); with three slots the copy-in of batch n+1, the
// compute of batch n and the copy-out of batch n-1 overlap. Kernels run in order on the compute
// stream, so the accumulators and the shared workspace need no further synchronisation.
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
// barrier has confirmed that every worker's part succeeded; when one failed, none zeroes.
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

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "devices/nccl_library.h"

namespace attngrad::server {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

#define ATTNGRAD_CUDA_RETURN(call)                                   \
  do {                                                               \
    absl::Status cuda_status_ = CudaStatus((call), #call);           \
    if (!cuda_status_.ok()) return cuda_status_;                     \
  } while (false)

std::size_t TotalWeightElements(const LayerConfig& config) {
  std::size_t total = 0;
  for (int i = 0; i < kNumWeights; ++i) total += WeightElements(config, i);
  return total;
}

// Offsets of the six tensors inside one contiguous allocation (order q, k, v, o, q_norm, k_norm).
std::array<std::size_t, kNumWeights> WeightOffsets(const LayerConfig& config) {
  std::array<std::size_t, kNumWeights> offsets{};
  std::size_t offset = 0;
  for (int i = 0; i < kNumWeights; ++i) {
    offsets[i] = offset;
    offset += WeightElements(config, i);
  }
  return offsets;
}

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

class GpuWorker final : public DeviceWorker {
 public:
  // `nccl`: null for host-side sums; else this worker is rank `rank` of it (rank 0 is the root).
  GpuWorker(int cuda_device, std::shared_ptr<const LayerWeights> weights, int pipeline_depth,
            ServerMetrics* metrics, std::shared_ptr<NcclSum> nccl, int rank)
      : DeviceWorker(absl::StrCat("cuda:", cuda_device), metrics, std::max(pipeline_depth, 3)),
        nccl_(std::move(nccl)),
        rank_(rank),
        cuda_device_(cuda_device),
        weights_(std::move(weights)),
        config_(weights_->config),
        offsets_(WeightOffsets(config_)),
        weight_elements_(TotalWeightElements(config_)) {}

  ~GpuWorker() override { StopAndJoin(); }

  DeviceDescription Describe() const override {
    DeviceDescription description;
    description.index = cuda_device_;
    description.name = name_;
    description.backend = "cuda";
    description.memory_total_bytes = memory_total_.load();
    description.memory_used_bytes = memory_used_.load();
    return description;
  }

 private:
  // One batch in flight and the buffers it uses.
  struct Slot {
    std::unique_ptr<BatchJob> job;
    float* host_in = nullptr;  // pinned: hidden_states | grad_output | cos | sin
    std::size_t host_in_capacity = 0;
    float* host_out = nullptr;  // pinned: grad_hidden_states [| weight gradients (RETURN)]
    std::size_t host_out_capacity = 0;
    float* device_in = nullptr;  // same layout as host_in
    std::size_t device_in_capacity = 0;
    float* device_grad_hidden = nullptr;
    std::size_t device_grad_hidden_capacity = 0;
    float* device_weight_gradients = nullptr;  // this batch's own weight gradients
    cudaEvent_t copy_in_start = nullptr, copy_in_done = nullptr, compute_start = nullptr,
                compute_done = nullptr, copy_out_start = nullptr, copy_out_done = nullptr;
    double host_copy_in_seconds = 0;
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
    for (cudaStream_t* stream : {&copy_in_stream_, &compute_stream_, &copy_out_stream_}) {
      ATTNGRAD_CUDA_RETURN(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
    }
    const std::size_t weight_bytes = weight_elements_ * sizeof(float);
    ATTNGRAD_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&device_weights_), weight_bytes));
    ATTNGRAD_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&device_accumulators_), weight_bytes));
    ATTNGRAD_CUDA_RETURN(cudaMemset(device_accumulators_, 0, weight_bytes));
    // cudaMemset and pageable cudaMemcpy run on the legacy stream, which our non-blocking streams
    // do not wait for: finish them before any batch.
    ATTNGRAD_CUDA_RETURN(cudaDeviceSynchronize());
    absl::Status status = UploadWeights(*weights_);
    if (!status.ok()) return status;
    slots_.resize(static_cast<std::size_t>(pipeline_depth()));
    for (Slot& slot : slots_) {
      ATTNGRAD_CUDA_RETURN(
          cudaMalloc(reinterpret_cast<void**>(&slot.device_weight_gradients), weight_bytes));
      for (cudaEvent_t* event : {&slot.copy_in_start, &slot.copy_in_done, &slot.compute_start,
                                 &slot.compute_done, &slot.copy_out_start, &slot.copy_out_done}) {
        ATTNGRAD_CUDA_RETURN(cudaEventCreate(event));
      }
    }
    if (nccl_ != nullptr) {
      ATTNGRAD_CUDA_RETURN(cudaStreamCreateWithFlags(&nccl_stream_, cudaStreamNonBlocking));
      if (rank_ == 0) {
        ATTNGRAD_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&reduce_buffer_), weight_bytes));
      }
    }
    UpdateMemoryGauges();
    return absl::OkStatus();
  }

  // Frees everything (on the worker's thread, after the last batch).
  void Release() {
    cudaDeviceSynchronize();
    for (Slot& slot : slots_) {
      cudaFreeHost(slot.host_in);
      cudaFreeHost(slot.host_out);
      cudaFree(slot.device_in);
      cudaFree(slot.device_grad_hidden);
      cudaFree(slot.device_weight_gradients);
      for (cudaEvent_t event : {slot.copy_in_start, slot.copy_in_done, slot.compute_start,
                                slot.compute_done, slot.copy_out_start, slot.copy_out_done}) {
        if (event != nullptr) cudaEventDestroy(event);
      }
    }
    slots_.clear();
    cudaFree(workspace_);
    cudaFree(device_weights_);
    cudaFree(device_accumulators_);
    cudaFree(reduce_buffer_);
    workspace_ = nullptr;
    device_weights_ = device_accumulators_ = reduce_buffer_ = nullptr;
    for (cudaStream_t stream : {copy_in_stream_, compute_stream_, copy_out_stream_, nccl_stream_}) {
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
    copy_in_stream_ = compute_stream_ = copy_out_stream_ = nccl_stream_ = nullptr;
  }

  // Synchronous upload of the six weights (the pipeline is drained when this runs).
  absl::Status UploadWeights(const LayerWeights& weights) {
    for (int i = 0; i < kNumWeights; ++i) {
      ATTNGRAD_CUDA_RETURN(cudaMemcpy(device_weights_ + offsets_[i],
                                      weights.values.tensors[i].data(),
                                      weights.values.tensors[i].size() * sizeof(float),
                                      cudaMemcpyHostToDevice));
    }
    // A pageable host-to-device cudaMemcpy may return before its DMA lands, on the legacy stream.
    ATTNGRAD_CUDA_RETURN(cudaDeviceSynchronize());
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
    auto retire_oldest = [&] {
      Retire(*in_flight.front());
      in_flight.pop_front();
    };
    while (true) {
      // With batches in flight, look for more work without blocking; when there is none, finish
      // the oldest batch instead.
      std::optional<Item> item = Pop(/*wait=*/in_flight.empty());
      if (!item) {
        if (in_flight.empty()) break;  // stopping and drained
        retire_oldest();
        continue;
      }
      if (item->job == nullptr) {
        while (!in_flight.empty()) retire_oldest();
        Control(*item->control);
        continue;
      }
      if (in_flight.size() == slots_.size()) retire_oldest();
      Slot* slot = nullptr;
      for (Slot& candidate : slots_) {
        if (candidate.job == nullptr) {
          slot = &candidate;
          break;
        }
      }
      slot->job = std::move(item->job);
      absl::Status status = Launch(*slot);
      if (status.ok()) {
        in_flight.push_back(slot);
      } else {
        // Nothing of this batch may still be running before its buffers are reused.
        cudaStreamSynchronize(copy_in_stream_);
        cudaStreamSynchronize(compute_stream_);
        slot->job->status = status;
        FinishJob(std::move(slot->job));
      }
    }
    Release();
  }

  // Grows a pinned host buffer to hold `elements` floats (the slot is idle).
  static absl::Status EnsurePinned(float** buffer, std::size_t* capacity, std::size_t elements) {
    if (*capacity >= elements) return absl::OkStatus();
    cudaFreeHost(*buffer);
    *buffer = nullptr;
    *capacity = 0;
    ATTNGRAD_CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(buffer), elements * sizeof(float)));
    *capacity = elements;
    return absl::OkStatus();
  }

  static absl::Status EnsureDevice(float** buffer, std::size_t* capacity, std::size_t elements) {
    if (*capacity >= elements) return absl::OkStatus();
    cudaFree(*buffer);
    *buffer = nullptr;
    *capacity = 0;
    ATTNGRAD_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(buffer), elements * sizeof(float)));
    *capacity = elements;
    return absl::OkStatus();
  }

  // Stages the slot's batch and queues its copy-in, compute and copy-out.
  absl::Status Launch(Slot& slot) {
    BatchJob& job = *slot.job;
    const auto start = std::chrono::steady_clock::now();
    job.stages.queue = std::chrono::duration<double>(start - job.submitted).count();
    const std::size_t activations = job.hidden_states.size();
    const std::size_t rotary = job.cos.size();
    const std::size_t input_elements = 2 * activations + 2 * rotary;
    const std::size_t output_elements =
        activations + (job.return_weight_gradients ? weight_elements_ : 0);
    absl::Status status = EnsurePinned(&slot.host_in, &slot.host_in_capacity, input_elements);
    if (status.ok()) status = EnsurePinned(&slot.host_out, &slot.host_out_capacity, output_elements);
    if (status.ok()) status = EnsureDevice(&slot.device_in, &slot.device_in_capacity, input_elements);
    if (status.ok()) {
      status = EnsureDevice(&slot.device_grad_hidden, &slot.device_grad_hidden_capacity, activations);
    }
    const std::size_t workspace_size =
        DeviceWorkspaceSize(config_, job.batch, job.seq_len, job.precision);
    if (status.ok() && workspace_size > workspace_capacity_) {
      // The workspace is shared by every batch on the compute stream: wait until it is unused.
      status = CudaStatus(cudaStreamSynchronize(compute_stream_), "cudaStreamSynchronize");
      if (status.ok()) {
        cudaFree(workspace_);
        workspace_ = nullptr;
        workspace_capacity_ = 0;
        status = CudaStatus(cudaMalloc(&workspace_, workspace_size), "cudaMalloc(workspace)");
        if (status.ok()) workspace_capacity_ = workspace_size;
      }
    }
    if (!status.ok()) return status;

    float* host = slot.host_in;
    std::memcpy(host, job.hidden_states.data(), activations * sizeof(float));
    std::memcpy(host + activations, job.grad_output.data(), activations * sizeof(float));
    std::memcpy(host + 2 * activations, job.cos.data(), rotary * sizeof(float));
    std::memcpy(host + 2 * activations + rotary, job.sin.data(), rotary * sizeof(float));
    slot.host_copy_in_seconds = SecondsSince(start);

    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_in_start, copy_in_stream_));
    ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(slot.device_in, slot.host_in,
                                         input_elements * sizeof(float), cudaMemcpyHostToDevice,
                                         copy_in_stream_));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_in_done, copy_in_stream_));

    ATTNGRAD_CUDA_RETURN(cudaStreamWaitEvent(compute_stream_, slot.copy_in_done, 0));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.compute_start, compute_stream_));
    BackwardInputs in;
    in.hidden_states = slot.device_in;
    in.grad_output = slot.device_in + activations;
    in.cos = slot.device_in + 2 * activations;
    in.sin = slot.device_in + 2 * activations + rotary;
    in.q_weight = device_weights_ + offsets_[kQProj];
    in.k_weight = device_weights_ + offsets_[kKProj];
    in.v_weight = device_weights_ + offsets_[kVProj];
    in.o_weight = device_weights_ + offsets_[kOProj];
    in.q_norm_weight = device_weights_ + offsets_[kQNorm];
    in.k_norm_weight = device_weights_ + offsets_[kKNorm];
    const bool add = job.accumulate && !job.return_weight_gradients;
    float* gradients = add ? device_accumulators_ : slot.device_weight_gradients;
    BackwardOutputs out;
    out.grad_hidden_states = slot.device_grad_hidden;
    out.grad_q_weight = gradients + offsets_[kQProj];
    out.grad_k_weight = gradients + offsets_[kKProj];
    out.grad_v_weight = gradients + offsets_[kVProj];
    out.grad_o_weight = gradients + offsets_[kOProj];
    out.grad_q_norm_weight = gradients + offsets_[kQNorm];
    out.grad_k_norm_weight = gradients + offsets_[kKNorm];
    status = KernelStatus(BackwardDevice(config_, job.batch, job.seq_len, job.scalars, job.precision,
                                         add, in, out, workspace_, workspace_capacity_,
                                         compute_stream_),
                          "BackwardDevice");
    if (!status.ok()) return status;
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.compute_done, compute_stream_));

    ATTNGRAD_CUDA_RETURN(cudaStreamWaitEvent(copy_out_stream_, slot.compute_done, 0));
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_out_start, copy_out_stream_));
    ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(slot.host_out, slot.device_grad_hidden,
                                         activations * sizeof(float), cudaMemcpyDeviceToHost,
                                         copy_out_stream_));
    if (job.return_weight_gradients) {
      ATTNGRAD_CUDA_RETURN(cudaMemcpyAsync(slot.host_out + activations, slot.device_weight_gradients,
                                           weight_elements_ * sizeof(float),
                                           cudaMemcpyDeviceToHost, copy_out_stream_));
    }
    ATTNGRAD_CUDA_RETURN(cudaEventRecord(slot.copy_out_done, copy_out_stream_));
    return absl::OkStatus();
  }

  static double ElapsedSeconds(cudaEvent_t start, cudaEvent_t end) {
    float milliseconds = 0.f;
    if (cudaEventElapsedTime(&milliseconds, start, end) != cudaSuccess) return 0.0;
    return milliseconds * 1e-3;
  }

  // Waits for the slot's copy-out, hands the results to the job and the job back.
  void Retire(Slot& slot) {
    BatchJob& job = *slot.job;
    job.status = CudaStatus(cudaEventSynchronize(slot.copy_out_done), "batch on the GPU");
    if (job.status.ok()) {
      const auto start = std::chrono::steady_clock::now();
      const std::size_t activations = job.hidden_states.size();
      job.grad_hidden_states.assign(slot.host_out, slot.host_out + activations);
      if (job.return_weight_gradients) {
        job.weight_gradients = LayerTensors::Zeros(config_);
        for (int i = 0; i < kNumWeights; ++i) {
          const float* source = slot.host_out + activations + offsets_[i];
          std::copy(source, source + job.weight_gradients.tensors[i].size(),
                    job.weight_gradients.tensors[i].begin());
        }
      }
      const double host_copy_out_seconds = SecondsSince(start);
      job.stages.copy_in = slot.host_copy_in_seconds +
                           ElapsedSeconds(slot.copy_in_start, slot.copy_in_done);
      job.stages.compute = ElapsedSeconds(slot.compute_start, slot.compute_done);
      job.stages.copy_out =
          ElapsedSeconds(slot.copy_out_start, slot.copy_out_done) + host_copy_out_seconds;
      if (job.accumulate && !job.return_weight_gradients) {
        ++accumulated_batches_;
        accumulated_tokens_ += job.tokens();
      }
    }
    if (++retired_since_gauges_ >= 16) {
      retired_since_gauges_ = 0;
      UpdateMemoryGauges();
    }
    FinishJob(std::move(slot.job));
  }

  void Control(WorkerControl& control) {
    // Runs with nothing in flight.
    absl::Status status = CudaStatus(cudaStreamSynchronize(compute_stream_), "cudaStreamSynchronize");
    if (status.ok() && control.new_weights != nullptr) {
      weights_ = control.new_weights;
      status = UploadWeights(*weights_);
    }
    AccumulatorSnapshot snapshot;
    bool may_zero = true;
    if (control.read_accumulators && nccl_ != nullptr) {
      status = ReduceAccumulators(std::move(status), &snapshot, &may_zero);
    } else if (status.ok() && control.read_accumulators) {
      status = CopyAccumulators(device_accumulators_, &snapshot);
    }
    snapshot.batches = accumulated_batches_;
    snapshot.tokens = accumulated_tokens_;
    if (status.ok() && may_zero && control.zero_accumulators) {
      status = CudaStatus(cudaMemset(device_accumulators_, 0, weight_elements_ * sizeof(float)),
                          "cudaMemset(accumulators)");
      // cudaMemset is asynchronous on the legacy stream: finish it before the next batch.
      if (status.ok()) status = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (status.ok()) {
        accumulated_batches_ = 0;
        accumulated_tokens_ = 0;
      }
    }
    FinishControl(control, std::move(status), std::move(snapshot));
  }

  // The six tensors of a device buffer (layout offsets_) into snapshot->gradients.
  absl::Status CopyAccumulators(const float* device_buffer, AccumulatorSnapshot* snapshot) {
    snapshot->gradients = LayerTensors::Zeros(config_);
    for (int i = 0; i < kNumWeights; ++i) {
      ATTNGRAD_CUDA_RETURN(cudaMemcpy(snapshot->gradients.tensors[i].data(),
                                      device_buffer + offsets_[i],
                                      snapshot->gradients.tensors[i].size() * sizeof(float),
                                      cudaMemcpyDeviceToHost));
    }
    return absl::OkStatus();
  }

  // The NCCL read (every rank calls this for every reading control, in the same order; see the
  // top of the file). `prior`: how this control went so far on this rank. The root's snapshot gets
  // the sum over all ranks; the others' none. *may_zero is false unless every rank succeeded.
  // A rank that succeeded while another failed returns OK (the failing rank reports the error).
  absl::Status ReduceAccumulators(absl::Status prior, AccumulatorSnapshot* snapshot, bool* may_zero) {
#ifdef ATTNGRAD_HAVE_NCCL_HEADER
    *may_zero = false;
    if (!nccl_->AllAgree(prior.ok())) return prior;  // someone cannot take part: nobody starts
    const NcclLibrary& nccl = nccl_->library();
    // recvbuff is only used on the root ("may be NULL on all calls except for root", nccl.h).
    absl::Status status = nccl.Check(
        nccl.reduce(device_accumulators_, rank_ == 0 ? reduce_buffer_ : nullptr, weight_elements_,
                    ncclFloat32, ncclSum, /*root=*/0, nccl_->comm(rank_), nccl_stream_),
        absl::StrCat("ncclReduce of the accumulators (", device(), ")"));
    // Returns once every rank's part of the reduction is done.
    if (status.ok()) {
      status = CudaStatus(cudaStreamSynchronize(nccl_stream_), "cudaStreamSynchronize(ncclReduce)");
    }
    if (status.ok() && rank_ == 0) status = CopyAccumulators(reduce_buffer_, snapshot);
    *may_zero = nccl_->AllAgree(status.ok());
    if (!status.ok()) snapshot->gradients = LayerTensors();
    return status;
#else
    *may_zero = false;
    (void)snapshot;
    return prior.ok() ? absl::InternalError("NCCL sum without nccl.h") : prior;
#endif
  }

  const std::shared_ptr<NcclSum> nccl_;  // null: host-side sums
  const int rank_;
  const int cuda_device_;
  std::shared_ptr<const LayerWeights> weights_;
  const LayerConfig config_;
  const std::array<std::size_t, kNumWeights> offsets_;
  const std::size_t weight_elements_;
  std::string name_;
  std::atomic<long long> memory_total_{0};
  std::atomic<long long> memory_used_{0};
  cudaStream_t copy_in_stream_ = nullptr, compute_stream_ = nullptr, copy_out_stream_ = nullptr;
  float* device_weights_ = nullptr;
  float* device_accumulators_ = nullptr;
  cudaStream_t nccl_stream_ = nullptr;  // NCCL only
  float* reduce_buffer_ = nullptr;      // NCCL root only: the summed accumulators
  void* workspace_ = nullptr;
  std::size_t workspace_capacity_ = 0;
  std::vector<Slot> slots_;
  long long accumulated_batches_ = 0;
  long long accumulated_tokens_ = 0;
  int retired_since_gauges_ = 0;
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
                                            std::shared_ptr<const LayerWeights> weights,
                                            int pipeline_depth, NcclMode nccl_mode,
                                            ServerMetrics* metrics) {
  const int count = DeviceCount();
  if (weights->config.head_dim != 128) {
    return absl::UnimplementedError(absl::StrCat(
        "--weights: the GPU kernels support head_dim 128 only; this layer has head_dim ",
        weights->config.head_dim, " (serve it with --devices=cpu)"));
  }
  for (int device : devices) {
    if (device < 0 || device >= count) {
      return absl::InvalidArgumentError(absl::StrCat("--devices: CUDA device ", device,
                                                     " does not exist (", count, " usable)"));
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
    auto worker = std::make_unique<GpuWorker>(device, weights, pipeline_depth, metrics, nccl,
                                              static_cast<int>(rank));
    absl::Status status = worker->Start();
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("cuda:", device, ": ", status.message()));
    }
    result.workers.push_back(std::move(worker));
  }
  return result;
}

}  // namespace attngrad::server
