// RpcMetricsInterceptorFactory; see rpc_metrics_interceptor.h.
#include "rpc/rpc_metrics_interceptor.h"

#include <cstring>
#include <functional>
#include <mutex>
#include <set>

#include <google/protobuf/descriptor.h>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

#include "rpc/gradient_service.h"

namespace attngrad::server {
namespace {

using grpc::experimental::InterceptionHookPoints;
using Clock = std::chrono::steady_clock;

constexpr char kServicePrefix[] = "/attngrad.v1.AttentionGradient/";
// Services the server also runs whose calls are not recorded (probes and tools).
constexpr const char* kUnrecordedServicePrefixes[] = {
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
};

// The methods of attngrad.v1.AttentionGradient, from the generated descriptor (so a method added
// to the proto is recorded under its name without a change here).
const std::set<std::string, std::less<>>& ServiceMethodNames() {
  static const std::set<std::string, std::less<>>* const names = [] {
    auto* result = new std::set<std::string, std::less<>>();
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
            v1::AttentionGradient::service_full_name());
    for (int i = 0; service != nullptr && i < service->method_count(); ++i) {
      result->insert(service->method(i)->name());
    }
    return result;
  }();
  return *names;
}

// One call: notes the status sent (PRE_SEND_STATUS) and the close (POST_RECV_CLOSE), which come
// in either order (a cancelled call closes before its reactor finishes), and records the call when
// it has seen both, or when it is destroyed with the call.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(ServerMetrics* metrics, std::string method,
                        grpc::ServerContextBase* context)
      : metrics_(metrics), method_(std::move(method)), context_(context), start_(Clock::now()) {}

  ~RpcMetricsInterceptor() override { Record(); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    bool complete = false;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      std::lock_guard<std::mutex> lock(mutex_);
      end_.sent = methods->GetSendStatus().error_code();
      complete = closed_;
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_CLOSE)) {
      const bool cancelled = context_->IsCancelled();
      const bool deadline_passed =
          cancelled && CancelledAtDeadline(std::chrono::system_clock::now(), context_->deadline());
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
      end_.cancelled = cancelled;
      end_.deadline_passed = deadline_passed;
      complete = end_.sent.has_value();
    }
    if (complete) Record();
    // Last: once the batch proceeds, the call may end and this interceptor be destroyed.
    methods->Proceed();
  }

 private:
  void Record() {
    CallEnd end;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (recorded_) return;
      recorded_ = true;
      end = end_;
    }
    const std::string code = StatusCodeName(static_cast<int>(FinalCode(end)));
    metrics_->ObserveRpc(method_, code,
                         std::chrono::duration<double>(Clock::now() - start_).count());
    if (code != "OK") metrics_->CountError(method_, code);
  }

  ServerMetrics* const metrics_;
  const std::string method_;
  grpc::ServerContextBase* const context_;
  const Clock::time_point start_;
  std::mutex mutex_;
  CallEnd end_;
  bool closed_ = false;
  bool recorded_ = false;
};

}  // namespace

grpc::StatusCode FinalCode(const CallEnd& end) {
  // A service that answers a cancelled call with CANCELLED (the Backward reactor does) only
  // repeats what happened: whether the deadline caused it is decided below.
  const bool echoes_cancel = end.cancelled && end.sent == grpc::StatusCode::CANCELLED;
  if (end.sent.has_value() && *end.sent != grpc::StatusCode::OK && !echoes_cancel) {
    return *end.sent;
  }
  if (end.cancelled) {
    return end.deadline_passed ? grpc::StatusCode::DEADLINE_EXCEEDED : grpc::StatusCode::CANCELLED;
  }
  return end.sent.value_or(grpc::StatusCode::UNKNOWN);
}

bool CancelledAtDeadline(std::chrono::system_clock::time_point now,
                         std::chrono::system_clock::time_point deadline) {
  // No deadline is time_point::max(): subtracting the skew from it cannot overflow.
  return now >= deadline - kDeadlineSkew;
}

std::string MetricsMethodName(const char* full_method) {
  if (full_method == nullptr) return kUnknownMethod;
  const absl::string_view path(full_method);
  for (const char* unrecorded : kUnrecordedServicePrefixes) {
    if (absl::StartsWith(path, unrecorded)) return "";
  }
  if (!absl::StartsWith(path, kServicePrefix)) return kUnknownMethod;
  const absl::string_view method = path.substr(std::strlen(kServicePrefix));
  const std::set<std::string, std::less<>>& known = ServiceMethodNames();
  return known.find(method) != known.end() ? std::string(method) : kUnknownMethod;
}

grpc::experimental::Interceptor* RpcMetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  std::string method = MetricsMethodName(info->method());
  if (method.empty()) return nullptr;
  return new RpcMetricsInterceptor(metrics_, std::move(method), info->server_context());
}

}  // namespace attngrad::server
