// The FetchGradients reactor: fetches each asked layer's sums and writes them in chunks.
#include "rpc/fetch_reactor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
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
#include "rpc/regions.h"

namespace attngrad::server {
namespace {

constexpr std::int64_t kDefaultChunkBytes = 1 << 20;

using Clock = std::chrono::steady_clock;

bool AllZero(const LayerTensors& tensors) {
  for (Weight weight : kAllWeights) {
    const std::vector<float>& values = tensors[weight];
    if (!std::all_of(values.begin(), values.end(), [](float value) { return value == 0.0f; })) {
      return false;
    }
  }
  return true;
}

// See fetch_reactor.h.
class FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>, public IdleStream {
 public:
  FetchReactor(GradientService* service, grpc::CallbackServerContext* context,
               const v1::FetchGradientsRequest& request, const std::string& window_owner,
               const std::string& caller)
      : service_(service),
        context_(context),
        window_owner_(window_owner),
        caller_(caller),
        zero_after_fetch_(request.zero_after_fetch()),
        expected_window_id_(request.expected_window_id()),
        last_progress_(Clock::now()) {
    service_->streams().Watch(this);
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
    // Before anything is fetched (or zeroed): a bad destination loses nothing.
    if (absl::Status status = ResolveDestinations(request); !status.ok()) {
      FinishWith(status);
      return;
    }
    StartLayer();
  }

  ~FetchReactor() override { service_->streams().Close(this); }

  // Idle: a chunk written that the client has not taken for `timeout` (a fetch waiting for the
  // devices' sums is not idle).
  bool ExpireIfIdle(Clock::time_point now, Clock::duration timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || !write_in_flight_ || now - last_progress_ < timeout) return false;
    finished_ = true;
    idle_status_ = absl::DeadlineExceededError(absl::StrCat(
        "FetchGradients: the client read no chunk for ",
        std::chrono::duration<double>(timeout).count(),
        " s (--stream_idle_timeout_seconds) and the call was ended; read a fetch's chunks as they "
        "come"));
    return true;
  }

  // A fetch runs on through the shutdown's grace period.
  bool Drain() override { return false; }

  void FinishIdle() override {
    context_->TryCancel();  // the write the client does not take
    Finish(ToGrpcStatus(idle_status_));
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      write_in_flight_ = false;
      last_progress_ = Clock::now();
      if (finished_) return;
    }
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
  // gradients in memory at once) and starts writing them. The sums are charged to the caller's
  // share of the in-flight memory budget while they are held: reserved before the fetch (a refused
  // fetch costs no copy of the sums, and a fetch-and-zero never loses sums to a refusal), given
  // back at once when the window holds no sums (its zeros are written from one chunk's worth of
  // zeros) and weight by weight as the sums are sent.
  void StartLayer() {
    fetch_memory_.Release();
    result_ = FetchResult();
    const int slot = slots_[layer_position_];
    if (absl::Status status = ReserveLayer(slot); !status.ok()) {
      FinishWith(status);
      return;
    }
    service_->core().Fetch(window_owner_, slot, zero_after_fetch_, expected_window_id_,
                           [this, slot](absl::StatusOr<FetchResult> result) {
                             if (!result.ok()) {
                               FinishWith(result.status());
                               return;
                             }
                             TakeResult(slot, *std::move(result));
                           });
  }

  absl::Status ReserveLayer(int slot) {
    const ResolvedLayer layer = service_->core().LayerAt(slot);
    ATTNGRAD_ASSIGN_OR_RETURN(
        fetch_memory_, service_->memory().Reserve(
                           caller_,
                           static_cast<std::int64_t>(
                               PackedWeightLayout(layer.config).total_elements * sizeof(float)),
                           absl::StrCat("FetchGradients of layer ", layer.index())));
    return absl::OkStatus();
  }

  void TakeResult(int slot, FetchResult result) {
    result_ = std::move(result);
    weight_index_ = 0;
    offset_ = 0;
    first_ = true;
    zeros_only_ = result_.state.batches == 0 && AllZero(result_.gradients);
    if (zeros_only_) {
      fetch_memory_.Release();
      result_.gradients = LayerTensors();
    }
    if (destinations_.count(slot) != 0) {
      WriteToDestinations();
      return;
    }
    WriteNext();
  }

  // The values of `weight` from `offset`, at most `count`: the fetched sums, or zeros.
  absl::Span<const float> ValuesOf(Weight weight, std::size_t offset, std::size_t count) {
    if (!zeros_only_) return absl::MakeConstSpan(result_.gradients[weight].data() + offset, count);
    if (zeros_.size() < count) zeros_.assign(count, 0.0f);
    return absl::MakeConstSpan(zeros_.data(), count);
  }

  // A weight wholly sent: its values and their share of the reservation are given back.
  void ForgetWeight(Weight weight) {
    if (zeros_only_) return;
    std::vector<float>& values = result_.gradients[weight];
    fetch_memory_.Split(static_cast<std::int64_t>(values.size() * sizeof(float))).Release();
    std::vector<float>().swap(values);
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
    const LayerConfig& config = service_->core().config(slots_[layer_position_]);
    const std::size_t total = WeightElements(config, weight);
    const std::size_t count = std::min(elements_per_chunk_, total - offset_);
    chunk_.Clear();
    if (first_) {
      FillAccumulationState(result_.state, chunk_.mutable_state());
      first_ = false;
    }
    chunk_.set_name(wire::WireWeightName(weight));
    chunk_.set_dtype(static_cast<v1::DType>(dtype_));
    if (offset_ == 0) {
      for (std::int64_t dim : WeightShape(config, weight)) chunk_.add_shape(dim);
    }
    chunk_.set_layer(result_.state.layer);
    chunk_.set_offset(static_cast<std::int64_t>(offset_));
    wire::EncodeFromFloat(ValuesOf(weight, offset_, count), dtype_, chunk_.mutable_data());
    offset_ += count;
    if (offset_ == total) {
      ForgetWeight(weight);
      ++weight_index_;
      offset_ = 0;
    }
    Write(SerializeMessage(chunk_));
  }

  // Starts writing `bytes` unless the call was ended meanwhile.
  void Write(grpc::ByteBuffer bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      write_in_flight_ = true;
      last_progress_ = Clock::now();
    }
    write_bytes_ = std::move(bytes);
    StartWrite(&write_bytes_);
  }

  // The slots' destinations of request.destinations, resolved: all six weights of a fetched layer,
  // float32, in regions of the caller.
  absl::Status ResolveDestinations(const v1::FetchGradientsRequest& request) {
    if (request.destinations_size() == 0) return absl::OkStatus();
    if (dtype_ != v1::DTYPE_FLOAT32) {
      return absl::InvalidArgumentError(
          "dtype: sums written into regions (destinations) are float32; leave dtype unset");
    }
    for (int i = 0; i < request.destinations_size(); ++i) {
      ATTNGRAD_RETURN_IF_ERROR(ResolveDestination(request, i));
    }
    for (const auto& [slot, regions] : destinations_) {
      for (Weight weight : kAllWeights) {
        if (regions[weight].region == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("destinations: layer ", service_->core().settings(slot).index,
                           " names no region for ", WeightModuleName(weight),
                           "; a layer's sums go all six into regions or none"));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status ResolveDestination(const v1::FetchGradientsRequest& request, int i) {
    const v1::GradientDestination& destination = request.destinations(i);
    const std::string field = absl::StrCat("destinations[", i, "]");
    const std::optional<Weight> weight = wire::WeightOfWireName(destination.name());
    if (!weight.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".name: unknown weight"));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(const ResolvedLayer layer,
                              service_->core().ResolveLayer(destination.layer(), field + ".layer"));
    if (std::find(slots_.begin(), slots_.end(), layer.slot) == slots_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".layer: ", destination.layer(),
                                                     " is not one of the layers fetched"));
    }
    RegionBytes& into = destinations_[layer.slot][*weight];
    if (into.region != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": layer ", destination.layer(), " ",
                                                     WeightModuleName(*weight), " named twice"));
    }
    const std::size_t bytes = WeightElements(layer.config, *weight) * sizeof(float);
    ATTNGRAD_ASSIGN_OR_RETURN(
        into, service_->regions().Resolve(caller_, destination.region(), sizeof(float), bytes,
                                          field + ".region"));
    return absl::OkStatus();
  }

  // The fetched layer's sums into its destinations, then its state alone on the stream.
  void WriteToDestinations() {
    const PerWeight<RegionBytes>& regions = destinations_[slots_[layer_position_]];
    for (Weight weight : kAllWeights) {
      if (zeros_only_)
        result_.gradients[weight].assign(
            WeightElements(service_->core().config(slots_[layer_position_]), weight), 0.0f);
      const std::vector<float>& sums = result_.gradients[weight];
      const RegionBytes& into = regions[weight];
      absl::Status status = absl::OkStatus();
      if (into.cuda_device() >= 0) {
        status = CopyToDeviceMemory(into, sums.data(), sums.size() * sizeof(float));
      } else {
        std::memcpy(into.data, sums.data(), sums.size() * sizeof(float));
      }
      if (!status.ok()) {
        FinishWith(status);
        return;
      }
    }
    chunk_.Clear();
    FillAccumulationState(result_.state, chunk_.mutable_state());
    chunk_.set_layer(result_.state.layer);
    weight_index_ = kNumWeights;  // the next write moves on to the next layer
    result_ = FetchResult{result_.state, LayerTensors()};
    fetch_memory_.Release();
    Write(SerializeMessage(chunk_));
  }

  // Ends the call once (an idle end may have come first).
  void FinishWith(const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      finished_ = true;
    }
    service_->streams().Close(this);
    result_ = FetchResult();  // the last chunk is a copy (write_bytes_)
    fetch_memory_.Release();
    Finish(ToGrpcStatus(status));
  }

  GradientService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::string window_owner_;
  const std::string caller_;  // whose regions destinations name; charged for the memory
  const bool zero_after_fetch_;
  const std::uint64_t expected_window_id_;
  std::vector<int> slots_;                              // the layers to fetch, in order
  std::size_t layer_position_ = 0;                      // into slots_
  std::map<int, PerWeight<RegionBytes>> destinations_;  // slot -> where its sums go (by reference)
  int dtype_ = v1::DTYPE_FLOAT32;
  std::size_t elements_per_chunk_ = 0;
  FetchResult result_;
  bool zeros_only_ = false;                 // the window holds no sums: result_ has no values
  std::vector<float> zeros_;                // one chunk of zeros (zeros_only_)
  MemoryBudget::Reservation fetch_memory_;  // of result_'s values not yet sent
  v1::GradientChunk chunk_;
  grpc::ByteBuffer write_bytes_;  // chunk_ serialized, being written
  int weight_index_ = 0;          // into kAllWeights
  std::size_t offset_ = 0;
  bool first_ = true;

  std::mutex mutex_;
  bool finished_ = false;
  bool write_in_flight_ = false;
  Clock::time_point last_progress_;  // the last chunk started or taken
  absl::Status idle_status_;
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* NewFetchReactor(
    GradientService* service, grpc::CallbackServerContext* context,
    const v1::FetchGradientsRequest& request, const std::string& window_owner,
    const std::string& caller) {
  return new FetchReactor(service, context, request, window_owner, caller);
}

}  // namespace attngrad::server
