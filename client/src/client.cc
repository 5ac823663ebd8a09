// attngrad::Client: connection, retries, deadlines, restart detection, and the unary-style calls
// (model info, health, fetch/zero gradients, weight upload). The Backward stream is in
// backward_stream.cc.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "attngrad/client.h"
#include "attngrad/common/read_file.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "client_impl.h"

namespace attngrad {

// ---------------------------------------------------------------------------------------------
// Small helpers

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return;
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

void PrepareContext(grpc::ClientContext* context, const ClientOptions& options,
                    absl::Duration timeout) {
  SetDeadline(context, timeout);
  if (!options.token.empty()) context->AddMetadata("authorization", "Bearer " + options.token);
  if (!options.client_id.empty()) context->AddMetadata("attngrad-client-id", options.client_id);
  if (!options.for_client.empty()) context->AddMetadata("attngrad-for-client", options.for_client);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentialsFromFiles(
    const std::string& ca_file, const std::string& certificate_file, const std::string& key_file) {
  if (certificate_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS: a client certificate and its key go together (both or neither)");
  }
  grpc::SslCredentialsOptions tls;
  if (!ca_file.empty()) {
    ATTNGRAD_ASSIGN_OR_RETURN(tls.pem_root_certs, common::ReadFileToString(ca_file, "TLS CA"));
  }
  if (!certificate_file.empty()) {
    ATTNGRAD_ASSIGN_OR_RETURN(tls.pem_cert_chain,
                              common::ReadFileToString(certificate_file, "TLS client certificate"));
    ATTNGRAD_ASSIGN_OR_RETURN(tls.pem_private_key,
                              common::ReadFileToString(key_file, "TLS client key"));
  }
  return grpc::SslCredentials(tls);
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  ATTNGRAD_ASSIGN_OR_RETURN(const std::string text, common::ReadFileToString(path, "token file"));
  const absl::string_view first_line =
      absl::StripAsciiWhitespace(absl::string_view(text).substr(0, text.find('\n')));
  if (first_line.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": empty"));
  }
  return std::string(first_line);
}

int64_t HostTensor::num_elements() const { return wire::NumElements(shape); }

absl::string_view HealthStatusName(HealthStatus status) {
  switch (status) {
    case HealthStatus::kServing: return "SERVING";
    case HealthStatus::kNotServing: return "NOT_SERVING";
    case HealthStatus::kServiceUnknown: return "SERVICE_UNKNOWN";
    default: return "UNKNOWN";
  }
}

absl::StatusOr<SplitPlan> PlanSplit(int64_t batch, int64_t seq_len, const MessageSizes& sizes,
                                    int64_t max_request_bytes, int64_t max_response_bytes,
                                    int64_t max_batch_tokens) {
  if (batch < 1 || seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch and seq_len must be >= 1, got B=", batch, " S=", seq_len));
  }
  int64_t fit = batch;
  if (max_batch_tokens > 0) fit = std::min(fit, max_batch_tokens / seq_len);
  auto limit_by = [&fit](int64_t limit, int64_t fixed, int64_t per_sequence) {
    if (limit <= 0) return;
    if (per_sequence <= 0) {
      if (fixed > limit) fit = 0;
      return;
    }
    fit = std::min(fit, limit > fixed ? (limit - fixed) / per_sequence : int64_t{0});
  };
  limit_by(max_request_bytes, sizes.request_fixed, sizes.request_per_sequence);
  limit_by(max_response_bytes, sizes.response_fixed, sizes.response_per_sequence);
  if (fit < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "one sequence of seq_len=", seq_len,
        " does not fit the limits (max_batch_tokens=", max_batch_tokens,
        ", max request bytes=", max_request_bytes, ", max response bytes=", max_response_bytes,
        ", request bytes per sequence=", sizes.request_per_sequence,
        ", response bytes=", sizes.response_fixed, "+", sizes.response_per_sequence,
        " per sequence); only splits along B are exact, so shorten the sequences or raise the "
        "limits"));
  }
  const int64_t parts = (batch + fit - 1) / fit;
  SplitPlan plan;
  int64_t first = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t count = batch / parts + (p < batch % parts ? 1 : 0);
    plan.emplace_back(first, count);
    first += count;
  }
  return plan;
}

// ---------------------------------------------------------------------------------------------
// Client::Impl

Client::Impl::Impl(std::string target, ClientOptions options,
                   std::vector<std::shared_ptr<grpc::Channel>> channels)
    : target_(std::move(target)),
      options_(std::move(options)),
      channels_(std::move(channels)),
      generic_stub_(std::make_unique<grpc::GenericStub>(channels_.front())),
      request_pool_(common::BufferPool::Create(kRequestPoolBytes)),
      decode_threads_(
          std::make_unique<common::ParallelTasks>(common::ParallelTasks::CopyThreads())) {
  for (const std::shared_ptr<grpc::Channel>& channel : channels_) {
    stubs_.push_back(v1::AttentionGradient::NewStub(channel));
  }
  std::random_device device;
  const uint64_t seed = (static_cast<uint64_t>(device()) << 32) ^ device();
  // Start somewhere random in [1, 2^62) so that two clients' ids do not collide in one window.
  next_batch_id_ = (seed % ((uint64_t{1} << 62) - 1)) + 1;
}

const std::shared_ptr<grpc::Channel>& Client::Impl::NextStreamChannel() {
  return channels_[next_stream_channel_.fetch_add(1) % channels_.size()];
}

uint64_t Client::Impl::NewBatchId() {
  return next_batch_id_.fetch_add(1) & ((uint64_t{1} << 63) - 1);
}

absl::Status Client::Impl::Retry(const std::function<absl::Status()>& attempt) {
  std::mt19937_64 jitter(std::random_device{}());
  absl::Duration backoff = options_.initial_backoff;
  absl::Status status;
  const int attempts = std::max(1, options_.max_attempts);
  for (int i = 0; i < attempts; ++i) {
    status = attempt();
    const bool retryable = absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
    if (status.ok() || !retryable || i + 1 == attempts) break;
    const double factor = std::uniform_real_distribution<double>(0.5, 1.5)(jitter);
    absl::SleepFor(backoff * factor);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  if (!status.ok() && attempts > 1 &&
      (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status))) {
    return absl::Status(status.code(),
                        absl::StrCat(status.message(), " (after ", attempts, " attempts)"));
  }
  return status;
}

absl::StatusOr<v1::GetModelInfoResponse> Client::Impl::FetchInfo() {
  v1::GetModelInfoResponse response;
  absl::Status status = Retry([&]() {
    grpc::ClientContext context;
    PrepareContext(&context, options_, options_.deadline);
    return FromGrpc(stub().GetModelInfo(&context, v1::GetModelInfoRequest(), &response),
                    "GetModelInfo");
  });
  if (!status.ok()) return status;
  {
    absl::MutexLock lock(&mu_);
    info_ = response;
  }
  CheckInstance(response.server_instance_id()).IgnoreError();  // recorded; Info itself succeeds
  return response;
}

v1::GetModelInfoResponse Client::Impl::cached_info() const {
  absl::MutexLock lock(&mu_);
  return info_;
}

absl::Status Client::Impl::CheckInstance(absl::string_view seen) {
  if (seen.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (instance_id_.empty()) {
    instance_id_ = std::string(seen);
    return absl::OkStatus();
  }
  if (seen != instance_id_ && restarted_to_.empty()) restarted_to_ = std::string(seen);
  if (seen != instance_id_) return RestartStatusLocked();
  return absl::OkStatus();
}

absl::Status Client::Impl::RestartStatusLocked() const {
  if (restarted_to_.empty()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(
      "the server at ", target_, " restarted (server_instance_id changed from ", instance_id_,
      " to ", restarted_to_,
      "): its accumulated gradients and uploaded weights from before are lost; call "
      "Client::AcceptServerRestart() (or reconnect) to continue against the new server"));
}

absl::Status Client::Impl::RestartStatus() const {
  absl::MutexLock lock(&mu_);
  return RestartStatusLocked();
}

absl::Status Client::Impl::AcceptRestart() {
  absl::MutexLock lock(&mu_);
  if (!restarted_to_.empty()) {
    instance_id_ = restarted_to_;
    restarted_to_.clear();
  }
  return absl::OkStatus();
}

std::string Client::Impl::instance_id() const {
  absl::MutexLock lock(&mu_);
  return instance_id_;
}

// ---------------------------------------------------------------------------------------------
// Client

Client::Client(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        const ClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("Connect: empty target");
  if (options.channels < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions::channels must be >= 1, got ", options.channels));
  }
  auto credentials = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int index = 0; index < options.channels; ++index) {
    grpc::ChannelArguments arguments;
    const int limit = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
    arguments.SetMaxReceiveMessageSize(limit);
    arguments.SetMaxSendMessageSize(limit);
    // Connection errors are surfaced promptly; retries are ours.
    arguments.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    // Reconnect quickly after an outage (gRPC's default first backoff is 1 s, growing to 120 s), so
    // that our retries find the server soon after it is back.
    arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    // A connection of its own: gRPC shares a subchannel (one TCP connection) between channels whose
    // arguments are equal, so each channel's arguments differ by this index, and its subchannels
    // come from a pool of its own.
    arguments.SetInt("grpc.attngrad_channel_index", index);
    arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    if (!options.tls_server_name.empty()) {
      arguments.SetSslTargetNameOverride(options.tls_server_name);
    }
    channels.push_back(grpc::CreateCustomChannel(target, credentials, arguments));
  }
  if (!channels.front()->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to the attngrad server at ", target,
                                               " within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  auto impl = std::make_shared<Impl>(target, options, std::move(channels));
  if (options.read_info_on_connect) {
    auto info = impl->FetchInfo();
    if (!info.ok()) return info.status();
  }
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<v1::GetModelInfoResponse> Client::Info() { return impl_->FetchInfo(); }

v1::GetModelInfoResponse Client::cached_info() const { return impl_->cached_info(); }

absl::Status Client::AcceptServerRestart() {
  absl::Status status = impl_->AcceptRestart();
  if (!status.ok()) return status;
  return impl_->FetchInfo().status();
}

std::string Client::server_instance_id() const { return impl_->instance_id(); }
const std::string& Client::target() const { return impl_->target(); }
const ClientOptions& Client::options() const { return impl_->options(); }
int Client::channel_count() const { return impl_->channel_count(); }

absl::StatusOr<HealthStatus> Client::Health(const std::string& service) {
  // grpc.health.v1.HealthCheckRequest { string service = 1; } encoded by hand (the generic stub
  // keeps this library free of a second copy of health.proto, which the server may also link).
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);
    uint64_t length = service.size();
    while (length >= 0x80) {
      request.push_back(static_cast<char>((length & 0x7f) | 0x80));
      length >>= 7;
    }
    request.push_back(static_cast<char>(length));
    request += service;
  }
  HealthStatus result = HealthStatus::kUnknown;
  absl::Status status = impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext context;
    PrepareContext(&context, impl_->options(), impl_->options().deadline);
    grpc::Slice slice(request);
    grpc::ByteBuffer request_buffer(&slice, 1);
    grpc::ByteBuffer response_buffer;
    absl::Notification done;
    grpc::Status call_status;
    impl_->generic_stub().UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                                    &request_buffer, &response_buffer, [&](grpc::Status s) {
                                      call_status = std::move(s);
                                      done.Notify();
                                    });
    done.WaitForNotification();
    if (!call_status.ok()) return FromGrpc(call_status, "Health/Check");
    grpc::Slice bytes;
    if (!response_buffer.DumpToSingleSlice(&bytes).ok()) {
      return absl::InternalError("Health/Check: unreadable response");
    }
    // HealthCheckResponse { ServingStatus status = 1; }: tag 0x08 then a varint; absent = UNKNOWN.
    const uint8_t* data = bytes.begin();
    const size_t size = bytes.size();
    uint64_t value = 0;
    for (size_t i = 0; i + 1 < size; ++i) {
      if (data[i] != 0x08) continue;
      int shift = 0;
      for (size_t j = i + 1; j < size && shift < 64; ++j, shift += 7) {
        value |= static_cast<uint64_t>(data[j] & 0x7f) << shift;
        if (!(data[j] & 0x80)) break;
      }
      break;
    }
    result = value <= 3 ? static_cast<HealthStatus>(value) : HealthStatus::kUnknown;
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<std::unique_ptr<BackwardStream>> Client::StartStream(
    std::function<void()> on_result) {
  if (absl::Status restart = impl_->RestartStatus(); !restart.ok()) return restart;
  // A fresh look at the server: its current limits, and a restart is caught before any batch.
  auto info = impl_->FetchInfo();
  if (!info.ok()) return info.status();
  if (absl::Status restart = impl_->RestartStatus(); !restart.ok()) return restart;
  return OpenBackwardStream(impl_, impl_->options().stream_deadline, std::move(on_result));
}

absl::StatusOr<BackwardResult> Client::Backward(const BackwardBatch& batch) {
  if (absl::Status restart = impl_->RestartStatus(); !restart.ok()) return restart;
  BackwardBatch pinned = batch;
  if (pinned.batch_id == 0) pinned.batch_id = impl_->NewBatchId();
  absl::StatusOr<BackwardResult> result;
  absl::Status status = impl_->Retry([&]() -> absl::Status {
    auto stream = OpenBackwardStream(impl_, impl_->options().deadline);
    if (!stream.ok()) return stream.status();
    auto id = (*stream)->Submit(pinned);
    if (!id.ok()) return id.status();
    result = (*stream)->Await(*id);
    absl::Status finished = (*stream)->Finish();
    if (!result.ok()) return result.status();
    return finished;
  });
  if (!status.ok()) return status;
  return result;
}

namespace {

// How far one weight of a fetched layer has come: whether its first chunk (with the shape) came,
// its dtype, and the elements received.
struct FetchProgress {
  bool started = false;
  v1::DType dtype = v1::DTYPE_FLOAT32;
  int64_t received = 0;
};

// One chunk of a FetchGradients stream decoded into `all` (a chunk with a state starts the next
// layer, and a weight's first chunk carries its shape); an error names what does not fit.
absl::Status AddFetchedChunk(const v1::GradientChunk& chunk, std::vector<FetchedGradients>* all,
                             std::vector<PerWeight<FetchProgress>>* progress) {
  if (chunk.has_state()) {  // a new layer starts
    all->emplace_back();
    all->back().state = chunk.state();
    progress->emplace_back();
  }
  if (all->empty()) return absl::InternalError("FetchGradients: the server sent no state");
  if (chunk.name() == v1::WEIGHT_NAME_UNSPECIFIED) return absl::OkStatus();  // a state-only chunk
  const std::optional<Weight> named = wire::WeightOfWireName(chunk.name());
  if (!named.has_value()) {
    return absl::InternalError(
        absl::StrCat("FetchGradients: unknown weight name ", static_cast<int>(chunk.name())));
  }
  const Weight weight = *named;
  FetchProgress& p = progress->back()[weight];
  HostTensor& tensor = all->back().gradients[weight];
  if (!p.started) {
    if (chunk.shape().empty()) {
      return absl::InternalError(absl::StrCat("FetchGradients: the first chunk of ",
                                              WeightModuleName(weight), " carries no shape"));
    }
    p.started = true;
    p.dtype = chunk.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : chunk.dtype();
    tensor.shape.assign(chunk.shape().begin(), chunk.shape().end());
    tensor.data.assign(static_cast<size_t>(wire::NumElements(tensor.shape)), 0.0f);
  }
  const int64_t element = wire::DTypeSize(p.dtype);
  const int64_t count = element ? static_cast<int64_t>(chunk.data().size()) / element : 0;
  if (element == 0 || count * element != static_cast<int64_t>(chunk.data().size()) ||
      chunk.offset() < 0 || chunk.offset() + count > tensor.num_elements()) {
    return absl::InternalError(absl::StrCat(
        "FetchGradients: chunk of ", WeightModuleName(weight), " at offset ", chunk.offset(),
        " with ", chunk.data().size(), " bytes of ", wire::DTypeName(p.dtype),
        " does not fit shape ", wire::ShapeString(tensor.shape)));
  }
  absl::Status status =
      wire::DecodeToFloat(chunk.data(), p.dtype, "FetchGradients chunk",
                          absl::MakeSpan(tensor.data).subspan(chunk.offset(), count));
  p.received += count;
  return status;
}

// Whether a finished FetchGradients stream brought `expected_layers` layers, each with every
// weight in full.
absl::Status CheckFetchComplete(const std::vector<FetchedGradients>& all,
                                const std::vector<PerWeight<FetchProgress>>& progress,
                                std::size_t expected_layers) {
  if (all.size() != expected_layers) {
    return absl::InternalError(absl::StrCat("FetchGradients: the server sent ", all.size(),
                                            " layers' states, expected ", expected_layers));
  }
  for (std::size_t i = 0; i < all.size(); ++i) {
    for (Weight weight : kAllWeights) {
      const HostTensor& tensor = all[i].gradients[weight];
      if (!progress[i][weight].started || progress[i][weight].received != tensor.num_elements()) {
        return absl::InternalError(absl::StrCat("FetchGradients: layer ", all[i].state.layer(), " ",
                                                WeightModuleName(weight), " incomplete: received ",
                                                progress[i][weight].received, " of ",
                                                tensor.num_elements(), " elements"));
      }
    }
  }
  return absl::OkStatus();
}

// One FetchGradients call, its layers assembled into `all` (cleared first).
absl::Status FetchGradientsOnce(Client::Impl& impl, const v1::FetchGradientsRequest& request,
                                std::size_t expected_layers, std::vector<FetchedGradients>* all) {
  all->clear();
  std::vector<PerWeight<FetchProgress>> progress;  // per layer
  grpc::ClientContext context;
  PrepareContext(&context, impl.options(), impl.options().deadline);
  auto reader = impl.stub().FetchGradients(&context, request);
  absl::Status problem;
  v1::GradientChunk chunk;
  while (reader->Read(&chunk)) {
    // After a problem the stream is still drained, so that Finish reports the server's status.
    if (problem.ok()) problem = AddFetchedChunk(chunk, all, &progress);
  }
  ATTNGRAD_RETURN_IF_ERROR(FromGrpc(reader->Finish(), "FetchGradients"));
  ATTNGRAD_RETURN_IF_ERROR(problem);
  return CheckFetchComplete(*all, progress, expected_layers);
}

// FetchGradients of `layers` (empty: the server's first layer), assembled per layer from the
// chunks (each layer's first chunk carries its state). Retried unless zero_after.
absl::StatusOr<std::vector<FetchedGradients>> FetchLayersOf(Client::Impl& impl,
                                                            const std::vector<int>& layers,
                                                            bool zero_after,
                                                            uint64_t expected_window_id) {
  if (absl::Status restart = impl.RestartStatus(); !restart.ok()) return restart;
  v1::FetchGradientsRequest request;
  request.set_zero_after_fetch(zero_after);
  request.set_dtype(v1::DTYPE_FLOAT32);
  request.set_chunk_bytes(impl.options().chunk_bytes);
  request.set_expected_window_id(expected_window_id);
  for (int layer : layers) request.add_layers(layer);
  const std::size_t expected_layers = layers.empty() ? 1 : layers.size();
  std::vector<FetchedGradients> all;
  auto attempt = [&]() { return FetchGradientsOnce(impl, request, expected_layers, &all); };
  absl::Status status = zero_after ? attempt() : impl.Retry(attempt);
  if (!status.ok()) return status;
  for (const FetchedGradients& fetched : all) {
    if (absl::Status restart = impl.CheckInstance(fetched.state.server_instance_id());
        !restart.ok()) {
      return restart;
    }
  }
  return all;
}

}  // namespace

absl::StatusOr<FetchedGradients> Client::Fetch(bool zero_after, uint64_t expected_window_id,
                                               std::optional<int> layer) {
  absl::StatusOr<std::vector<FetchedGradients>> fetched =
      FetchLayersOf(*impl_, layer.has_value() ? std::vector<int>{*layer} : std::vector<int>{},
                    zero_after, expected_window_id);
  if (!fetched.ok()) return fetched.status();
  return std::move(fetched->front());
}

absl::StatusOr<std::vector<FetchedGradients>> Client::FetchLayers(const std::vector<int>& layers,
                                                                  bool zero_after) {
  return FetchLayersOf(*impl_, layers, zero_after, /*expected_window_id=*/0);
}

absl::StatusOr<v1::ZeroGradientsResponse> Client::Zero(uint64_t expected_window_id,
                                                       std::optional<int> layer) {
  if (absl::Status restart = impl_->RestartStatus(); !restart.ok()) return restart;
  grpc::ClientContext context;
  PrepareContext(&context, impl_->options(), impl_->options().deadline);
  v1::ZeroGradientsRequest request;
  request.set_expected_window_id(expected_window_id);
  if (layer.has_value()) request.set_layer(*layer);
  v1::ZeroGradientsResponse response;
  absl::Status status =
      FromGrpc(impl_->stub().ZeroGradients(&context, request, &response), "ZeroGradients");
  if (!status.ok()) return status;
  if (absl::Status restart = impl_->CheckInstance(response.previous().server_instance_id());
      !restart.ok()) {
    return restart;
  }
  return response;
}

absl::StatusOr<uint64_t> Client::LoadWeights(const std::vector<WeightUpload>& weights,
                                             uint64_t expected_version, std::optional<int> layer) {
  if (absl::Status restart = impl_->RestartStatus(); !restart.ok()) return restart;
  for (const WeightUpload& weight : weights) {
    const int64_t element = wire::DTypeSize(weight.dtype);
    if (element == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("LoadWeights: ", WeightModuleName(weight.weight), " has an unknown dtype ",
                       static_cast<int>(weight.dtype)));
    }
    if (static_cast<int64_t>(weight.data.size()) != wire::NumElements(weight.shape) * element) {
      return absl::InvalidArgumentError(
          absl::StrCat("LoadWeights: ", WeightModuleName(weight.weight), " has shape ",
                       wire::ShapeString(weight.shape), " of ", wire::DTypeName(weight.dtype), " (",
                       wire::NumElements(weight.shape) * element, " bytes) but ",
                       weight.data.size(), " bytes of data"));
    }
  }
  grpc::ClientContext context;
  PrepareContext(&context, impl_->options(), impl_->options().deadline);
  v1::LoadWeightsResponse response;
  auto writer = impl_->stub().LoadWeights(&context, &response);
  const int64_t chunk_bytes = std::max<int64_t>(impl_->options().chunk_bytes, 1024);
  bool writing = true;
  for (const WeightUpload& weight : weights) {
    const int64_t element = wire::DTypeSize(weight.dtype);
    const int64_t per_chunk = std::max<int64_t>(1, chunk_bytes / element);
    const int64_t total = wire::NumElements(weight.shape);
    int64_t offset = 0;
    do {
      const int64_t count = std::min(per_chunk, total - offset);
      v1::LoadWeightsRequest request;
      request.set_name(wire::WireWeightName(weight.weight));
      request.set_dtype(weight.dtype);
      if (offset == 0) {
        for (int64_t d : weight.shape) request.add_shape(d);
      }
      request.set_offset(offset);
      request.set_data(weight.data.data() + offset * element, static_cast<size_t>(count * element));
      request.set_expected_weights_version(expected_version);
      if (layer.has_value()) request.set_layer(*layer);
      writing = writer->Write(request);
      offset += count;
    } while (writing && offset < total);
    if (!writing) break;
  }
  if (writing) writer->WritesDone();
  absl::Status status = FromGrpc(writer->Finish(), "LoadWeights");
  if (!status.ok()) return status;
  return response.weights_version();
}

absl::StatusOr<uint64_t> Client::LoadWeights(const WeightSet& weights, uint64_t expected_version,
                                             std::optional<int> layer) {
  std::vector<WeightUpload> uploads;
  for (Weight weight : kAllWeights) {
    const HostTensor& tensor = weights[weight];
    uploads.push_back(
        WeightUpload{weight, v1::DTYPE_FLOAT32, tensor.shape,
                     absl::string_view(reinterpret_cast<const char*>(tensor.data.data()),
                                       tensor.data.size() * sizeof(float))});
  }
  return LoadWeights(uploads, expected_version, layer);
}

}  // namespace attngrad
