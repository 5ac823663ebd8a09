// The RPC metrics of every call of attngrad.v1.AttentionGradient, recorded in one place: a gRPC
// server interceptor (gRPC's experimental interceptor API) that sees each call end, including the
// calls gRPC itself ends: a client that cancels, a deadline that passes, a message over
// --max_message_bytes or one that does not parse. Each ended call is observed once in
// attngrad_rpc_duration_seconds{method,code} and, unless its code is OK, counted once in
// attngrad_errors_total{method,code} (the Backward reactor adds its in-band batch errors there).
//
// The code recorded is what the call really ended with, as the server can know it: the status the
// service sent when it was not OK (nor CANCELLED for a cancelled call); else CANCELLED when the
// call was cancelled (by the client, by gRPC for a broken or over-size message, or by the server's
// shutdown), DEADLINE_EXCEEDED when it was cancelled at or after its deadline (less kDeadlineSkew);
// else the status sent (OK). A stream the client cancels after the server had answered OK is
// therefore CANCELLED, not OK.
#ifndef ATTNGRAD_SERVER_RPC_METRICS_INTERCEPTOR_H_
#define ATTNGRAD_SERVER_RPC_METRICS_INTERCEPTOR_H_

#include <grpcpp/support/server_interceptor.h>

#include <chrono>
#include <optional>
#include <string>

#include "metrics/metrics.h"

namespace attngrad::server {

// How one call ended, as the interceptor saw it; FinalCode decides the code recorded.
struct CallEnd {
  std::optional<grpc::StatusCode> sent;  // the status the service sent, if it sent one
  bool cancelled = false;                // ServerContext::IsCancelled at the call's close
  bool deadline_passed = false;          // the close came at or after the call's deadline
};
grpc::StatusCode FinalCode(const CallEnd& end);

// The server's deadline starts when the call's headers arrive, so it passes a little after the
// client's: a client whose deadline passed cancels the call (RST_STREAM) up to one header's
// latency before the server's deadline. A cancel that close to the deadline is the deadline's.
inline constexpr std::chrono::milliseconds kDeadlineSkew{100};

// Whether a call cancelled at `now` was cancelled by its deadline.
bool CancelledAtDeadline(std::chrono::system_clock::time_point now,
                         std::chrono::system_clock::time_point deadline);

// The `method` label of a call: "Backward" for "/attngrad.v1.AttentionGradient/Backward" (the
// methods the service defines); empty for grpc.health.v1 and reflection, which are not recorded;
// kUnknownMethod for every other path. A client may send any path, and a label once made stays in
// /metrics for good: recording the name it sent would let it grow /metrics without bound.
inline constexpr char kUnknownMethod[] = "unknown";
std::string MetricsMethodName(const char* full_method);

class RpcMetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  ServerMetrics* const metrics_;  // outlives the gRPC server
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_METRICS_INTERCEPTOR_H_
