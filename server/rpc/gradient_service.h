// attngrad.v1.AttentionGradient on gRPC's callback API. Every call is authenticated and authorized
// first (rpc/auth.h: nothing is allocated for a refused call); the reactors only parse, check and
// queue (to GradientCore, under the caller's client id); computation happens on the device
// workers, whose completions drive the writes.
#ifndef ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
#define ATTNGRAD_SERVER_GRADIENT_SERVICE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "attngrad/common/buffer_pool.h"
#include "attngrad/common/parallel_tasks.h"
#include "attngrad/v1/attngrad.grpc.pb.h"
#include "metrics/metrics.h"
#include "rpc/auth.h"
#include "rpc/backward_request.h"
#include "rpc/regions.h"
#include "rpc/stream_registry.h"
#include "scheduling/gradient_core.h"
#include "scheduling/memory_budget.h"

namespace attngrad::server {

struct ServiceLimits {
  BatchLimits batch;
  StreamLimits streams;   // Backward streams open at once, server-wide and per client; idle end
  int stream_window = 4;  // batches one stream may have queued or unanswered
  // Host memory for data in flight (requests, answers not yet sent, LoadWeights staging,
  // FetchGradients results), server-wide; <= 0: no limit. See MemoryBudget.
  std::int64_t max_inflight_bytes = std::int64_t{4} << 30;
  // The fraction of max_inflight_bytes one client id may hold at once (1: no per-client limit).
  double inflight_share_per_client = 0.5;
  // A stream-ordered batch (BackwardRequest.stream_order) whose ready word is not reached this long
  // after it arrived fails with DEADLINE_EXCEEDED.
  std::chrono::seconds stream_order_timeout{60};
};

// The generated callback service with every method taken as raw bytes (grpc::ByteBuffer): the
// service parses requests itself (rpc/raw_request.h), so that bytes that are no message are
// answered INVALID_ARGUMENT naming the method (gRPC would end a stream as a clean half-close, and
// answer a unary call UNIMPLEMENTED without a message), and so that a batch's activations stay in
// gRPC's receive buffers until a device worker copies them.
using AttentionGradientBase = v1::AttentionGradient::WithRawCallbackMethod_GetModelInfo<
    v1::AttentionGradient::WithRawCallbackMethod_LoadWeights<
        v1::AttentionGradient::WithRawCallbackMethod_Backward<
            v1::AttentionGradient::WithRawCallbackMethod_FetchGradients<
                v1::AttentionGradient::WithRawCallbackMethod_ZeroGradients<
                    v1::AttentionGradient::WithRawCallbackMethod_RegisterRegion<
                        v1::AttentionGradient::WithRawCallbackMethod_UnregisterRegion<
                            v1::AttentionGradient::Service>>>>>>>;

class GradientService final : public AttentionGradientBase {
 public:
  // `device_memory` opens CUDA IPC regions (null: a server without GPUs); `arrival_staging`:
  // page-locked memory that Backward batches are copied into as they arrive, on the receiving
  // thread (scheduling/staging.h; null: the workers copy them).
  GradientService(GradientCore* core, ServerMetrics* metrics, ServiceLimits limits,
                  Authenticator authenticator, std::string server_version,
                  std::shared_ptr<DeviceMemoryOpener> device_memory = nullptr,
                  std::shared_ptr<common::BufferPool> arrival_staging = nullptr);

  // The unary methods: the request's bytes in, the response's bytes out.
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  // LoadWeightsRequest chunks in, a LoadWeightsResponse out.
  grpc::ServerReadReactor<grpc::ByteBuffer>* LoadWeights(grpc::CallbackServerContext* context,
                                                         grpc::ByteBuffer* response) override;
  // BackwardRequests in, BackwardResponses out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Backward(
      grpc::CallbackServerContext* context) override;
  // A FetchGradientsRequest in, GradientChunks out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchGradients(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* ZeroGradients(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  // Same-host regions of the caller: shared memory or CUDA IPC (rpc/regions.h).
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const grpc::ByteBuffer* request,
                                             grpc::ByteBuffer* response) override;

  GradientCore& core() { return *core_; }
  ServerMetrics& metrics() { return *metrics_; }
  const ServiceLimits& limits() const { return limits_; }
  StreamRegistry& streams() { return streams_; }
  MemoryBudget& memory() { return memory_; }
  const MemoryBudget& memory() const { return memory_; }
  const Authenticator& authenticator() const { return authenticator_; }
  const RegionRegistry& regions() const { return regions_; }
  RegionRegistry& mutable_regions() { return regions_; }
  common::BufferPool* arrival_staging() const { return arrival_staging_.get(); }
  // The threads of the arrival copies (with arrival_staging only).
  common::ParallelTasks& arrival_copy_threads() { return *arrival_copy_threads_; }

 private:
  // The caller of `context` when it may perform `operation` (named `method` in errors); otherwise
  // the error (the RPC metrics count it when the call ends: rpc_metrics_interceptor.h).
  absl::StatusOr<Caller> Admit(const grpc::CallbackServerContext& context, Operation operation,
                               const char* method);
  // GetModelInfo's answer to `caller`.
  void FillModelInfo(const Caller& caller, v1::GetModelInfoResponse* response);
  // Zeroes the window the request names (an admitted caller's), finishing `reactor` when done.
  void ZeroGradients(const Caller& caller, const grpc::CallbackServerContext& context,
                     const v1::ZeroGradientsRequest& request, grpc::ByteBuffer* response,
                     grpc::ServerUnaryReactor* reactor);

  GradientCore* const core_;
  ServerMetrics* const metrics_;
  const ServiceLimits limits_;
  const Authenticator authenticator_;
  const std::string server_version_;
  StreamRegistry streams_;
  MemoryBudget memory_;
  RegionRegistry regions_;  // unmapped (closed) when the service is destroyed
  const std::shared_ptr<common::BufferPool> arrival_staging_;
  std::unique_ptr<common::ParallelTasks> arrival_copy_threads_;
};

// "OK", "INVALID_ARGUMENT", ...: the metrics' code label.
std::string StatusCodeName(int code);
grpc::Status ToGrpcStatus(const absl::Status& status);
// An accumulation window's state as the protocol's AccumulationState (FetchGradients' first chunk,
// ZeroGradients' answer).
void FillAccumulationState(const WindowState& state, v1::AccumulationState* out);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GRADIENT_SERVICE_H_
