#include "ceiling_server.h"

#include <sys/resource.h>

#include <deque>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "attngrad/v1/attngrad.grpc.pb.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server_builder.h"
#include "wire_shape.h"

namespace attngrad::wire_ceiling {
namespace {

// The shape the stream's metadata names; without one, `default_shape` (null: INVALID_ARGUMENT)
// with `*from_metadata` false.
absl::StatusOr<WireShape> ShapeOfStream(const grpc::CallbackServerContext& context,
                                        const WireShape* default_shape, bool* from_metadata) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kShapeMetadataKey);
  *from_metadata = it != metadata.end();
  if (it == metadata.end()) {
    if (default_shape != nullptr) return *default_shape;
    return absl::InvalidArgumentError(
        absl::StrCat("the stream's metadata has no ", kShapeMetadataKey,
                     " (the shape of its batches); run attngrad_wire_ceiling --connect"));
  }
  return WireShape::FromMetadata(absl::string_view(it->second.data(), it->second.size()));
}

grpc::Status ToGrpc(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// The protobuf transport: requests arrive parsed (gRPC's protobuf deserialization, as attngrad's
// server gets them); each answer is the stream's response message with the batch id set,
// serialized by gRPC.
class ProtobufCodec {
 public:
  using Request = v1::BackwardRequest;
  using Response = v1::BackwardResponse;

  // `check_sizes`: a request whose size is not what the shape implies ends the stream (false for
  // attngrad's own client, whose requests' optional fields the shape does not know).
  ProtobufCodec(const WireShape& shape, bool check_sizes)
      : shape_(shape),
        check_sizes_(check_sizes),
        response_(MakeResponse(shape)),
        request_bytes_(SizeWithBatchId(MakeRequest(shape))),
        response_bytes_(SizeWithBatchId(response_)) {}

  // The request's batch id and size; INVALID_ARGUMENT when it is not what the shape implies.
  absl::StatusOr<uint64_t> Take(Request* request, int64_t* bytes) {
    *bytes = static_cast<int64_t>(request->ByteSizeLong());
    const auto input_bytes = static_cast<size_t>(shape_.tokens() * shape_.config.hidden_size) *
                             wire::DTypeSize(shape_.input_dtype);
    if (check_sizes_ &&
        (*bytes != request_bytes_ || request->hidden_states().raw_data().size() != input_bytes ||
         request->grad_output().raw_data().size() != input_bytes)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "BackwardRequest of %d bytes (hidden_states %d, grad_output %d bytes): expected %d "
          "(%d each) for %s",
          *bytes, request->hidden_states().raw_data().size(),
          request->grad_output().raw_data().size(), request_bytes_, input_bytes,
          shape_.Describe()));
    }
    return request->batch_id();
  }
  Response* Answer(uint64_t batch_id) {
    response_.set_batch_id(batch_id);
    return &response_;
  }
  int64_t response_bytes() const { return response_bytes_; }

 private:
  const WireShape shape_;
  const bool check_sizes_;
  Response response_;
  const int64_t request_bytes_;
  const int64_t response_bytes_;
};

// The grpc::ByteBuffer transport: the request is never parsed (only its leading batch id is read)
// nor copied; the answer is a slice with the batch id field followed by one shared slice of the
// serialized response without it (reference-counted, never copied).
class ByteBufferCodec {
 public:
  using Request = grpc::ByteBuffer;
  using Response = grpc::ByteBuffer;

  ByteBufferCodec(const WireShape& shape, bool /*check_sizes: always*/) : shape_(shape) {
    const v1::BackwardResponse response = MakeResponse(shape);
    body_ = SerializedSlice(response);
    response_bytes_ = SizeWithBatchId(response);
    request_bytes_ = SizeWithBatchId(MakeRequest(shape));
  }

  absl::StatusOr<uint64_t> Take(Request* request, int64_t* bytes) {
    *bytes = static_cast<int64_t>(request->Length());
    uint64_t batch_id = 0;
    const bool has_id = ReadBatchIdField(request, &batch_id);
    request->Clear();
    if (*bytes != request_bytes_ || !has_id) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "request of %d bytes%s: expected %d for %s", *bytes,
          has_id ? "" : " not starting with a batch_id", request_bytes_, shape_.Describe()));
    }
    return batch_id;
  }
  Response* Answer(uint64_t batch_id) {
    const std::string header = EncodeBatchIdField(batch_id);
    grpc::Slice slices[2] = {grpc::Slice(header.data(), header.size()), body_};
    response_ = grpc::ByteBuffer(slices, 2);
    return &response_;
  }
  int64_t response_bytes() const { return response_bytes_; }

 private:
  const WireShape shape_;
  grpc::Slice body_;
  int64_t request_bytes_ = 0;
  int64_t response_bytes_ = 0;
  Response response_;
};

// One Backward stream: every request read is answered (in order, one write at a time) with the
// codec's response; the stream ends when the client is done writing and every answer is written,
// or with INVALID_ARGUMENT at the first request of the wrong size.
template <typename Codec>
class BackwardReactor
    : public grpc::ServerBidiReactor<typename Codec::Request, typename Codec::Response> {
 public:
  // `default_shape` (may be null): the shape of a stream whose metadata names none.
  BackwardReactor(grpc::CallbackServerContext* context, ServerCounters* counters,
                  const WireShape* default_shape)
      : counters_(counters) {
    bool from_metadata = false;
    absl::StatusOr<WireShape> shape = ShapeOfStream(*context, default_shape, &from_metadata);
    if (!shape.ok()) {
      this->Finish(ToGrpc(shape.status()));
      return;
    }
    codec_ = std::make_unique<Codec>(*shape, from_metadata);
    this->StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      std::lock_guard<std::mutex> lock(mutex_);
      reads_done_ = true;
      FinishIfDoneLocked();
      return;
    }
    int64_t bytes = 0;
    absl::StatusOr<uint64_t> batch_id = codec_->Take(&request_, &bytes);
    counters_->received_bytes.fetch_add(bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!batch_id.ok()) {
        status_ = ToGrpc(batch_id.status());
        reads_done_ = true;
        FinishIfDoneLocked();
        return;
      }
      to_answer_.push_back(*batch_id);
    }
    WriteNext();
    this->StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      writing_ = false;
      if (!ok) {
        // The client went away; nothing more can be written.
        to_answer_.clear();
        reads_done_ = true;
        FinishIfDoneLocked();
        return;
      }
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  // Starts the next answer's write when none is in progress (outside the lock: the reactions of
  // the write may run on another thread at once).
  void WriteNext() {
    uint64_t batch_id = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (writing_ || to_answer_.empty()) {
        FinishIfDoneLocked();
        return;
      }
      writing_ = true;
      batch_id = to_answer_.front();
      to_answer_.pop_front();
    }
    counters_->sent_bytes.fetch_add(codec_->response_bytes());
    counters_->batches.fetch_add(1);
    this->StartWrite(codec_->Answer(batch_id));
  }

  void FinishIfDoneLocked() {
    if (reads_done_ && !writing_ && to_answer_.empty() && !finished_) {
      finished_ = true;
      this->Finish(status_);
    }
  }

  ServerCounters* const counters_;
  std::unique_ptr<Codec> codec_;
  typename Codec::Request request_;
  std::mutex mutex_;
  std::deque<uint64_t> to_answer_;
  bool writing_ = false;
  bool reads_done_ = false;
  bool finished_ = false;
  grpc::Status status_;
};

// kStatsMethod: one (empty) request, answered with ServerStats::ToText.
class StatsReactor : public grpc::ServerGenericBidiReactor {
 public:
  explicit StatsReactor(const ServerCounters* counters) : counters_(counters) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ServerStats: no request"));
      return;
    }
    ServerStats stats;
    stats.cpu_seconds = ProcessCpuSeconds();
    stats.received_bytes = counters_->received_bytes.load();
    stats.sent_bytes = counters_->sent_bytes.load();
    stats.batches = counters_->batches.load();
    const std::string text = stats.ToText();
    grpc::Slice slice(text.data(), text.size());
    response_ = grpc::ByteBuffer(&slice, 1);
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  const ServerCounters* const counters_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

class UnknownMethodReactor : public grpc::ServerGenericBidiReactor {
 public:
  explicit UnknownMethodReactor(const std::string& method) {
    Finish(grpc::Status(
        grpc::StatusCode::UNIMPLEMENTED,
        absl::StrCat("attngrad_wire_ceiling serves ", kByteBufferBackwardMethod, ", ", kStatsMethod,
                     " and attngrad.v1.AttentionGradient/Backward, not ", method)));
  }
  void OnDone() override { delete this; }
};

}  // namespace

double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

std::string ServerStats::ToText() const {
  return absl::StrFormat("%.6f %d %d %d", cpu_seconds, received_bytes, sent_bytes, batches);
}

absl::StatusOr<ServerStats> ServerStats::FromText(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ' ');
  ServerStats stats;
  if (parts.size() != 4 || !absl::SimpleAtod(parts[0], &stats.cpu_seconds) ||
      !absl::SimpleAtoi(parts[1], &stats.received_bytes) ||
      !absl::SimpleAtoi(parts[2], &stats.sent_bytes) ||
      !absl::SimpleAtoi(parts[3], &stats.batches)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerStats answer \"", text,
                     "\": expected \"cpu_seconds received_bytes sent_bytes batches\""));
  }
  return stats;
}

class CeilingServer::ProtobufService final : public v1::AttentionGradient::CallbackService {
 public:
  ProtobufService(ServerCounters* counters, std::optional<WireShape> default_shape,
                  int64_t max_message_bytes)
      : counters_(counters),
        default_shape_(std::move(default_shape)),
        max_message_bytes_(max_message_bytes) {}
  grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* Backward(
      grpc::CallbackServerContext* context) override {
    return new BackwardReactor<ProtobufCodec>(context, counters_,
                                              default_shape_ ? &*default_shape_ : nullptr);
  }

  // With a default shape: what attngrad's client reads on connecting (the shape's layer, the
  // limits, and the instance id and versions MakeResponse's answers carry).
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* /*request*/,
                                         v1::GetModelInfoResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!default_shape_) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                   "GetModelInfo: only a server started with --serve answers it"));
      return reactor;
    }
    const v1::BackwardResponse answer = MakeResponse(*default_shape_);
    wire::LayerConfigToWire(default_shape_->config, response->mutable_config());
    response->set_weights_version(answer.weights_version());
    response->set_weights_source("attngrad_wire_ceiling");
    response->set_server_instance_id(answer.server_instance_id());
    response->set_max_message_bytes(max_message_bytes_);
    response->set_max_batch_tokens(int64_t{1} << 30);
    response->set_accumulation_window_id(answer.accumulation_window_id());
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  ServerCounters* const counters_;
  const std::optional<WireShape> default_shape_;
  const int64_t max_message_bytes_;
};

class CeilingServer::GenericService final : public grpc::CallbackGenericService {
 public:
  explicit GenericService(ServerCounters* counters) : counters_(counters) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    if (context->method() == kByteBufferBackwardMethod) {
      return new BackwardReactor<ByteBufferCodec>(context, counters_, nullptr);
    }
    if (context->method() == kStatsMethod) return new StatsReactor(counters_);
    return new UnknownMethodReactor(context->method());
  }

 private:
  ServerCounters* const counters_;
};

CeilingServer::CeilingServer() = default;

CeilingServer::~CeilingServer() {
  if (server_) server_->Shutdown();
}

absl::StatusOr<std::unique_ptr<CeilingServer>> CeilingServer::Start(
    const std::string& address, int64_t max_message_bytes, std::optional<WireShape> default_shape) {
  std::unique_ptr<CeilingServer> server(new CeilingServer());
  server->protobuf_service_ = std::make_unique<ProtobufService>(
      &server->counters_, std::move(default_shape), max_message_bytes);
  server->generic_service_ = std::make_unique<GenericService>(&server->counters_);
  grpc::ServerBuilder builder;
  // As attngrad-server (server/server.cc): the message limits, everything else gRPC's defaults.
  const int limit = static_cast<int>(std::min<int64_t>(max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &server->port_);
  builder.RegisterService(server->protobuf_service_.get());
  builder.RegisterCallbackGenericService(server->generic_service_.get());
  server->server_ = builder.BuildAndStart();
  if (!server->server_ || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  return server;
}

}  // namespace attngrad::wire_ceiling
