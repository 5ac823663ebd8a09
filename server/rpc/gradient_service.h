// attngrad.v1.AttentionGradient on gRPC's callback API. The reactors only parse, check and queue
// (to GradientCore); computation happens on the device workers, whose completions drive the writes.
#ifndef ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
#define ATTNGRAD_SERVER_GRADIENT_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "attngrad/v1/attngrad.grpc.pb.h"
#include "rpc/backward_request.h"
#include "scheduling/gradient_core.h"
#include "metrics/metrics.h"

namespace attngrad::server {

struct ServiceLimits {
  BatchLimits batch;
  int max_concurrent_streams = 64;  // Backward streams open at once, server-wide
  int stream_window = 4;            // batches one stream may have queued or unanswered
};

class GradientService final : public v1::AttentionGradient::CallbackService {
 public:
  GradientService(GradientCore* core, ServerMetrics* metrics, ServiceLimits limits,
                  std::string server_version);

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
  std::atomic<int>& open_streams() { return open_streams_; }

 private:
  GradientCore* const core_;
  ServerMetrics* const metrics_;
  const ServiceLimits limits_;
  const std::string server_version_;
  std::atomic<int> open_streams_{0};
};

// "OK", "INVALID_ARGUMENT", ...: the metrics' code label.
std::string StatusCodeName(int code);
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
