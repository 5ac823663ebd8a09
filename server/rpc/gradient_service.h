// attngrad.v1.AttentionGradient on gRPC's callback API. Every call is authenticated and authorized
// first (rpc/auth.h: nothing is allocated for a refused call); the reactors only parse, check and
// queue (to GradientCore, under the caller's client id); computation happens on the device
// workers, whose completions drive the writes.
#ifndef ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
#define ATTNGRAD_SERVER_GRADIENT_SERVICE_H_

#include <cstdint>
#include <string>

#include "attngrad/v1/attngrad.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/backward_request.h"
#include "rpc/stream_registry.h"
#include "scheduling/gradient_core.h"
#include "metrics/metrics.h"

namespace attngrad::server {

struct ServiceLimits {
  BatchLimits batch;
  StreamLimits streams;   // Backward streams open at once, server-wide and per client; idle end
  int stream_window = 4;  // batches one stream may have queued or unanswered
};

class GradientService final : public v1::AttentionGradient::CallbackService {
 public:
  GradientService(GradientCore* core, ServerMetrics* metrics, ServiceLimits limits,
                  Authenticator authenticator, std::string server_version);

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::GetModelInfoResponse* response) override;
  grpc::ServerReadReactor<v1::LoadWeightsRequest>* LoadWeights(
      grpc::CallbackServerContext* context, v1::LoadWeightsResponse* response) override;
  grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* Backward(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<v1::GradientChunk>* FetchGradients(
      grpc::CallbackServerContext* context, const v1::FetchGradientsRequest* request) override;
  grpc::ServerUnaryReactor* ZeroGradients(grpc::CallbackServerContext* context,
                                          const v1::ZeroGradientsRequest* request,
                                          v1::ZeroGradientsResponse* response) override;

  GradientCore& core() { return *core_; }
  ServerMetrics& metrics() { return *metrics_; }
  const ServiceLimits& limits() const { return limits_; }
  StreamRegistry& streams() { return streams_; }
  const Authenticator& authenticator() const { return authenticator_; }

 private:
  // The caller of `context` when it may perform `operation` (named `method` in errors); otherwise
  // the error (the RPC metrics count it when the call ends: rpc_metrics_interceptor.h).
  absl::StatusOr<Caller> Admit(const grpc::CallbackServerContext& context, Operation operation,
                               const char* method);

  GradientCore* const core_;
  ServerMetrics* const metrics_;
  const ServiceLimits limits_;
  const Authenticator authenticator_;
  const std::string server_version_;
  StreamRegistry streams_;
};

// "OK", "INVALID_ARGUMENT", ...: the metrics' code label.
std::string StatusCodeName(int code);
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
