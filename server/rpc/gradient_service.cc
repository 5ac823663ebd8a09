// The reactors of attngrad.v1.AttentionGradient.
#include "rpc/gradient_service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/status_macros.h"
#include "attngrad/wire/tensor.h"
#include "devices/device_weights.h"
#include "rpc/raw_request.h"
#include "scheduling/staging.h"

namespace attngrad::server {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::int64_t kDefaultChunkBytes = 1 << 20;

void FillState(const WindowState& state, v1::AccumulationState* out) {
  out->set_server_instance_id(state.server_instance_id);
  out->set_window_id(state.window_id);
  out->set_weights_version(state.weights_version);
  out->set_batches(state.batches);
  out->set_tokens(state.tokens);
  out->set_layer(state.layer);
}

// ---------------------------------------------------------------------------------------------
// Backward: one batch per request; answers in order of completion. At most `stream_window`
// batches of a stream are queued or waiting to be written; beyond that the stream stops reading
// (gRPC flow control then pushes back on the client). The stream is counted in the service's
// StreamRegistry (server-wide and per-client limits) and ended by it when idle, or drained at
// shutdown: batches that arrive then are answered UNAVAILABLE, and the stream ends UNAVAILABLE
// (OK when the client has half-closed) as soon as the batches it has are answered. ACCUMULATE
// batches go to the window of the stream's client.
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
    const absl::Status opened = service_->streams().Open(client_id_, this);
    if (!opened.ok()) {
      finished_ = true;
      FinishStream(ToGrpcStatus(opened));
      return;
    }
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

  // One received request, already counted in jobs_outstanding_: answered (an error or the job's
  // answer), which gives the count back. May run while the next request is read (and handled, on
  // another thread).
  void HandleRequest(std::optional<ReceivedBackwardRequest> received, std::int64_t received_bytes) {
    service_->metrics().AddReceivedBytes("Backward", static_cast<double>(PayloadBytes(*received)));
    const v1::BackwardRequest& request = received->message;
    const std::uint64_t batch_id = request.batch_id();
    const std::uint64_t expected_weights_version = request.expected_weights_version();
    const std::uint64_t accumulation_window_id = request.accumulation_window_id();
    const GradientCore& core = service_->core();
    absl::StatusOr<int> slot = core.SlotOf(
        request.has_layer() ? std::optional<int>(request.layer()) : std::nullopt, "layer");
    const absl::Status from_regions =
        slot.ok() ? ReadActivationsFromRegions(service_->regions(), client_id_, &*received)
                  : slot.status();
    // The output slices, kept before the request moves into the job.
    const std::optional<v1::RegionSlice> grad_hidden_states_slice =
        request.has_grad_hidden_states_region()
            ? std::optional<v1::RegionSlice>(request.grad_hidden_states_region())
            : std::nullopt;
    const std::optional<v1::RegionSlice> weight_gradients_slice =
        request.has_weight_gradients_region()
            ? std::optional<v1::RegionSlice>(request.weight_gradients_region())
            : std::nullopt;
    absl::StatusOr<ParsedBackward> parsed =
        from_regions.ok() ? ParseBackwardRequest(*std::move(received), core.config(*slot),
                                                 core.settings(*slot), service_->limits().batch)
                          : absl::StatusOr<ParsedBackward>(from_regions);
    // Where outputs go instead of the response, when asked (rpc/regions.h).
    OutputRegions outputs;
    if (parsed.ok()) {
      absl::StatusOr<OutputRegions> resolved = ResolveOutputRegions(
          service_->regions(), client_id_,
          grad_hidden_states_slice.has_value() ? &*grad_hidden_states_slice : nullptr,
          weight_gradients_slice.has_value() ? &*weight_gradients_slice : nullptr,
          parsed->job.get());
      if (resolved.ok()) {
        outputs = *std::move(resolved);
      } else {
        parsed = resolved.status();
      }
    }
    if (!parsed.ok()) {
      QueueResponse(ErrorResponse(batch_id, parsed.status()), /*job_finished=*/true);
      return;
    }
    // The request's bytes until the worker has copied them, and the answer's until it is sent.
    absl::StatusOr<MemoryBudget::Reservation> memory = service_->memory().Reserve(
        received_bytes + static_cast<std::int64_t>(parsed->job->AnswerBytes()),
        absl::StrCat("Backward batch ", batch_id, " and its answer"));
    if (!memory.ok()) {
      QueueResponse(ErrorResponse(batch_id, memory.status()), /*job_finished=*/true);
      return;
    }
    parsed->job->request_reservation = memory->Split(received_bytes);
    parsed->job->answer.reservation = *std::move(memory);
    // GPU servers: the one host copy of the inputs, here on the receiving thread.
    if (service_->arrival_staging() != nullptr) {
      absl::Status staged = StageOnArrival(*service_->arrival_staging(),
                                           service_->arrival_copy_threads(), *parsed->job);
      if (!staged.ok()) {
        QueueResponse(ErrorResponse(batch_id, staged), /*job_finished=*/true);
        return;
      }
    }
    parsed->job->layer_slot = *slot;
    const int layer = core.settings(*slot).index;
    const std::string instance_id = core.instance_id();
    parsed->job->on_done = [this, batch_id, layer, instance_id,
                            outputs = std::move(outputs)](std::unique_ptr<BatchJob> job) {
      v1::BackwardResponse fields;
      fields.set_weights_version(job->weights_version);
      fields.set_accumulation_window_id(job->window_id);
      fields.set_duplicate(job->duplicate);
      fields.set_layer(layer);
      std::unique_ptr<Write> response;
      if (absl::IsUnimplemented(job->status)) {
        // The device's kernels do not compute this layer (e.g. the GPU kernels without sliding
        // windows or head_dim 256): say which layer and what serves it.
        response =
            ErrorResponse(batch_id,
                          absl::UnimplementedError(absl::StrCat(
                              "layer ", layer, " (head_dim ", job->config.head_dim,
                              ", sliding_window ", job->scalars.sliding_window,
                              ") is not supported on ", job->device, ": ", job->status.message(),
                              "; serve this layer from an attngrad-server with --devices=cpu")),
                          std::move(fields));
      } else if (!job->status.ok()) {
        response = ErrorResponse(batch_id, job->status, std::move(fields));
      } else {
        fields.set_batch_id(batch_id);
        fields.set_server_instance_id(instance_id);
        response = std::make_unique<Write>();
        response->payload_bytes = PayloadBytes(*job);
        CopyOutputsToRegions(outputs, *job);
        const std::size_t grad_bytes = job->activations() * wire::DTypeSize(job->response_dtype);
        if (outputs.grad_hidden_states_elsewhere) {
          response->payload_bytes -= static_cast<std::int64_t>(grad_bytes);
        }
        if (outputs.weight_gradients_elsewhere) {
          response->payload_bytes -= static_cast<std::int64_t>(job->AnswerBytes() - grad_bytes);
        }
        response->bytes =
            SerializeBackwardResponse(std::move(fields), *job, outputs.grad_hidden_states_elsewhere,
                                      outputs.weight_gradients_elsewhere);
      }
      QueueResponse(std::move(response), /*job_finished=*/true);
    };
    absl::StatusOr<Admission> admission =
        service_->core().Admit(std::move(parsed->job), client_id_, batch_id,
                               expected_weights_version, accumulation_window_id);
    if (!admission.ok()) {
      QueueResponse(ErrorResponse(batch_id, admission.status()), /*job_finished=*/true);
    }
  }

  GradientService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::string client_id_;
  const Clock::time_point start_;
  grpc::ByteBuffer request_;

  std::mutex mutex_;
  absl::Status end_status_;          // not OK: the stream ends with it (bytes that were no request)
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
  bool finished_ = false;
};

// ---------------------------------------------------------------------------------------------
// LoadWeights: chunks of each weight in order (offset = elements received so far); committed when
// the client half-closes with every weight complete. A chunk that does not parse ends the upload
// (INVALID_ARGUMENT, nothing committed). The staging grows with the data received (each chunk's
// fp32 values reserved from the in-flight memory budget as it arrives), never ahead of it.
class LoadWeightsReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  LoadWeightsReactor(GradientService* service, grpc::CallbackServerContext* context,
                     grpc::ByteBuffer* response, std::string client_id)
      : service_(service),
        context_(context),
        response_(response),
        client_id_(std::move(client_id)) {
    received_.items.fill(0);
    dtypes_.items.fill(v1::DTYPE_UNSPECIFIED);
    StartRead(&received_bytes_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (context_->IsCancelled()) {
        FinishWith(absl::CancelledError("LoadWeights: cancelled; nothing was changed"));
        return;
      }
      FinishWith(Commit());
      return;
    }
    request_.Clear();
    absl::Status status = ParseReceivedMessage(&received_bytes_, &request_);
    received_bytes_.Clear();
    if (status.ok()) status = HandleChunk();
    if (!status.ok()) {
      FinishWith(status);
      return;
    }
    StartRead(&received_bytes_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status HandleChunk() {
    service_->metrics().AddReceivedBytes("LoadWeights",
                                         static_cast<double>(request_.data().size()));
    const std::optional<Weight> named = wire::WeightOfWireName(request_.name());
    if (!named.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("name: unknown weight ", request_.name(),
                       "; expected WEIGHT_NAME_Q_PROJ, K_PROJ, V_PROJ, O_PROJ, Q_NORM or K_NORM"));
    }
    const Weight index = *named;
    const std::string field = WeightModuleName(index);
    // The layer: named by the first chunk (unset = the first served layer); later chunks name
    // the same one or leave it unset.
    if (slot_ < 0) {
      ATTNGRAD_ASSIGN_OR_RETURN(
          slot_,
          service_->core().SlotOf(
              request_.has_layer() ? std::optional<int>(request_.layer()) : std::nullopt, "layer"));
      config_ = service_->core().config(slot_);
    } else if (request_.has_layer() && request_.layer() != service_->core().settings(slot_).index) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer: chunks of one upload name different layers (",
                       service_->core().settings(slot_).index, " and ", request_.layer(), ")"));
    }
    if (request_.expected_weights_version() != 0) {
      if (expected_version_ != 0 && expected_version_ != request_.expected_weights_version()) {
        return absl::InvalidArgumentError(
            absl::StrCat("expected_weights_version: chunks disagree (", expected_version_, " and ",
                         request_.expected_weights_version(), ")"));
      }
      expected_version_ = request_.expected_weights_version();
    }
    const std::vector<std::int64_t> expected_shape = WeightShape(config_, index);
    const std::vector<std::int64_t> shape(request_.shape().begin(), request_.shape().end());
    if (dtypes_[index] == v1::DTYPE_UNSPECIFIED) {  // first chunk of this weight
      if (!wire::IsSupportedDType(request_.dtype())) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".dtype: ", wire::DTypeName(request_.dtype()),
                         " is not supported; the first chunk of a weight must name float32, "
                         "float16 or bfloat16"));
      }
      if (shape != expected_shape) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".shape: got ",
                                                       wire::ShapeString(shape), ", expected ",
                                                       wire::ShapeString(expected_shape)));
      }
      dtypes_[index] = request_.dtype();
    } else {
      if (request_.dtype() != v1::DTYPE_UNSPECIFIED && request_.dtype() != dtypes_[index]) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".dtype: ", wire::DTypeName(request_.dtype()),
            " differs from the weight's first chunk (", wire::DTypeName(dtypes_[index]), ")"));
      }
      if (!shape.empty() && shape != expected_shape) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".shape: got ",
                                                       wire::ShapeString(shape), ", expected ",
                                                       wire::ShapeString(expected_shape)));
      }
    }
    const std::size_t element_size = wire::DTypeSize(dtypes_[index]);
    const std::size_t total = WeightElements(config_, index);
    if (request_.has_region()) return TakeWeightFromRegion(index, element_size * total);
    if (request_.offset() != static_cast<std::int64_t>(received_[index])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".offset: got ", request_.offset(), ", expected ", received_[index],
                       " (the chunks of a weight must come in order, without gaps or overlaps)"));
    }
    if (request_.data().size() % element_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".data: ", request_.data().size(),
                                                     " bytes is not a whole number of ",
                                                     wire::DTypeName(dtypes_[index]), " elements"));
    }
    const std::size_t count = request_.data().size() / element_size;
    if (count > total - received_[index]) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".data: ", count, " elements at offset ", received_[index], " overflow the ",
          total, " elements of ", wire::ShapeString(expected_shape)));
    }
    return Stage(index, request_.data(), field + ".data");
  }

  // Decodes `bytes` (whole elements of the weight's dtype) into the host staging after what was
  // received so far, reserved from the in-flight memory budget.
  absl::Status Stage(Weight index, absl::string_view bytes, const std::string& field) {
    const std::size_t count = bytes.size() / wire::DTypeSize(dtypes_[index]);
    ATTNGRAD_ASSIGN_OR_RETURN(
        MemoryBudget::Reservation reservation,
        service_->memory().Reserve(static_cast<std::int64_t>(count * sizeof(float)),
                                   absl::StrCat("LoadWeights ", field)));
    reservations_.push_back(std::move(reservation));
    staging_[index].resize(received_[index] + count);
    const absl::Span<float> values =
        absl::MakeSpan(staging_[index].data() + received_[index], count);
    ATTNGRAD_RETURN_IF_ERROR(wire::DecodeToFloat(bytes, dtypes_[index], field, values));
    ATTNGRAD_RETURN_IF_ERROR(wire::CheckFinite(values, field));
    received_[index] += count;
    return absl::OkStatus();
  }

  // A chunk naming the whole weight in a region of the caller: host memory is staged like data,
  // GPU memory is kept for the copy on the device at Commit (all six weights must come so).
  absl::Status TakeWeightFromRegion(Weight index, std::size_t weight_bytes) {
    const std::string field = absl::StrCat(WeightModuleName(index), ".region");
    if (request_.offset() != 0 || received_[index] != 0 || !request_.data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ": a chunk naming a region carries the whole weight (offset 0, no data, no "
                       "other chunk of this weight)"));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(
        RegionBytes bytes,
        service_->regions().Resolve(client_id_, request_.region(), wire::DTypeSize(dtypes_[index]),
                                    weight_bytes, field));
    if (bytes.cuda_device() < 0) {
      return Stage(index, absl::string_view(bytes.data, bytes.size), field);
    }
    device_sources_[index] =
        DeviceWeightSource{std::move(bytes), static_cast<v1::DType>(dtypes_[index])};
    received_[index] = WeightElements(config_, index);
    ++device_weights_;
    return absl::OkStatus();
  }

  // The weights of this upload: host staging, or a copy on the GPU of weights by reference.
  absl::StatusOr<LayerWeights> CollectWeights() {
    LayerWeights weights;
    weights.config = config_;
    if (device_weights_ == 0) {
      weights.values = std::move(staging_);
      weights.source = "upload";
      return weights;
    }
    if (device_weights_ != kNumWeights) {
      return absl::InvalidArgumentError(
          absl::StrCat("region: ", device_weights_,
                       " of the six weights are in GPU memory; weights by "
                       "reference in GPU memory must name all six; nothing was changed"));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(weights.device_values,
                              CopyWeightsFromDevice(config_, device_sources_));
    device_sources_ = {};  // the client's memory is no longer needed
    weights.source = "cuda_ipc";
    return weights;
  }

  absl::Status Commit() {
    if (slot_ < 0) {
      return absl::InvalidArgumentError(
          "LoadWeights: no chunks; every weight must be sent in full; nothing was changed");
    }
    for (Weight weight : kAllWeights) {
      if (received_[weight] != WeightElements(config_, weight)) {
        return absl::InvalidArgumentError(
            absl::StrCat(WeightModuleName(weight), ": got ", received_[weight], " of ",
                         WeightElements(config_, weight),
                         " elements; every weight must be sent in full; nothing was changed"));
      }
    }
    ATTNGRAD_ASSIGN_OR_RETURN(LayerWeights weights, CollectWeights());
    ATTNGRAD_ASSIGN_OR_RETURN(
        const std::uint64_t version,
        service_->core().ReplaceWeights(slot_, std::move(weights), expected_version_));
    v1::LoadWeightsResponse response;
    response.set_weights_version(version);
    response.set_layer(service_->core().settings(slot_).index);
    *response_ = SerializeMessage(response);
    return absl::OkStatus();
  }

  void FinishWith(const absl::Status& status) { Finish(ToGrpcStatus(status)); }

  GradientService* const service_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;
  const std::string client_id_;  // whose regions the chunks may name
  int slot_ = -1;                // the layer, once the first chunk named it
  LayerConfig config_;
  LayerTensors staging_;                                 // each weight's values received so far
  std::vector<MemoryBudget::Reservation> reservations_;  // of staging_
  grpc::ByteBuffer received_bytes_;
  PerWeight<std::size_t> received_;
  PerWeight<int> dtypes_;
  std::uint64_t expected_version_ = 0;
  PerWeight<DeviceWeightSource> device_sources_;  // weights by reference in GPU memory
  int device_weights_ = 0;                        // how many
  v1::LoadWeightsRequest request_;
};

// ---------------------------------------------------------------------------------------------
// FetchGradients: the summed accumulators, each weight in chunks of at most chunk_bytes.
class FetchReactor final : public grpc::ServerWriteReactor<v1::GradientChunk> {
 public:
  FetchReactor(GradientService* service, const v1::FetchGradientsRequest& request,
               const std::string& window_owner)
      : service_(service),
        window_owner_(window_owner),
        zero_after_fetch_(request.zero_after_fetch()),
        expected_window_id_(request.expected_window_id()) {
    dtype_ = request.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : request.dtype();
    if (!wire::IsSupportedDType(dtype_)) {
      FinishWith(absl::InvalidArgumentError(
          absl::StrCat("dtype: ", wire::DTypeName(dtype_),
                       " is not supported; expected float32, float16 or bfloat16")));
      return;
    }
    if (request.chunk_bytes() < 0) {
      FinishWith(absl::InvalidArgumentError(
          absl::StrCat("chunk_bytes: ", request.chunk_bytes(),
                       " is negative; expected 0 (default 1 MiB) or more")));
      return;
    }
    std::int64_t chunk_bytes =
        request.chunk_bytes() == 0 ? kDefaultChunkBytes : request.chunk_bytes();
    chunk_bytes = std::max<std::int64_t>(chunk_bytes, 1024);
    chunk_bytes =
        std::min<std::int64_t>(chunk_bytes, service_->limits().batch.max_message_bytes - 65536);
    chunk_bytes = std::max<std::int64_t>(chunk_bytes, 1024);
    elements_per_chunk_ = static_cast<std::size_t>(chunk_bytes) / wire::DTypeSize(dtype_);
    // The layers, in the order asked (none: the first served layer).
    for (int i = 0; i < std::max(1, request.layers_size()); ++i) {
      const std::string field = absl::StrCat("layers[", i, "]");
      absl::StatusOr<int> slot = service_->core().SlotOf(
          request.layers_size() == 0 ? std::nullopt : std::optional<int>(request.layers(i)), field);
      if (!slot.ok()) {
        FinishWith(slot.status());
        return;
      }
      if (std::find(slots_.begin(), slots_.end(), *slot) != slots_.end()) {
        FinishWith(absl::InvalidArgumentError(
            absl::StrCat(field, ": layer ", request.layers(i), " is listed twice")));
        return;
      }
      slots_.push_back(*slot);
    }
    if (slots_.size() > 1 && expected_window_id_ != 0) {
      FinishWith(absl::InvalidArgumentError(
          "expected_window_id: windows are per layer; name one layer with it, or leave it 0"));
      return;
    }
    StartLayer();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishWith(absl::CancelledError("FetchGradients: the client went away"));
      return;
    }
    service_->metrics().AddSentBytes("FetchGradients", static_cast<double>(chunk_.data().size()));
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  // Fetches the next layer's sums (one layer at a time: a fetch of many layers holds one layer's
  // gradients in memory at once) and starts writing them.
  void StartLayer() {
    // The layer's sums are held in memory while they are written: reserved first (a client that
    // does not read holds them, within the budget).
    fetch_memory_.Release();
    result_ = FetchResult();
    const LayerConfig& config = service_->core().config(slots_[layer_position_]);
    absl::StatusOr<MemoryBudget::Reservation> memory = service_->memory().Reserve(
        static_cast<std::int64_t>(PackedWeightLayout(config).total_elements * sizeof(float)),
        absl::StrCat("FetchGradients of layer ",
                     service_->core().settings(slots_[layer_position_]).index));
    if (!memory.ok()) {
      FinishWith(memory.status());
      return;
    }
    fetch_memory_ = *std::move(memory);
    service_->core().Fetch(window_owner_, slots_[layer_position_], zero_after_fetch_,
                           expected_window_id_, [this](absl::StatusOr<FetchResult> result) {
                             if (!result.ok()) {
                               FinishWith(result.status());
                               return;
                             }
                             result_ = *std::move(result);
                             weight_index_ = 0;
                             offset_ = 0;
                             first_ = true;
                             WriteNext();
                           });
  }

  void WriteNext() {
    if (weight_index_ == kNumWeights) {
      if (++layer_position_ < slots_.size()) {
        StartLayer();
        return;
      }
      FinishWith(absl::OkStatus());
      return;
    }
    const Weight weight = kAllWeights[static_cast<std::size_t>(weight_index_)];
    const std::vector<float>& values = result_.gradients[weight];
    const std::size_t count = std::min(elements_per_chunk_, values.size() - offset_);
    chunk_.Clear();
    if (first_) {
      FillState(result_.state, chunk_.mutable_state());
      first_ = false;
    }
    chunk_.set_name(wire::WireWeightName(weight));
    chunk_.set_dtype(static_cast<v1::DType>(dtype_));
    if (offset_ == 0) {
      const LayerConfig& config = service_->core().config(slots_[layer_position_]);
      for (std::int64_t dim : WeightShape(config, weight)) chunk_.add_shape(dim);
    }
    chunk_.set_layer(result_.state.layer);
    chunk_.set_offset(static_cast<std::int64_t>(offset_));
    wire::EncodeFromFloat(absl::MakeConstSpan(values.data() + offset_, count), dtype_,
                          chunk_.mutable_data());
    offset_ += count;
    if (offset_ == values.size()) {
      ++weight_index_;
      offset_ = 0;
    }
    StartWrite(&chunk_);
  }

  void FinishWith(const absl::Status& status) {
    result_ = FetchResult();  // the last chunk is a copy (chunk_)
    fetch_memory_.Release();
    Finish(ToGrpcStatus(status));
  }

  GradientService* const service_;
  const std::string window_owner_;
  const bool zero_after_fetch_;
  const std::uint64_t expected_window_id_;
  std::vector<int> slots_;          // the layers to fetch, in order
  std::size_t layer_position_ = 0;  // into slots_
  int dtype_ = v1::DTYPE_FLOAT32;
  std::size_t elements_per_chunk_ = 0;
  FetchResult result_;
  MemoryBudget::Reservation fetch_memory_;  // of result_
  v1::GradientChunk chunk_;
  int weight_index_ = 0;  // into kAllWeights
  std::size_t offset_ = 0;
  bool first_ = true;
};

// A call refused before its reactor was made (authentication, authorization): finished at once.
template <typename Reactor>
class RefusedReactor final : public Reactor {
 public:
  explicit RefusedReactor(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

std::string StatusCodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

GradientService::GradientService(GradientCore* core, ServerMetrics* metrics, ServiceLimits limits,
                                 Authenticator authenticator, std::string server_version,
                                 std::shared_ptr<DeviceMemoryOpener> device_memory,
                                 std::shared_ptr<wire::BufferPool> arrival_staging)
    : core_(core),
      metrics_(metrics),
      limits_(limits),
      authenticator_(std::move(authenticator)),
      server_version_(std::move(server_version)),
      streams_(limits.streams),
      memory_(limits.max_inflight_bytes),
      regions_(std::move(device_memory)),
      arrival_staging_(std::move(arrival_staging)),
      arrival_copy_threads_(arrival_staging_ == nullptr ? nullptr
                                                        : std::make_unique<wire::ParallelTasks>(
                                                              wire::ParallelTasks::CopyThreads())) {
}

absl::StatusOr<Caller> GradientService::Admit(const grpc::CallbackServerContext& context,
                                              Operation operation, const char* method) {
  absl::StatusOr<Caller> caller = authenticator_.Authenticate(context);
  absl::Status status = caller.status();
  if (status.ok()) status = Authorize(*caller, operation, method);
  if (!status.ok()) return status;
  return caller;
}

grpc::ServerUnaryReactor* GradientService::GetModelInfo(grpc::CallbackServerContext* context,
                                                        const v1::GetModelInfoRequest*,
                                                        v1::GetModelInfoResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kInfo, "GetModelInfo");
  if (!caller.ok()) {
    reactor->Finish(ToGrpcStatus(caller.status()));
    return reactor;
  }
  const LayerConfig& config = core_->config();
  wire::LayerConfigToWire(config, response->mutable_config());
  response->set_weights_version(core_->weights_version());
  response->set_weights_source(core_->weights_source());
  response->set_server_instance_id(core_->instance_id());
  bool any_gpu = false;
  for (const DeviceDescription& device : core_->Devices()) {
    v1::DeviceInfo* info = response->add_devices();
    info->set_index(device.index);
    info->set_name(device.name);
    info->set_backend(device.backend);
    info->set_memory_total_bytes(device.memory_total_bytes);
    info->set_memory_used_bytes(device.memory_used_bytes);
    any_gpu |= device.backend == "cuda";
  }
  response->add_supported_precisions(v1::PRECISION_AUTO);
  response->add_supported_precisions(v1::PRECISION_FP32);
  if (any_gpu) {
    response->add_supported_precisions(v1::PRECISION_TF32);
    response->add_supported_precisions(v1::PRECISION_FP16);
  }
  response->add_supported_wire_dtypes(v1::DTYPE_FLOAT32);
  response->add_supported_wire_dtypes(v1::DTYPE_FLOAT16);
  response->add_supported_wire_dtypes(v1::DTYPE_BFLOAT16);
  response->set_max_message_bytes(limits_.batch.max_message_bytes);
  response->set_max_batch_tokens(limits_.batch.max_batch_tokens);
  response->set_accumulation_window_id(core_->window_id(caller->client_id));
  response->set_server_version(server_version_);
  const Scalars& defaults = core_->settings(0).scalars;
  response->set_default_scaling(defaults.scaling);
  response->set_default_softcap(defaults.softcap);
  response->set_default_eps(defaults.eps);
  response->set_model_name(core_->model_name());
  response->set_num_hidden_layers(core_->num_hidden_layers());
  for (const GradientCore::LayerDescription& layer : core_->Layers()) {
    v1::LayerInfo* info = response->add_layers();
    info->set_index(layer.settings.index);
    wire::LayerConfigToWire(layer.config, info->mutable_config());
    info->set_type(layer.settings.type == AttentionType::kSliding ? v1::ATTENTION_TYPE_SLIDING
                                                                  : v1::ATTENTION_TYPE_FULL);
    info->set_sliding_window(layer.settings.scalars.sliding_window);
    info->set_rope_theta(layer.settings.rope_theta);
    info->set_rope_scaling_factor(layer.settings.rope_scaling_factor);
    info->set_scaling(layer.settings.scalars.scaling);
    info->set_softcap(layer.settings.scalars.softcap);
    info->set_eps(layer.settings.scalars.eps);
    info->set_weights_version(layer.weights_version);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* GradientService::LoadWeights(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kLoadWeights, "LoadWeights");
  if (!caller.ok()) {
    return new RefusedReactor<grpc::ServerReadReactor<grpc::ByteBuffer>>(caller.status());
  }
  return new LoadWeightsReactor(this, context, response, caller->client_id);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* GradientService::Backward(
    grpc::CallbackServerContext* context) {
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kBackward, "Backward");
  if (!caller.ok()) {
    return new RefusedReactor<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>>(
        caller.status());
  }
  return new BackwardReactor(this, context, caller->client_id);
}

grpc::ServerWriteReactor<v1::GradientChunk>* GradientService::FetchGradients(
    grpc::CallbackServerContext* context, const v1::FetchGradientsRequest* request) {
  using Refused = RefusedReactor<grpc::ServerWriteReactor<v1::GradientChunk>>;
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kFetchOwn, "FetchGradients");
  if (!caller.ok()) return new Refused(caller.status());
  absl::StatusOr<std::string> owner = WindowOwner(*caller, *context, "FetchGradients");
  if (!owner.ok()) return new Refused(owner.status());
  return new FetchReactor(this, *request, *owner);
}

grpc::ServerUnaryReactor* GradientService::ZeroGradients(grpc::CallbackServerContext* context,
                                                         const v1::ZeroGradientsRequest* request,
                                                         v1::ZeroGradientsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kZero, "ZeroGradients");
  absl::StatusOr<std::string> owner =
      caller.ok() ? WindowOwner(*caller, *context, "ZeroGradients") : caller.status();
  if (!owner.ok()) {
    reactor->Finish(ToGrpcStatus(owner.status()));
    return reactor;
  }
  absl::StatusOr<int> slot = core_->SlotOf(
      request->has_layer() ? std::optional<int>(request->layer()) : std::nullopt, "layer");
  if (!slot.ok()) {
    reactor->Finish(ToGrpcStatus(slot.status()));
    return reactor;
  }
  core_->Zero(*owner, *slot, request->expected_window_id(),
              [reactor, response](absl::StatusOr<ZeroResult> result) {
                if (result.ok()) {
                  FillState(result->previous, response->mutable_previous());
                  FillState(result->current, response->mutable_current());
                }
                reactor->Finish(ToGrpcStatus(result.status()));
              });
  return reactor;
}

grpc::ServerUnaryReactor* GradientService::RegisterRegion(grpc::CallbackServerContext* context,
                                                          const v1::RegisterRegionRequest* request,
                                                          v1::RegisterRegionResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kBackward, "RegisterRegion");
  absl::StatusOr<std::uint64_t> id = caller.ok() ? regions_.Register(caller->client_id, *request)
                                                 : absl::StatusOr<std::uint64_t>(caller.status());
  if (id.ok()) response->set_region_id(*id);
  reactor->Finish(ToGrpcStatus(id.status()));
  return reactor;
}

grpc::ServerUnaryReactor* GradientService::UnregisterRegion(
    grpc::CallbackServerContext* context, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kBackward, "UnregisterRegion");
  const absl::Status status =
      caller.ok() ? regions_.Unregister(caller->client_id, request->region_id()) : caller.status();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace attngrad::server
