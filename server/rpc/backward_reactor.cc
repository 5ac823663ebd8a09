// The Backward reactor: reads batches, hands them to GradientCore and writes their answers.
#include "rpc/backward_reactor.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "rpc/gradient_service.h"
#include "rpc/raw_request.h"
#include "rpc/stream_end.h"
#include "scheduling/staging.h"

namespace attngrad::server {
namespace {

using Clock = std::chrono::steady_clock;

// See backward_reactor.h.
class BackwardReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                              public IdleStream {
 public:
  BackwardReactor(GradientService* service, grpc::CallbackServerContext* context,
                  std::string client_id)
      : service_(service),
        context_(context),
        client_id_(std::move(client_id)),
        start_(Clock::now()),
        last_progress_(start_) {
    const absl::StatusOr<bool> declared = EndMarkerDeclared(context_->client_metadata());
    absl::Status opened = declared.status();
    if (opened.ok()) opened = service_->streams().Open(client_id_, this);
    if (!opened.ok()) {
      finished_ = true;
      FinishStream(ToGrpcStatus(opened));
      return;
    }
    stream_end_ = StreamEndCheck(*declared);
    // Reactions may start once StartRead is called: the constructor's own state is set before.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      read_in_flight_ = true;
    }
    StartRead(&request_);
  }

  bool ExpireIfIdle(Clock::time_point now, Clock::duration timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || jobs_outstanding_ != 0 || now - last_progress_ < timeout) return false;
    finished_ = true;
    cancel_on_expiry_ = write_in_flight_;  // an answer the client does not read
    expiry_status_ = grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("Backward: the stream made no progress for ",
                     std::chrono::duration<double>(timeout).count(),
                     " s (--stream_idle_timeout_seconds) and was closed; open a new stream when "
                     "there are batches to send"));
    return true;
  }

  std::optional<Clock::time_point> IdleSince() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || HasBatchesLocked()) return std::nullopt;
    return last_progress_;
  }

  bool EvictIfIdle() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || HasBatchesLocked()) return false;
    finished_ = true;
    expiry_status_ = grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        "Backward: the server closed this idle stream to make room for another client's stream "
        "(--max_concurrent_streams reached, and this client held the most streams); open a new "
        "stream when there are batches to send");
    return true;
  }

  bool Drain() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return false;
    draining_ = true;
    if (HasBatchesLocked()) return false;  // NextLocked ends it once they are answered
    finished_ = true;
    expiry_status_ = ToGrpcStatus(ShuttingDownError());
    return true;
  }

  void FinishIdle() override {
    if (cancel_on_expiry_) context_->TryCancel();
    FinishStream(expiry_status_);
  }

  // The request is parsed (its slices taken out of request_) and counted as outstanding, the next
  // read is started, and only then is the batch checked, staged and handed in: the next request's
  // bytes arrive while this one's are copied (HTTP/2 flow control would otherwise hold them back
  // for that time, on every connection).
  void OnReadDone(bool ok) override {
    std::optional<ReceivedBackwardRequest> received;
    std::int64_t received_bytes = 0;
    if (ok) {
      received_bytes = static_cast<std::int64_t>(request_.Length());
      absl::StatusOr<ReceivedBackwardRequest> parsed = ParseReceivedBackwardRequest(request_);
      request_.Clear();  // the slices live on in `received` as long as it needs them
      if (parsed.ok()) {
        received = *std::move(parsed);
      } else {
        // Not a message: nothing after it can be trusted to be one either. End the stream once
        // the batches already handed in are answered. (The RPC metrics interceptor counts the
        // call's end.)
        std::lock_guard<std::mutex> lock(mutex_);
        reads_done_ = true;
        if (end_status_.ok()) end_status_ = parsed.status();
      }
    }
    Actions actions;
    bool refused = false;  // arrived after the shutdown began
    {
      std::lock_guard<std::mutex> lock(mutex_);
      read_in_flight_ = false;
      last_progress_ = Clock::now();
      if (!ok) reads_done_ = true;
      CheckStreamEndLocked(ok, received);
      // Counted before the next read may start: the batch holds its place in the stream's window
      // and keeps the stream open until it is answered (every path below answers it).
      if (finished_) received.reset();  // closed while this request arrived: not computed
      if (received.has_value()) ++jobs_outstanding_;
      refused = draining_;
      actions = NextLocked();
    }
    Do(actions);
    if (!received.has_value()) return;
    if (refused) {
      QueueResponse(ErrorResponse(received->message.batch_id(), ShuttingDownError()),
                    /*job_finished=*/true);
      return;
    }
    HandleRequest(*std::move(received), received_bytes);
  }

  void OnWriteDone(bool ok) override {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      write_in_flight_ = false;
      last_progress_ = Clock::now();
      if (ok) {
        service_->metrics().AddSentBytes("Backward",
                                         static_cast<double>(writes_.front()->payload_bytes));
      }
      writes_.pop_front();
      if (!ok) {  // the client is gone: drop what is left to write
        broken_ = true;
        cancelled_->store(true);
        writes_.clear();
      }
      actions = NextLocked();
    }
    Do(actions);
  }

  void OnCancel() override {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      broken_ = true;
      cancelled_->store(true);  // the workers skip its queued batches that nobody could observe
      // Keep the response being written (gRPC holds a pointer to it) and drop the others.
      while (writes_.size() > (write_in_flight_ ? 1u : 0u)) writes_.pop_back();
      actions = NextLocked();
    }
    Do(actions);
  }

  void OnDone() override {
    service_->regions().ForgetExitedOwners();  // a trainer that went away: close its regions
    delete this;
  }

 private:
  // Gives its stream slot back before finishing, so that a client that has seen the stream end
  // finds the slot free (OnDone may run later). The RPC metrics: rpc_metrics_interceptor.h.
  void FinishStream(const grpc::Status& status) {
    service_->streams().Close(this);
    Finish(status);
  }

  // An answer, serialized (its tensors as slices of the job's answer buffer).
  struct Write {
    grpc::ByteBuffer bytes;
    std::int64_t payload_bytes = 0;
  };

  struct Actions {
    const grpc::ByteBuffer* write = nullptr;
    bool read = false;
    bool finish = false;
    grpc::Status status;
  };

  // Checks what a read brought against the stream's end marker (stream_end.h): a request stays in
  // `received` to be computed, the end marker is taken out of it, and a read that failed is the
  // client's half-close (or its cancellation, which ends the stream CANCELLED instead). A check
  // that fails ends the stream's reading: it ends with that status once the batches already handed
  // in are answered.
  void CheckStreamEndLocked(bool ok, std::optional<ReceivedBackwardRequest>& received) {
    absl::Status status;
    if (!ok) {
      if (!context_->IsCancelled()) status = stream_end_.HalfClosed();
    } else if (received.has_value() && received->message.has_end()) {
      status = stream_end_.Marker(*received);
      received.reset();
    } else if (received.has_value()) {
      status = stream_end_.Request();
      if (!status.ok()) received.reset();
    }
    if (status.ok()) return;
    reads_done_ = true;
    if (end_status_.ok()) end_status_ = status;
  }

  // Batches computing, or answers not yet written.
  bool HasBatchesLocked() const {
    return jobs_outstanding_ != 0 || write_in_flight_ || !writes_.empty();
  }

  // What to start next; the caller performs it after releasing the mutex.
  Actions NextLocked() {
    Actions actions;
    if (finished_) return actions;
    if (!broken_ && !write_in_flight_ && !writes_.empty()) {
      write_in_flight_ = true;
      actions.write = &writes_.front()->bytes;
    }
    const std::size_t pending = static_cast<std::size_t>(jobs_outstanding_) + writes_.size();
    if (!broken_ && !reads_done_ && !read_in_flight_ && !draining_ &&
        pending < static_cast<std::size_t>(service_->limits().stream_window)) {
      read_in_flight_ = true;
      actions.read = true;
    }
    if (!read_in_flight_ && !write_in_flight_ && jobs_outstanding_ == 0 &&
        (broken_ || (reads_done_ && writes_.empty()))) {
      finished_ = true;
      actions.finish = true;
      if (broken_) {
        actions.status = grpc::Status(grpc::StatusCode::CANCELLED, "Backward: stream cancelled");
      } else if (!end_status_.ok()) {
        actions.status = ToGrpcStatus(end_status_);
      } else {
        actions.status = grpc::Status::OK;
      }
    } else if (draining_ && !HasBatchesLocked()) {
      // The shutdown began and every batch is answered: end without waiting for the client's
      // half-close (a read still waiting for it completes with ok = false).
      finished_ = true;
      actions.finish = true;
      actions.status = ToGrpcStatus(ShuttingDownError());
    }
    return actions;
  }

  void Do(const Actions& actions) {
    if (actions.write != nullptr) StartWrite(actions.write);
    if (actions.read) StartRead(&request_);
    if (actions.finish) FinishStream(actions.status);
  }

  void QueueResponse(std::unique_ptr<Write> response, bool job_finished) {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (job_finished) --jobs_outstanding_;
      if (!broken_) writes_.push_back(std::move(response));
      actions = NextLocked();
    }
    Do(actions);
  }

  // The error answer of a batch: `response` (with whatever fields the caller has set already),
  // the batch id, the server instance and the error.
  std::unique_ptr<Write> ErrorResponse(std::uint64_t batch_id, const absl::Status& status,
                                       v1::BackwardResponse response = {}) {
    service_->metrics().CountError("Backward", StatusCodeName(static_cast<int>(status.code())));
    response.set_batch_id(batch_id);
    response.mutable_error()->set_code(static_cast<int>(status.code()));
    response.mutable_error()->set_message(std::string(status.message()));
    response.set_server_instance_id(service_->core().instance_id());
    auto write = std::make_unique<Write>();
    write->bytes = SerializeMessage(response);
    return write;
  }

  // A batch checked and ready to be handed to GradientCore.
  struct PreparedBatch {
    std::unique_ptr<BatchJob> job;  // layer_slot set; request and answer memory reserved
    OutputRegions outputs;          // where outputs go instead of the response, when asked
  };

  // One received request, already counted in jobs_outstanding_: answered (an error or the job's
  // answer), which gives the count back. May run while the next request is read (and handled, on
  // another thread).
  void HandleRequest(ReceivedBackwardRequest received, std::int64_t received_bytes) {
    service_->metrics().AddReceivedBytes("Backward", static_cast<double>(PayloadBytes(received)));
    const std::uint64_t batch_id = received.message.batch_id();
    const std::uint64_t expected_weights_version = received.message.expected_weights_version();
    const std::uint64_t accumulation_window_id = received.message.accumulation_window_id();
    absl::StatusOr<PreparedBatch> batch = PrepareBatch(std::move(received), received_bytes);
    if (!batch.ok()) {
      QueueResponse(ErrorResponse(batch_id, batch.status()), /*job_finished=*/true);
      return;
    }
    const int layer = service_->core().settings(batch->job->request.layer_slot).index;
    const std::string instance_id = service_->core().instance_id();
    batch->job->arrival.stream_cancelled = cancelled_;
    batch->job->on_done = [this, batch_id, layer, instance_id,
                           outputs = std::move(batch->outputs)](std::unique_ptr<BatchJob> job) {
      QueueResponse(AnswerOf(batch_id, layer, instance_id, outputs, *job), /*job_finished=*/true);
    };
    absl::StatusOr<Admission> admission =
        service_->core().Admit(std::move(batch->job), client_id_, batch_id,
                               expected_weights_version, accumulation_window_id);
    if (!admission.ok()) {
      QueueResponse(ErrorResponse(batch_id, admission.status()), /*job_finished=*/true);
    }
  }

  // Checks a received request against its layer and the service's limits and makes its job: the
  // activations the request names in the client's regions are read there, the output regions
  // resolved, the request's bytes (until the worker has copied them) and the answer's (until it is
  // sent) reserved from the in-flight memory budget, and on GPU servers the inputs staged into
  // page-locked memory here, on the receiving thread. An error is the batch's answer.
  absl::StatusOr<PreparedBatch> PrepareBatch(ReceivedBackwardRequest received,
                                             std::int64_t received_bytes) {
    const GradientCore& core = service_->core();
    const v1::BackwardRequest& request = received.message;
    const std::uint64_t batch_id = request.batch_id();
    ATTNGRAD_ASSIGN_OR_RETURN(
        const ResolvedLayer layer,
        core.ResolveLayer(request.has_layer() ? std::optional<int>(request.layer()) : std::nullopt,
                          "layer"));
    ATTNGRAD_RETURN_IF_ERROR(
        ReadActivationsFromRegions(service_->regions(), client_id_, &received));
    // The output slices, kept before the request moves into the job.
    const OutputSlices output_slices = OutputSlices::Of(request);
    const std::optional<v1::StreamOrder> stream_order =
        request.has_stream_order() ? std::optional<v1::StreamOrder>(request.stream_order())
                                   : std::nullopt;
    ATTNGRAD_ASSIGN_OR_RETURN(ParsedBackward parsed,
                              ParseBackwardRequest(std::move(received), layer.config,
                                                   layer.settings, service_->limits().batch));
    PreparedBatch batch;
    batch.job = std::move(parsed.job);
    ATTNGRAD_ASSIGN_OR_RETURN(batch.outputs, ResolveOutputRegions(service_->regions(), client_id_,
                                                                  output_slices, batch.job.get()));
    if (stream_order.has_value()) {
      ATTNGRAD_RETURN_IF_ERROR(ResolveStreamOrder(service_->regions(), client_id_, *stream_order,
                                                  service_->limits().stream_order_timeout,
                                                  batch.job.get()));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(
        MemoryBudget::Reservation memory,
        service_->memory().Reserve(
            client_id_, received_bytes + static_cast<std::int64_t>(batch.job->AnswerBytes()),
            absl::StrCat("Backward batch ", batch_id, " and its answer")));
    batch.job->arrival.request_reservation = memory.Split(received_bytes);
    batch.job->result.answer.reservation = std::move(memory);
    // GPU servers: the one host copy of the inputs, here on the receiving thread.
    if (service_->arrival_staging() != nullptr) {
      ATTNGRAD_RETURN_IF_ERROR(StageOnArrival(*service_->arrival_staging(),
                                              service_->arrival_copy_threads(), *batch.job));
    }
    batch.job->request.layer_slot = layer.slot;
    return batch;
  }

  // The answer of a finished job of batch `batch_id` on `layer`: its error, or its outputs (those
  // that go to host-memory regions copied there, the others serialized from its answer buffer).
  std::unique_ptr<Write> AnswerOf(std::uint64_t batch_id, int layer, const std::string& instance_id,
                                  const OutputRegions& outputs, BatchJob& job) {
    v1::BackwardResponse fields;
    fields.set_weights_version(job.admission.weights_version);
    fields.set_accumulation_window_id(job.admission.window_id);
    fields.set_duplicate(job.admission.duplicate);
    fields.set_layer(layer);
    if (absl::IsUnimplemented(job.result.status)) {
      // The device's kernels do not compute this layer (e.g. the GPU kernels without sliding
      // windows or head_dim 256): say which layer and what serves it.
      return ErrorResponse(
          batch_id,
          absl::UnimplementedError(absl::StrCat(
              "layer ", layer, " (head_dim ", job.request.config.head_dim, ", sliding_window ",
              job.request.scalars.sliding_window, ") is not supported on ", job.result.device, ": ",
              job.result.status.message(),
              "; serve this layer from an attngrad-server with --devices=cpu")),
          std::move(fields));
    }
    if (!job.result.status.ok()) {
      return ErrorResponse(batch_id, job.result.status, std::move(fields));
    }
    fields.set_batch_id(batch_id);
    fields.set_server_instance_id(instance_id);
    auto response = std::make_unique<Write>();
    response->payload_bytes = PayloadBytes(job);
    CopyOutputsToRegions(outputs, job);
    const std::size_t grad_bytes = job.activations() * wire::DTypeSize(job.request.response_dtype);
    if (outputs.grad_hidden_states_elsewhere) {
      response->payload_bytes -= static_cast<std::int64_t>(grad_bytes);
    }
    if (outputs.weight_gradients_elsewhere) {
      response->payload_bytes -= static_cast<std::int64_t>(job.AnswerBytes() - grad_bytes);
    }
    response->bytes =
        SerializeBackwardResponse(std::move(fields), job, outputs.grad_hidden_states_elsewhere,
                                  outputs.weight_gradients_elsewhere);
    return response;
  }

  GradientService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::string client_id_;
  const Clock::time_point start_;
  grpc::ByteBuffer request_;

  std::mutex mutex_;
  // Not OK: the stream ends with it (bytes that were no request, an end marker missing or wrong).
  absl::Status end_status_;
  StreamEndCheck stream_end_;
  Clock::time_point last_progress_;  // the last request read or answer written
  bool cancel_on_expiry_ = false;
  grpc::Status expiry_status_;                 // how FinishIdle ends the stream: idle or shutdown
  bool draining_ = false;                      // the shutdown began: no new batch is computed
  std::deque<std::unique_ptr<Write>> writes_;  // front is being written
  int jobs_outstanding_ = 0;
  bool read_in_flight_ = false;
  bool write_in_flight_ = false;
  bool reads_done_ = false;
  bool broken_ = false;  // cancelled or a write failed
  // Set with broken_; shared with the stream's jobs (BatchJob::Arrival::stream_cancelled).
  const std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  bool finished_ = false;
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewBackwardReactor(
    GradientService* service, grpc::CallbackServerContext* context, std::string client_id) {
  return new BackwardReactor(service, context, std::move(client_id));
}

}  // namespace attngrad::server
