// The service: its construction, the admission of every call and the start of the streaming
// RPCs' reactors (rpc/backward_reactor.h, rpc/load_weights_reactor.h, rpc/fetch_reactor.h). The
// unary RPCs are in rpc/unary_handlers.cc.
#include "rpc/gradient_service.h"

#include "rpc/backward_reactor.h"
#include "rpc/fetch_reactor.h"
#include "rpc/load_weights_reactor.h"
#include "rpc/raw_request.h"

namespace attngrad::server {
namespace {

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

void FillAccumulationState(const WindowState& state, v1::AccumulationState* out) {
  out->set_server_instance_id(state.server_instance_id);
  out->set_window_id(state.window_id);
  out->set_weights_version(state.weights_version);
  out->set_batches(state.batches);
  out->set_tokens(state.tokens);
  out->set_layer(state.layer);
}

GradientService::GradientService(GradientCore* core, ServerMetrics* metrics, ServiceLimits limits,
                                 Authenticator authenticator, std::string server_version,
                                 std::shared_ptr<DeviceMemoryOpener> device_memory,
                                 std::shared_ptr<common::BufferPool> arrival_staging)
    : core_(core),
      metrics_(metrics),
      limits_(limits),
      authenticator_(std::move(authenticator)),
      server_version_(std::move(server_version)),
      streams_(limits.streams),
      memory_(limits.max_inflight_bytes, limits.inflight_share_per_client),
      regions_(std::move(device_memory)),
      arrival_staging_(std::move(arrival_staging)),
      arrival_copy_threads_(
          arrival_staging_ == nullptr
              ? nullptr
              : std::make_unique<common::ParallelTasks>(common::ParallelTasks::CopyThreads())) {}

absl::StatusOr<Caller> GradientService::Admit(const grpc::CallbackServerContext& context,
                                              Operation operation, const char* method) {
  absl::StatusOr<Caller> caller = authenticator_.Authenticate(context);
  absl::Status status = caller.status();
  if (status.ok()) status = Authorize(*caller, operation, method);
  if (!status.ok()) return status;
  return caller;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* GradientService::LoadWeights(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kLoadWeights, "LoadWeights");
  if (!caller.ok()) {
    return new RefusedReactor<grpc::ServerReadReactor<grpc::ByteBuffer>>(caller.status());
  }
  return NewLoadWeightsReactor(this, context, response, caller->client_id);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* GradientService::Backward(
    grpc::CallbackServerContext* context) {
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kBackward, "Backward");
  if (!caller.ok()) {
    return new RefusedReactor<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>>(
        caller.status());
  }
  return NewBackwardReactor(this, context, caller->client_id);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GradientService::FetchGradients(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request_bytes) {
  using Refused = RefusedReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>>;
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kFetchOwn, "FetchGradients");
  if (!caller.ok()) return new Refused(caller.status());
  absl::StatusOr<std::string> owner = WindowOwner(*caller, *context, "FetchGradients");
  if (!owner.ok()) return new Refused(owner.status());
  v1::FetchGradientsRequest request;
  if (absl::Status parsed = ParseCallRequest(*request_bytes, "FetchGradients", &request);
      !parsed.ok()) {
    return new Refused(parsed);
  }
  return NewFetchReactor(this, context, request, *owner, caller->client_id);
}

}  // namespace attngrad::server
