// The unary RPCs of attngrad.v1.AttentionGradient: GetModelInfo, ZeroGradients, RegisterRegion
// and UnregisterRegion. Each takes its request as bytes (rpc/raw_request.h, ParseCallRequest):
// authenticated first, then parsed, then served by its typed half.
#include <optional>

#include "rpc/gradient_service.h"
#include "rpc/raw_request.h"

namespace attngrad::server {
namespace {

// Finishes `reactor` with `status`, sending `response` serialized when it is OK.
grpc::ServerUnaryReactor* FinishUnary(grpc::ServerUnaryReactor* reactor, const absl::Status& status,
                                      const google::protobuf::Message& response,
                                      grpc::ByteBuffer* response_bytes) {
  if (status.ok()) *response_bytes = SerializeMessage(response);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* GradientService::GetModelInfo(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request_bytes,
                                                        grpc::ByteBuffer* response_bytes) {
  v1::GetModelInfoRequest request;
  v1::GetModelInfoResponse response;
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kInfo, "GetModelInfo");
  absl::Status status = caller.status();
  if (status.ok()) status = ParseCallRequest(*request_bytes, "GetModelInfo", &request);
  if (status.ok()) FillModelInfo(*caller, &response);
  return FinishUnary(context->DefaultReactor(), status, response, response_bytes);
}

grpc::ServerUnaryReactor* GradientService::ZeroGradients(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request_bytes,
                                                         grpc::ByteBuffer* response_bytes) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  v1::ZeroGradientsRequest request;
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kZero, "ZeroGradients");
  absl::Status status = caller.status();
  if (status.ok()) status = ParseCallRequest(*request_bytes, "ZeroGradients", &request);
  if (!status.ok()) return FinishUnary(reactor, status, request, response_bytes);
  ZeroGradients(*caller, *context, request, response_bytes, reactor);
  return reactor;
}

grpc::ServerUnaryReactor* GradientService::RegisterRegion(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request_bytes,
                                                          grpc::ByteBuffer* response_bytes) {
  v1::RegisterRegionRequest request;
  v1::RegisterRegionResponse response;
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kBackward, "RegisterRegion");
  absl::Status status = caller.status();
  if (status.ok()) status = ParseCallRequest(*request_bytes, "RegisterRegion", &request);
  if (status.ok()) status = CheckRegionCaller(context->peer());
  if (status.ok()) {
    absl::StatusOr<std::uint64_t> id = regions_.Register(caller->client_id, request);
    status = id.status();
    if (id.ok()) response.set_region_id(*id);
  }
  return FinishUnary(context->DefaultReactor(), status, response, response_bytes);
}

grpc::ServerUnaryReactor* GradientService::UnregisterRegion(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request_bytes,
                                                            grpc::ByteBuffer* response_bytes) {
  v1::UnregisterRegionRequest request;
  absl::StatusOr<Caller> caller = Admit(*context, Operation::kBackward, "UnregisterRegion");
  absl::Status status = caller.status();
  if (status.ok()) status = ParseCallRequest(*request_bytes, "UnregisterRegion", &request);
  if (status.ok()) status = regions_.Unregister(caller->client_id, request.region_id());
  return FinishUnary(context->DefaultReactor(), status, v1::UnregisterRegionResponse(),
                     response_bytes);
}

void GradientService::FillModelInfo(const Caller& caller, v1::GetModelInfoResponse* response) {
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
    info->set_stream_ordered_batches(device.stream_ordered_batches);
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
  response->set_accumulation_window_id(core_->window_id(caller.client_id));
  response->set_server_version(server_version_);
  const Scalars& defaults = core_->settings(0).scalars;
  response->set_default_scaling(defaults.scaling);
  response->set_default_softcap(defaults.softcap);
  response->set_default_eps(defaults.eps);
  response->set_model_name(core_->model_name());
  response->set_num_hidden_layers(core_->num_hidden_layers());
  response->set_backward_end_marker(true);  // rpc/stream_end.h
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
}

void GradientService::ZeroGradients(const Caller& caller,
                                    const grpc::CallbackServerContext& context,
                                    const v1::ZeroGradientsRequest& request,
                                    grpc::ByteBuffer* response_bytes,
                                    grpc::ServerUnaryReactor* reactor) {
  absl::StatusOr<std::string> owner = WindowOwner(caller, context, "ZeroGradients");
  if (!owner.ok()) {
    reactor->Finish(ToGrpcStatus(owner.status()));
    return;
  }
  absl::StatusOr<int> slot = core_->SlotOf(
      request.has_layer() ? std::optional<int>(request.layer()) : std::nullopt, "layer");
  if (!slot.ok()) {
    reactor->Finish(ToGrpcStatus(slot.status()));
    return;
  }
  core_->Zero(*owner, *slot, request.expected_window_id(),
              [reactor, response_bytes](absl::StatusOr<ZeroResult> result) {
                v1::ZeroGradientsResponse response;
                if (result.ok()) {
                  FillAccumulationState(result->previous, response.mutable_previous());
                  FillAccumulationState(result->current, response.mutable_current());
                }
                FinishUnary(reactor, result.status(), response, response_bytes);
              });
}

}  // namespace attngrad::server
