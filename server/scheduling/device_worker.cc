// The worker queue, thread lifecycle and job bookkeeping shared by the CPU and GPU workers.
#include "scheduling/device_worker.h"

#include <future>

#include "absl/strings/str_cat.h"
#include "attngrad/wire/dtype.h"

namespace attngrad::server {

std::size_t BatchJob::AnswerBytes() const {
  std::size_t elements = activations();
  if (request.return_weight_gradients) {
    elements += PackedWeightLayout(request.config).total_elements;
  }
  return elements * wire::DTypeSize(request.response_dtype);
}

bool BatchJob::Unobservable() const {
  return arrival.stream_cancelled != nullptr && arrival.stream_cancelled->load() &&
         !admission.accumulate && request.stream_gate.ready == nullptr &&
         request.stream_gate.done == nullptr;
}

int BatchJob::cuda_device() const {
  if (request.hidden_states.cuda_device() >= 0) return request.hidden_states.cuda_device();
  if (request.grad_output.cuda_device() >= 0) return request.grad_output.cuda_device();
  if (request.device_cos.cuda_device() >= 0) return request.device_cos.cuda_device();
  if (request.grad_hidden_states_destination.cuda_device >= 0) {
    return request.grad_hidden_states_destination.cuda_device;
  }
  return request.weight_gradients_destination.cuda_device;
}

DeviceWorker::DeviceWorker(std::string device, ServerMetrics* metrics, int pipeline_depth)
    : device_(std::move(device)), metrics_(metrics), pipeline_depth_(pipeline_depth) {
  metrics_->QueueCapacity(device_).Set(pipeline_depth_);
  metrics_->QueueDepth(device_).Set(0);
  metrics_->Inflight(device_).Set(0);
}

DeviceWorker::~DeviceWorker() {
  // Derived classes call StopAndJoin() in their destructors (their members must outlive the
  // thread); this is a safety net only.
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    thread_.join();
  }
}

absl::Status DeviceWorker::Start() {
  std::promise<absl::Status> started;
  std::future<absl::Status> result = started.get_future();
  thread_ = std::thread(&DeviceWorker::ThreadMain, this, &started);
  absl::Status status = result.get();
  if (!status.ok()) thread_.join();
  return status;
}

void DeviceWorker::ThreadMain(std::promise<absl::Status>* started) {
  absl::Status status = Initialize();
  const bool ok = status.ok();
  started->set_value(std::move(status));  // `started` is gone after this
  if (ok) Run();
}

void DeviceWorker::StopAndJoin() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DeviceWorker::Submit(std::unique_ptr<BatchJob> job) {
  job->result.device = device_;
  job->result.submitted = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Item{std::move(job), std::nullopt});
    ++outstanding_;
    ++queued_jobs_;
    metrics_->Inflight(device_).Set(static_cast<double>(outstanding_));
    metrics_->QueueDepth(device_).Set(static_cast<double>(queued_jobs_));
  }
  ready_.notify_one();
}

void DeviceWorker::SubmitControl(WorkerControl control) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Item{nullptr, std::move(control)});
  }
  ready_.notify_one();
}

std::size_t DeviceWorker::Outstanding() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return outstanding_;
}

std::optional<DeviceWorker::Item> DeviceWorker::Pop(bool wait) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (wait) ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
  return PopLocked();
}

std::optional<DeviceWorker::Item> DeviceWorker::PopWithin(std::chrono::microseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  // Not woken by stopping: the caller still has work of its own to poll.
  ready_.wait_for(lock, timeout, [this] { return !queue_.empty(); });
  return PopLocked();
}

std::optional<DeviceWorker::Item> DeviceWorker::PopLocked() {
  if (queue_.empty()) return std::nullopt;
  Item item = std::move(queue_.front());
  queue_.pop_front();
  if (item.job != nullptr) --queued_jobs_;
  metrics_->QueueDepth(device_).Set(static_cast<double>(queued_jobs_));
  return item;
}

bool DeviceWorker::SkipIfUnobservable(std::unique_ptr<BatchJob>& job) {
  if (!job->Unobservable()) return false;
  job->result.status = absl::CancelledError(
      "the batch's Backward stream was cancelled before the batch was computed, and nothing but "
      "its answer would come of it: it was not computed");
  skipped_batches_.fetch_add(1);
  FinishJob(std::move(job));
  return true;
}

void DeviceWorker::FinishJob(std::unique_ptr<BatchJob> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --outstanding_;
    metrics_->Inflight(device_).Set(static_cast<double>(outstanding_));
  }
  job->result.stages.total = SecondsSince(job->result.submitted);
  if (job->result.status.ok()) {
    const char* mode = job->forward()                         ? "forward"
                       : job->request.return_weight_gradients ? "return"
                                                              : "accumulate";
    metrics_->ObserveBatch(mode, device_, job->tokens(), job->result.stages);
  }
  auto on_done = std::move(job->on_done);
  on_done(std::move(job));
}

void DeviceWorker::FinishControl(WorkerControl& control, absl::Status status,
                                 AccumulatorSnapshot snapshot) {
  if (control.on_done) control.on_done(std::move(status), std::move(snapshot));
}

absl::Status KernelStatus(const Status& status, const std::string& what) {
  const std::string message =
      absl::StrCat(what, ": ", status.message, ": ", attngrad_status_string(status.code));
  switch (status.code) {
    case ATTNGRAD_OK: return absl::OkStatus();
    case ATTNGRAD_INVALID_ARGUMENT: return absl::InvalidArgumentError(message);
    case ATTNGRAD_UNSUPPORTED: return absl::UnimplementedError(message);
    case ATTNGRAD_WORKSPACE_TOO_SMALL: return absl::InternalError(message);
    case ATTNGRAD_CUDA_ERROR: return absl::InternalError(message);
    default: return absl::InternalError(message);
  }
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace attngrad::server
