// attngrad.v1.AttentionGradient on gRPC's callback API. Every call is authenticated and authorized
// first (rpc/auth.h: nothing is allocated for a refused call); the reactors only parse, check and
// queue (to GradientCore, under the caller's client id); computation happens on the device
// workers, whose completions drive the writes.
#ifndef ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
#define ATTNGRAD_SERVER_GRADIENT_SERVICE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "attngrad/v1/attngrad.grpc.pb.h"
#include "attngrad/wire/buffer_pool.h"
#include "rpc/auth.h"
#include "rpc/backward_request.h"
#include "rpc/regions.h"
#include "rpc/stream_registry.h"
#include "scheduling/gradient_core.h"
#include "scheduling/memory_budget.h"
#include "attngrad/wire/parallel_tasks.h"
#include "metrics/metrics.h"

namespace attngrad::server {

struct ServiceLimits {
  BatchLimits batch;
  StreamLimits streams;   // Backward streams open at once, server-wide and per client; idle end
  int stream_window = 4;  // batches one stream may have queued or unanswered
  // Host memory for data in flight (requests, answers not yet sent, LoadWeights staging,
  // FetchGradients results), server-wide; <= 0: no limit. See MemoryBudget.
  std::int64_t max_inflight_bytes = std::int64_t{4} << 30;
};

// The generated callback service with Backward and LoadWeights taken as raw bytes
// (grpc::ByteBuffer): the service parses them itself (rpc/raw_request.h), so that bytes that are
// no message end the stream with INVALID_ARGUMENT (gRPC would end it as a clean half-close) and a
// batch's activations stay in gRPC's receive buffers until a device worker copies them.
using AttentionGradientBase = v1::AttentionGradient::WithCallbackMethod_GetModelInfo<
    v1::AttentionGradient::WithRawCallbackMethod_LoadWeights<
        v1::AttentionGradient::WithRawCallbackMethod_Backward<
            v1::AttentionGradient::WithCallbackMethod_FetchGradients<
                v1::AttentionGradient::WithCallbackMethod_ZeroGradients<
                    v1::AttentionGradient::WithCallbackMethod_RegisterRegion<
                        v1::AttentionGradient::WithCallbackMethod_UnregisterRegion<
                            v1::AttentionGradient::Service>>>>>>>;

class GradientService final : public AttentionGradientBase {
 public:
  // `device_memory` opens CUDA IPC regions (null: a server without GPUs); `arrival_staging`:
  // page-locked memory that Backward batches are copied into as they arrive, on the receiving
  // thread (scheduling/staging.h; null: the workers copy them).
  GradientService(GradientCore* core, ServerMetrics* metrics, ServiceLimits limits,
                  Authenticator authenticator, std::string server_version,
                  std::shared_ptr<DeviceMemoryOpener> device_memory = nullptr,
                  std::shared_ptr<wire::BufferPool> arrival_staging = nullptr);

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::GetModelInfoResponse* response) override;
  // LoadWeightsRequest chunks in, a LoadWeightsResponse out.
  grpc::ServerReadReactor<grpc::ByteBuffer>* LoadWeights(grpc::CallbackServerContext* context,
                                                         grpc::ByteBuffer* response) override;
  // BackwardRequests in, BackwardResponses out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Backward(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<v1::GradientChunk>* FetchGradients(
      grpc::CallbackServerContext* context, const v1::FetchGradientsRequest* request) override;
  grpc::ServerUnaryReactor* ZeroGradients(grpc::CallbackServerContext* context,
                                          const v1::ZeroGradientsRequest* request,
                                          v1::ZeroGradientsResponse* response) override;
  // Same-host regions of the caller: shared memory or CUDA IPC (rpc/regions.h).
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* context,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response) override;

  GradientCore& core() { return *core_; }
  ServerMetrics& metrics() { return *metrics_; }
  const ServiceLimits& limits() const { return limits_; }
  StreamRegistry& streams() { return streams_; }
  MemoryBudget& memory() { return memory_; }
  const Authenticator& authenticator() const { return authenticator_; }
  const RegionRegistry& regions() const { return regions_; }
  RegionRegistry& mutable_regions() { return regions_; }
  wire::BufferPool* arrival_staging() const { return arrival_staging_.get(); }
  // The threads of the arrival copies (with arrival_staging only).
  wire::ParallelTasks& arrival_copy_threads() { return *arrival_copy_threads_; }

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
  MemoryBudget memory_;
  RegionRegistry regions_;  // unmapped (closed) when the service is destroyed
  const std::shared_ptr<wire::BufferPool> arrival_staging_;
  std::unique_ptr<wire::ParallelTasks> arrival_copy_threads_;
};

// "OK", "INVALID_ARGUMENT", ...: the metrics' code label.
std::string StatusCodeName(int code);
grpc::Status ToGrpcStatus(const absl::Status& status);
// An accumulation window's state as the protocol's AccumulationState (FetchGradients' first chunk,
// ZeroGradients' answer).
void FillAccumulationState(const WindowState& state, v1::AccumulationState* out);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
