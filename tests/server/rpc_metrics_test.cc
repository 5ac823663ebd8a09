// The RPC metrics record the code every call really ended with, including calls gRPC itself ends
// (server/rpc/rpc_metrics_interceptor.h): a Backward stream the client cancels is CANCELLED
// (before: OK, its failed read looked like a half-close), one whose deadline passes is
// DEADLINE_EXCEEDED (before: CANCELLED), a message over --max_message_bytes and a unary request
// that does not parse are counted with a non-OK code (before: OK, or not at all), and a call the
// service refuses is counted once. Checked in /metrics, which is polled: a call is recorded when
// gRPC closes it, which may come just after the client saw its status.
#include <chrono>
#include <map>
#include <regex>
#include <thread>

#include <grpcpp/generic/generic_stub.h>

#include "absl/strings/str_cat.h"

#include "rpc/gradient_service.h"
#include "rpc/rpc_metrics_interceptor.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

constexpr std::int64_t kMaxMessageBytes = 1 << 20;  // the server's least

// attngrad_<family>{code="C",method="M"} samples of one scrape: counts by code for `method`.
std::map<std::string, double> CountsByCode(const std::string& text, const std::string& family,
                                           const std::string& method) {
  std::map<std::string, double> counts;
  const std::regex line(family + R"re(\{code="([A-Z_]+)",method=")re" + method +
                        R"re("\} ([0-9.e+]+))re");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), line); it != std::sregex_iterator();
       ++it) {
    counts[(*it)[1].str()] = std::stod((*it)[2].str());
  }
  return counts;
}

class ServerRpcMetricsTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override { options.max_message_bytes = kMaxMessageBytes; }

  // rpc_duration counts by code for `method`, once they add up to `calls` (or after 5 s).
  std::map<std::string, double> RecordedCalls(const std::string& method, double calls) {
    std::map<std::string, double> counts;
    for (int attempt = 0; attempt < 100; ++attempt) {
      counts = CountsByCode(HttpGet(server().metrics_port(), "/metrics"),
                            "attngrad_rpc_duration_seconds_count", method);
      double total = 0;
      for (const auto& [code, count] : counts) total += count;
      if (total >= calls) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return counts;
  }

  std::map<std::string, double> Errors(const std::string& method) {
    return CountsByCode(HttpGet(server().metrics_port(), "/metrics"), "attngrad_errors_total",
                        method);
  }
};

TEST_F(ServerRpcMetricsTest, CancelledStreamIsCancelledNotOk) {
  if (TestOnGpu()) GTEST_SKIP() << "CPU backend";
  grpc::ClientContext context;
  auto stream = stub().Backward(&context);
  const Batch batch = MakeBatch(config(), 1, 1, 7100);
  ASSERT_TRUE(stream->Write(MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_ACCUMULATE)));
  v1::BackwardResponse response;
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_FALSE(response.has_error()) << response.error().message();
  context.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  const std::map<std::string, double> calls = RecordedCalls("Backward", 1);
  EXPECT_EQ(calls, (std::map<std::string, double>{{"CANCELLED", 1}}));
  EXPECT_EQ(Errors("Backward"), (std::map<std::string, double>{{"CANCELLED", 1}}));
}

TEST_F(ServerRpcMetricsTest, DeadlineIsDeadlineExceeded) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  auto stream = stub().Backward(&context);
  v1::BackwardResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(RecordedCalls("Backward", 1),
            (std::map<std::string, double>{{"DEADLINE_EXCEEDED", 1}}));
}

TEST_F(ServerRpcMetricsTest, OverSizeMessageIsCountedAsAnError) {
  grpc::ClientContext context;
  auto stream = stub().Backward(&context);
  const Batch batch = MakeBatch(config(), 1, 48, 7200);  // ~1.2 MB > 1 MiB
  v1::BackwardRequest request = MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_RETURN);
  ASSERT_GT(request.ByteSizeLong(), static_cast<std::size_t>(kMaxMessageBytes));
  stream->Write(request);
  stream->WritesDone();
  v1::BackwardResponse response;
  while (stream->Read(&response)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  const std::map<std::string, double> calls = RecordedCalls("Backward", 1);
  double total = 0;
  for (const auto& [code, count] : calls) total += count;
  EXPECT_EQ(total, 1) << "the call was not recorded once";
  EXPECT_EQ(calls.count("OK"), 0u) << "an over-size message recorded as OK";
  // gRPC cancels the call on the server (the client alone sees RESOURCE_EXHAUSTED).
  EXPECT_EQ(calls, (std::map<std::string, double>{{"CANCELLED", 1}}));
  double errors = 0;
  for (const auto& [code, count] : Errors("Backward")) errors += count;
  EXPECT_EQ(errors, 1);
}

TEST_F(ServerRpcMetricsTest, UnparseableUnaryRequestIsCounted) {
  // The fixture's own GetModelInfo (OK) comes first.
  ASSERT_EQ(RecordedCalls("GetModelInfo", 1), (std::map<std::string, double>{{"OK", 1}}));
  // Field 1, length-delimited, claiming 100 bytes that are not there: no message parses from it.
  const char bytes[] = {0x0a, 0x64, 0x01};
  grpc::GenericStub generic(channel());
  const grpc::Status status = RawUnaryCall(generic, "/attngrad.v1.AttentionGradient/GetModelInfo",
                                           std::string(bytes, sizeof bytes));
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  const std::string code = StatusCodeName(static_cast<int>(status.error_code()));
  EXPECT_EQ(RecordedCalls("GetModelInfo", 2),
            (std::map<std::string, double>{{"OK", 1}, {code, 1}}));
  EXPECT_EQ(Errors("GetModelInfo"), (std::map<std::string, double>{{code, 1}}));
}

// Bytes that are no request of the method are INVALID_ARGUMENT naming the method and the request
// type, for every method whose request gRPC used to parse (before: UNIMPLEMENTED, no message).
TEST_F(ServerRpcMetricsTest, GarbageRequestsAreInvalidArgumentNamingTheMethod) {
  const char bytes[] = {0x0a, 0x64, 0x01};
  grpc::GenericStub generic(channel());
  for (const char* method :
       {"GetModelInfo", "ZeroGradients", "RegisterRegion", "UnregisterRegion", "FetchGradients"}) {
    const grpc::Status status =
        RawUnaryCall(generic, absl::StrCat("/attngrad.v1.AttentionGradient/", method),
                     std::string(bytes, sizeof bytes));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << method << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(absl::StrCat(method, ": the request does not parse")),
              std::string::npos)
        << status.error_message();
  }
  // An empty message is a valid request (every field unset) and is served.
  const grpc::Status empty =
      RawUnaryCall(generic, "/attngrad.v1.AttentionGradient/GetModelInfo", "");
  EXPECT_TRUE(empty.ok()) << empty.error_message();
}

TEST_F(ServerRpcMetricsTest, RefusedAndSuccessfulCallsAreCountedOnce) {
  v1::ZeroGradientsRequest request;
  request.set_layer(7);  // the server holds layer 0 only
  v1::ZeroGradientsResponse response;
  {
    grpc::ClientContext context;
    EXPECT_EQ(stub().ZeroGradients(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  request.clear_layer();
  {
    grpc::ClientContext context;
    EXPECT_TRUE(stub().ZeroGradients(&context, request, &response).ok());
  }
  EXPECT_EQ(RecordedCalls("ZeroGradients", 2),
            (std::map<std::string, double>{{"INVALID_ARGUMENT", 1}, {"OK", 1}}));
  EXPECT_EQ(Errors("ZeroGradients"), (std::map<std::string, double>{{"INVALID_ARGUMENT", 1}}));
}

TEST(RpcMetricsInterceptorTest, FinalCode) {
  using grpc::StatusCode;
  EXPECT_EQ(FinalCode({StatusCode::OK, false, false}), StatusCode::OK);
  EXPECT_EQ(FinalCode({StatusCode::OK, true, false}), StatusCode::CANCELLED);
  EXPECT_EQ(FinalCode({StatusCode::OK, true, true}), StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(FinalCode({std::nullopt, true, false}), StatusCode::CANCELLED);
  // The Backward reactor answers a broken stream with CANCELLED: the deadline still shows.
  EXPECT_EQ(FinalCode({StatusCode::CANCELLED, true, true}), StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(FinalCode({StatusCode::CANCELLED, true, false}), StatusCode::CANCELLED);
  // gRPC reports a call the server ended with an error as cancelled: the sent code wins.
  EXPECT_EQ(FinalCode({StatusCode::PERMISSION_DENIED, true, false}), StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(FinalCode({StatusCode::RESOURCE_EXHAUSTED, false, false}),
            StatusCode::RESOURCE_EXHAUSTED);
  // The client's deadline passes first: its cancel may arrive just before the server's deadline.
  const auto deadline = std::chrono::system_clock::now();
  EXPECT_TRUE(CancelledAtDeadline(deadline, deadline));
  EXPECT_TRUE(CancelledAtDeadline(deadline - kDeadlineSkew / 2, deadline));
  EXPECT_FALSE(CancelledAtDeadline(deadline - 2 * kDeadlineSkew, deadline));
  EXPECT_FALSE(CancelledAtDeadline(deadline, std::chrono::system_clock::time_point::max()));
  EXPECT_EQ(MetricsMethodName("/attngrad.v1.AttentionGradient/Backward"), "Backward");
  EXPECT_EQ(MetricsMethodName("/grpc.health.v1.Health/Check"), "");
  EXPECT_EQ(MetricsMethodName("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
            "");
}

TEST(RpcMetricsInterceptorTest, UnknownMethodNamesShareOneLabel) {
  for (const char* method : {"Backward", "GetModelInfo", "LoadWeights", "FetchGradients",
                             "ZeroGradients", "RegisterRegion"}) {
    EXPECT_EQ(MetricsMethodName(absl::StrCat("/attngrad.v1.AttentionGradient/", method).c_str()),
              method);
  }
  for (const char* path :
       {"/attngrad.v1.AttentionGradient/NoSuchMethod", "/attngrad.v1.AttentionGradient/",
        "/attngrad.v1.AttentionGradient/Backward/x", "/other.Service/Backward",
        "/grpc.health.v1.HealthX/Check", "", "x"}) {
    EXPECT_EQ(MetricsMethodName(path), kUnknownMethod) << path;
  }
  EXPECT_EQ(MetricsMethodName(nullptr), kUnknownMethod);
}

// Calls to methods the service does not define, each under a new name, add no label to /metrics:
// they are all counted under method="unknown".
TEST_F(ServerRpcMetricsTest, UnknownMethodsDoNotGrowTheMetrics) {
  constexpr int kCalls = 40;
  grpc::GenericStub generic(channel());
  for (int i = 0; i < kCalls; ++i) {
    const std::string method =
        absl::StrCat(i % 2 == 0 ? "/attngrad.v1.AttentionGradient/Made" : "/made.Up/Method", i);
    const grpc::Status status = RawUnaryCall(generic, method, "x");
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << method;
  }
  EXPECT_EQ(RecordedCalls(kUnknownMethod, kCalls),
            (std::map<std::string, double>{{"UNIMPLEMENTED", kCalls}}));
  const std::string text = HttpGet(server().metrics_port(), "/metrics");
  EXPECT_EQ(text.find("Made"), std::string::npos) << "a made-up method name became a label";
  EXPECT_EQ(text.find("made.Up"), std::string::npos) << "a made-up method name became a label";
}

}  // namespace
}  // namespace attngrad::server::testing
