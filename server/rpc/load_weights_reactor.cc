// The LoadWeights reactor: stages the chunks of an upload and commits them at its end.
#include "rpc/load_weights_reactor.h"

#include <chrono>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"
#include "devices/device_weights.h"
#include "rpc/gradient_service.h"
#include "rpc/raw_request.h"

namespace attngrad::server {
namespace {

using Clock = std::chrono::steady_clock;

// See load_weights_reactor.h.
class LoadWeightsReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                                 public IdleStream {
 public:
  LoadWeightsReactor(GradientService* service, grpc::CallbackServerContext* context,
                     grpc::ByteBuffer* response, std::string client_id)
      : service_(service),
        context_(context),
        response_(response),
        client_id_(std::move(client_id)),
        last_progress_(Clock::now()) {
    received_.items.fill(0);
    dtypes_.items.fill(v1::DTYPE_UNSPECIFIED);
    service_->streams().Watch(this);
    StartRead(&received_bytes_);
  }

  ~LoadWeightsReactor() override { service_->streams().Close(this); }

  // Idle: no chunk (nor the half-close) arrived for `timeout`; the staged chunks are dropped.
  bool ExpireIfIdle(Clock::time_point now, Clock::duration timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || handling_ || now - last_progress_ < timeout) return false;
    finished_ = true;
    return true;
  }

  // An upload runs on through the shutdown's grace period.
  bool Drain() override { return false; }

  void FinishIdle() override {
    Finish(grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat(
            "LoadWeights: no chunk arrived for ",
            std::chrono::duration<double>(service_->streams().limits().idle_timeout).count(),
            " s (--stream_idle_timeout_seconds) and the upload was ended; nothing was "
            "changed")));
  }

  void OnReadDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;  // ended as idle
      handling_ = true;
    }
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
    {
      std::lock_guard<std::mutex> lock(mutex_);
      handling_ = false;
      last_progress_ = Clock::now();
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
    ATTNGRAD_RETURN_IF_ERROR(TakeLayerAndVersion());
    const std::vector<std::int64_t> expected_shape = WeightShape(config_, index);
    ATTNGRAD_RETURN_IF_ERROR(CheckDTypeAndShape(index, field, expected_shape));
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

  // The upload's layer, fixed by its first chunk (unset = the first served layer), and its
  // expected_weights_version, fixed by the first chunk that names one; later chunks name the same
  // or leave them unset.
  absl::Status TakeLayerAndVersion() {
    if (slot_ < 0) {
      ATTNGRAD_ASSIGN_OR_RETURN(
          const ResolvedLayer layer,
          service_->core().ResolveLayer(
              request_.has_layer() ? std::optional<int>(request_.layer()) : std::nullopt, "layer"));
      slot_ = layer.slot;
      config_ = layer.config;
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
    return absl::OkStatus();
  }

  // The chunk's dtype and shape: the first chunk of a weight names a supported dtype (which the
  // weight's later chunks keep) and the weight's shape; later chunks name the same or leave them
  // unset.
  absl::Status CheckDTypeAndShape(Weight index, const std::string& field,
                                  const std::vector<std::int64_t>& expected_shape) {
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
    return absl::OkStatus();
  }

  // Decodes `bytes` (whole elements of the weight's dtype) into the host staging after what was
  // received so far, reserved from the in-flight memory budget.
  absl::Status Stage(Weight index, absl::string_view bytes, const std::string& field) {
    const std::size_t count = bytes.size() / wire::DTypeSize(dtypes_[index]);
    ATTNGRAD_ASSIGN_OR_RETURN(
        MemoryBudget::Reservation reservation,
        service_->memory().Reserve(client_id_, static_cast<std::int64_t>(count * sizeof(float)),
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

  // Ends the upload once (an idle end may have come first).
  void FinishWith(const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      finished_ = true;
    }
    service_->streams().Close(this);
    Finish(ToGrpcStatus(status));
  }

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

  std::mutex mutex_;
  bool finished_ = false;
  bool handling_ = false;            // a chunk or the commit is being handled: not idle
  Clock::time_point last_progress_;  // the last chunk handled
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewLoadWeightsReactor(
    GradientService* service, grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
    std::string client_id) {
  return new LoadWeightsReactor(service, context, response, std::move(client_id));
}

}  // namespace attngrad::server
