// The end marker of a Backward stream (BackwardRequest.end, declared with the request metadata
// attngrad-end-marker: 1; rpc/stream_end.h): the checks on their own, the server answering
// declared and undeclared streams, and the C++ client declaring and sending it to a stand-in
// server that records what arrives. A stream cut inside its last message, which only hand-made
// HTTP/2 frames can send, is in truncated_message_test.cc.
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/client.h"
#include "attngrad/wire/backward_messages.h"
#include "rpc/stream_end.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// The checks

ReceivedBackwardRequest Marker(std::uint64_t requests) {
  v1::BackwardRequest message;
  message.mutable_end()->set_requests(requests);
  return ReceivedFromMessage(std::move(message));
}

TEST(StreamEndCheckTest, ADeclaredStreamEndsWellOnlyWithAMarkerThatCountsItsRequests) {
  StreamEndCheck check(/*declared=*/true);
  ASSERT_TRUE(check.Request().ok());
  ASSERT_TRUE(check.Request().ok());
  EXPECT_TRUE(check.Marker(Marker(2)).ok());
  EXPECT_TRUE(check.HalfClosed().ok());

  StreamEndCheck unmarked(/*declared=*/true);
  ASSERT_TRUE(unmarked.Request().ok());
  const absl::Status missing = unmarked.HalfClosed();
  EXPECT_EQ(missing.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(missing.message().find("without its end marker"), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("inside or before a message"), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("after the 1 request(s)"), std::string::npos) << missing;

  StreamEndCheck miscounted(/*declared=*/true);
  ASSERT_TRUE(miscounted.Request().ok());
  const absl::Status lost = miscounted.Marker(Marker(2));
  EXPECT_EQ(lost.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(lost.message().find("says 2 request(s) were sent before it, but 1 arrived whole"),
            std::string::npos)
      << lost;
}

TEST(StreamEndCheckTest, AnUndeclaredStreamMayEndWithoutAMarkerButAMarkerIsChecked) {
  StreamEndCheck check;
  ASSERT_TRUE(check.Request().ok());
  EXPECT_TRUE(check.HalfClosed().ok());
  EXPECT_EQ(check.Marker(Marker(0)).code(), absl::StatusCode::kDataLoss);
}

TEST(StreamEndCheckTest, TheMarkerIsLastAndCarriesNothingElse) {
  StreamEndCheck after(/*declared=*/true);
  ASSERT_TRUE(after.Marker(Marker(0)).ok());
  EXPECT_EQ(after.Request().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(after.Marker(Marker(0)).code(), absl::StatusCode::kInvalidArgument);

  ReceivedBackwardRequest batch = Marker(0);
  batch.message.set_batch_id(7);
  const absl::Status carries = StreamEndCheck(true).Marker(batch);
  EXPECT_EQ(carries.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(carries.message().find("batch_id 7"), std::string::npos) << carries;
}

TEST(StreamEndCheckTest, TheDeclarationIsOneValueOfOneMetadata) {
  using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;
  EXPECT_EQ(EndMarkerDeclared(Metadata{}).value(), false);
  EXPECT_EQ(EndMarkerDeclared(Metadata{{wire::kEndMarkerMetadata, "1"}}).value(), true);
  const absl::StatusOr<bool> other = EndMarkerDeclared(Metadata{{wire::kEndMarkerMetadata, "yes"}});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(other.status().message().find(wire::kEndMarkerMetadata), std::string::npos);
  EXPECT_FALSE(
      EndMarkerDeclared(Metadata{{wire::kEndMarkerMetadata, "1"}, {wire::kEndMarkerMetadata, "1"}})
          .ok());
}

// ---------------------------------------------------------------------------------------------
// The server

struct StreamOutcome {
  std::vector<v1::BackwardResponse> answers;
  grpc::Status status;
};

// Writes `requests` on one stream (declared with the end marker's metadata when `declare`), then
// half-closes it, and reads every answer and the status.
StreamOutcome RunDeclaredStream(v1::AttentionGradient::Stub& stub,
                                const std::vector<v1::BackwardRequest>& requests, bool declare,
                                const std::string& declaration = wire::kEndMarkerDeclared) {
  grpc::ClientContext context;
  if (declare) context.AddMetadata(wire::kEndMarkerMetadata, declaration);
  auto stream = stub.Backward(&context);
  for (const v1::BackwardRequest& request : requests) {
    if (!stream->Write(request)) break;
  }
  stream->WritesDone();
  StreamOutcome outcome;
  v1::BackwardResponse answer;
  while (stream->Read(&answer)) outcome.answers.push_back(answer);
  outcome.status = stream->Finish();
  return outcome;
}

v1::BackwardRequest EndMarker(std::uint64_t requests) {
  v1::BackwardRequest marker;
  marker.mutable_end()->set_requests(requests);
  return marker;
}

class EndMarkerTest : public ServerTest {
 protected:
  // ACCUMULATE batches of one token with ids first_id, first_id + 1, ...
  std::vector<v1::BackwardRequest> Batches(std::uint64_t first_id, int count) {
    std::vector<v1::BackwardRequest> requests;
    for (int i = 0; i < count; ++i) {
      requests.push_back(MakeRequest(config(), MakeBatch(config(), 1, 1, 40 + first_id + i),
                                     first_id + i, v1::GRADIENT_MODE_ACCUMULATE));
    }
    return requests;
  }
  // Batches in the client's window, read without zeroing it.
  long long WindowBatches() {
    const Fetched fetched = Fetch(stub(), v1::FetchGradientsRequest());
    EXPECT_TRUE(fetched.status.ok()) << fetched.status.error_message();
    return fetched.state.batches();
  }
};

TEST_F(EndMarkerTest, GetModelInfoSaysTheServerChecksIt) {
  grpc::ClientContext context;
  v1::GetModelInfoResponse info;
  ASSERT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
  EXPECT_TRUE(info.backward_end_marker());
}

TEST_F(EndMarkerTest, ADeclaredStreamThatEndsWithItsMarkerEndsOk) {
  std::vector<v1::BackwardRequest> requests = Batches(1, 2);
  requests.push_back(EndMarker(2));
  const StreamOutcome outcome = RunDeclaredStream(stub(), requests, /*declare=*/true);
  EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  ByBatchId(outcome.answers, 1, 2);  // the marker is not answered
  EXPECT_EQ(WindowBatches(), 2);
}

// The stream ends where its last message would have been cut: the batches before are answered and
// accumulated, and the stream ends with DATA_LOSS naming the missing marker.
TEST_F(EndMarkerTest, ADeclaredStreamWithoutItsMarkerEndsWithDataLossAndKeepsItsBatches) {
  const StreamOutcome outcome = RunDeclaredStream(stub(), Batches(1, 2), /*declare=*/true);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::DATA_LOSS);
  const std::string& message = outcome.status.error_message();
  EXPECT_NE(message.find("without its end marker"), std::string::npos) << message;
  EXPECT_NE(message.find("inside or before a message"), std::string::npos) << message;
  EXPECT_NE(message.find("after the 2 request(s)"), std::string::npos) << message;
  ByBatchId(outcome.answers, 1, 2);
  EXPECT_EQ(WindowBatches(), 2);
}

TEST_F(EndMarkerTest, AMarkerThatCountsOtherRequestsEndsWithDataLoss) {
  std::vector<v1::BackwardRequest> requests = Batches(1, 2);
  requests.push_back(EndMarker(3));
  const StreamOutcome outcome = RunDeclaredStream(stub(), requests, /*declare=*/true);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_NE(outcome.status.error_message().find("expected end.requests = 2"), std::string::npos)
      << outcome.status.error_message();
  ByBatchId(outcome.answers, 1, 2);
  EXPECT_EQ(WindowBatches(), 2);
}

TEST_F(EndMarkerTest, ARequestAfterTheMarkerIsRefusedAndNotComputed) {
  std::vector<v1::BackwardRequest> requests = Batches(1, 1);
  requests.push_back(EndMarker(1));
  requests.push_back(Batches(2, 1).front());
  const StreamOutcome outcome = RunDeclaredStream(stub(), requests, /*declare=*/true);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(outcome.status.error_message().find("after the end marker"), std::string::npos)
      << outcome.status.error_message();
  ByBatchId(outcome.answers, 1, 1);
  EXPECT_EQ(WindowBatches(), 1);
}

TEST_F(EndMarkerTest, ABatchThatSetsEndIsRefusedAndNotComputed) {
  std::vector<v1::BackwardRequest> requests = Batches(1, 2);
  requests.back().mutable_end()->set_requests(1);
  const StreamOutcome outcome = RunDeclaredStream(stub(), requests, /*declare=*/true);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(outcome.status.error_message().find("carries other fields too (batch_id 2)"),
            std::string::npos)
      << outcome.status.error_message();
  ByBatchId(outcome.answers, 1, 1);
  EXPECT_EQ(WindowBatches(), 1);
}

// Streams of clients that do not declare the marker (older clients) end OK at their half-close.
TEST_F(EndMarkerTest, AnUndeclaredStreamEndsOkWithoutAMarker) {
  const StreamOutcome outcome = RunDeclaredStream(stub(), Batches(1, 2), /*declare=*/false);
  EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  ByBatchId(outcome.answers, 1, 2);
}

TEST_F(EndMarkerTest, AnotherDeclarationValueIsRefused) {
  const StreamOutcome outcome =
      RunDeclaredStream(stub(), Batches(1, 1), /*declare=*/true, /*declaration=*/"true");
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(outcome.status.error_message().find(wire::kEndMarkerMetadata), std::string::npos)
      << outcome.status.error_message();
  EXPECT_TRUE(outcome.answers.empty());
}

// A declared stream that the client cancels ends without its marker too: the reactor asks gRPC
// whether the call was cancelled before it blames the stream, so such calls are recorded
// CANCELLED, not DATA_LOSS (without that check, 3 to 6 of these 20 were DATA_LOSS).
TEST_F(EndMarkerTest, ACancelledDeclaredStreamIsRecordedCancelled) {
  constexpr int kStreams = 20;
  const v1::BackwardRequest request = Batches(1, 1).front();
  for (int i = 0; i < kStreams; ++i) {
    grpc::ClientContext context;
    context.AddMetadata(wire::kEndMarkerMetadata, wire::kEndMarkerDeclared);
    auto stream = stub().Backward(&context);
    ASSERT_TRUE(stream->Write(request));
    v1::BackwardResponse answer;
    ASSERT_TRUE(stream->Read(&answer));
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  const auto recorded = [this](const std::string& code) {
    const std::string page = HttpGet(server().metrics_port(), "/metrics");
    const std::string series =
        "attngrad_rpc_duration_seconds_count{code=\"" + code + "\",method=\"Backward\"} ";
    const std::size_t at = page.find(series);
    return at == std::string::npos ? 0 : std::stoi(page.substr(at + series.size()));
  };
  for (int attempt = 0; attempt < 50 && recorded("CANCELLED") < kStreams; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(recorded("CANCELLED"), kStreams);
  EXPECT_EQ(recorded("DATA_LOSS"), 0);
}

// ---------------------------------------------------------------------------------------------
// The C++ client

// A stand-in attngrad server: GetModelInfo answers a small layer (backward_end_marker as asked),
// and Backward records each stream's end-marker metadata and requests, answering every batch with
// zeros (ACCUMULATE answers carry grad_hidden_states only).
class RecordingServer {
 public:
  struct Stream {
    std::string declaration;  // the attngrad-end-marker metadata ("" when absent)
    std::vector<v1::BackwardRequest> requests;
  };

  explicit RecordingServer(bool end_marker) : service_(end_marker, this) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~RecordingServer() { server_->Shutdown(); }

  int port() const { return port_; }
  std::vector<Stream> streams() {
    std::lock_guard<std::mutex> lock(mutex_);
    return streams_;
  }

 private:
  static constexpr char kInstance[] = "recording-server";

  static grpc::ByteBuffer Serialized(const google::protobuf::Message& message) {
    grpc::Slice slice(message.SerializeAsString());
    return grpc::ByteBuffer(&slice, 1);
  }

  static v1::GetModelInfoResponse Info(bool end_marker) {
    v1::GetModelInfoResponse info;
    info.mutable_config()->set_hidden_size(8);
    info.mutable_config()->set_num_heads(2);
    info.mutable_config()->set_num_kv_heads(1);
    info.mutable_config()->set_head_dim(4);
    info.set_server_instance_id(kInstance);
    info.set_max_message_bytes(1 << 26);
    info.set_max_batch_tokens(1 << 16);
    info.set_backward_end_marker(end_marker);
    return info;
  }

  // Answers GetModelInfo once its request has arrived.
  class InfoReactor final : public grpc::ServerGenericBidiReactor {
   public:
    explicit InfoReactor(bool end_marker) : answer_(Serialized(Info(end_marker))) {
      StartRead(&request_);
    }
    void OnReadDone(bool) override {
      StartWriteAndFinish(&answer_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    grpc::ByteBuffer request_, answer_;
  };

  // Records a Backward stream and answers its batches one at a time.
  class BackwardReactor final : public grpc::ServerGenericBidiReactor {
   public:
    BackwardReactor(RecordingServer* server, grpc::GenericCallbackServerContext* context)
        : server_(server) {
      const auto found = context->client_metadata().find(wire::kEndMarkerMetadata);
      if (found != context->client_metadata().end()) {
        declaration_.assign(found->second.data(), found->second.size());
      }
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      if (!ok) {
        server_->Record(Stream{declaration_, requests_});
        Finish(grpc::Status::OK);
        return;
      }
      v1::BackwardRequest request;
      grpc::ProtoBufferReader reader(&request_);
      EXPECT_TRUE(request.ParseFromZeroCopyStream(&reader));
      requests_.push_back(request);
      if (request.has_end()) {
        StartRead(&request_);
        return;
      }
      v1::BackwardResponse answer;
      answer.set_batch_id(request.batch_id());
      answer.set_server_instance_id(kInstance);
      *answer.mutable_grad_hidden_states() = request.hidden_states();
      answer_ = Serialized(answer);
      StartWrite(&answer_);
    }
    void OnWriteDone(bool ok) override {
      if (ok) {
        StartRead(&request_);
      } else {
        Finish(grpc::Status::OK);  // the client is gone
      }
    }
    void OnDone() override { delete this; }

   private:
    RecordingServer* const server_;
    std::string declaration_;
    std::vector<v1::BackwardRequest> requests_;
    grpc::ByteBuffer request_, answer_;
  };

  class Service final : public grpc::CallbackGenericService {
   public:
    Service(bool end_marker, RecordingServer* server) : end_marker_(end_marker), server_(server) {}
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext* context) override {
      if (context->method() == "/attngrad.v1.AttentionGradient/Backward") {
        return new BackwardReactor(server_, context);
      }
      return new InfoReactor(end_marker_);
    }

   private:
    const bool end_marker_;
    RecordingServer* const server_;
  };

  void Record(Stream stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    streams_.push_back(std::move(stream));
  }

  Service service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::mutex mutex_;
  std::vector<Stream> streams_;
};

// Two ACCUMULATE batches on one BackwardStream of the C++ client, finished; what the server saw.
std::vector<RecordingServer::Stream> StreamTwoBatches(RecordingServer& server) {
  ClientOptions options;
  options.channels = 1;
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(absl::StrCat("127.0.0.1:", server.port()), options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return {};
  absl::StatusOr<std::unique_ptr<BackwardStream>> stream = (*client)->StartStream();
  EXPECT_TRUE(stream.ok()) << stream.status();
  if (!stream.ok()) return {};
  const std::vector<float> activations(2 * 3 * 8, 0.5f);
  BackwardBatch batch;
  batch.batch = 2;
  batch.seq_len = 3;
  batch.hidden_states = activations;
  batch.grad_output = activations;
  batch.mode = v1::GRADIENT_MODE_ACCUMULATE;
  for (std::uint64_t id : {11u, 12u}) {
    batch.batch_id = id;
    EXPECT_TRUE((*stream)->Submit(batch).ok());
  }
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<BackwardResult> result = (*stream)->Next(absl::Seconds(30));
    EXPECT_TRUE(result.ok() && result->status.ok());
  }
  EXPECT_TRUE((*stream)->Finish().ok());
  return server.streams();
}

TEST(ClientEndMarkerTest, TheClientDeclaresItAndEndsItsStreamWithItsCount) {
  RecordingServer server(/*end_marker=*/true);
  const std::vector<RecordingServer::Stream> streams = StreamTwoBatches(server);
  ASSERT_EQ(streams.size(), 1u);
  EXPECT_EQ(streams[0].declaration, wire::kEndMarkerDeclared);
  ASSERT_EQ(streams[0].requests.size(), 3u);
  EXPECT_FALSE(streams[0].requests[0].has_end());
  EXPECT_FALSE(streams[0].requests[1].has_end());
  ASSERT_TRUE(streams[0].requests[2].has_end());
  EXPECT_EQ(streams[0].requests[2].end().requests(), 2u);
  v1::BackwardRequest others = streams[0].requests[2];
  others.clear_end();
  EXPECT_EQ(others.ByteSizeLong(), 0u) << "the marker carries nothing but `end`";
}

// A server that does not check the marker (an older one) gets neither the declaration nor the
// marker, which it would answer as a bad batch.
TEST(ClientEndMarkerTest, TheClientSendsNoMarkerToAServerThatDoesNotCheckIt) {
  RecordingServer server(/*end_marker=*/false);
  const std::vector<RecordingServer::Stream> streams = StreamTwoBatches(server);
  ASSERT_EQ(streams.size(), 1u);
  EXPECT_EQ(streams[0].declaration, "");
  ASSERT_EQ(streams[0].requests.size(), 2u);
  EXPECT_FALSE(streams[0].requests[1].has_end());
}

}  // namespace
}  // namespace attngrad::server::testing
