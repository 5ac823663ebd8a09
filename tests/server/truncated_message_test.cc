// A Backward stream whose last message is cut short: the client's HTTP/2 DATA frames carry a
// complete ACCUMULATE batch, then a gRPC length prefix that promises a whole request of which only
// 100 bytes follow, then END_STREAM. gRPC's HTTP/2 transport (chttp2, the grpc_core
// grpc_chttp2_maybe_complete_recv_message of 1.51 and of today's master alike) drops the partial
// bytes when the stream's read side closes and reports the end of the stream exactly as a clean
// half-close: the reactor's OnReadDone(false), no error anywhere. A stream that declared the end
// marker (attngrad-end-marker: 1, rpc/stream_end.h) therefore ends with DATA_LOSS naming the
// marker it expected; one that did not (an older client) ends OK, which this test pins (one
// answer, the cut batch neither computed nor accumulated) so that a gRPC that starts reporting
// truncation shows up here (server/README.md, "A stream cut inside its last message").
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

constexpr std::uint8_t kData = 0x0, kHeaders = 0x1, kRstStream = 0x3, kSettings = 0x4;
constexpr std::uint8_t kEndStream = 0x1, kEndHeaders = 0x4, kAck = 0x1;

std::string Frame(std::uint8_t type, std::uint8_t flags, std::uint32_t stream,
                  const std::string& payload) {
  std::string frame;
  const std::uint32_t length = static_cast<std::uint32_t>(payload.size());
  frame += static_cast<char>(length >> 16);
  frame += static_cast<char>(length >> 8);
  frame += static_cast<char>(length);
  frame += static_cast<char>(type);
  frame += static_cast<char>(flags);
  for (int shift : {24, 16, 8, 0}) frame += static_cast<char>((stream >> shift) & 0xff);
  return frame + payload;
}

// An HPACK literal header field without indexing, with a new name (RFC 7541 6.2.2), both strings
// shorter than 127 bytes and not Huffman-coded.
std::string Literal(const std::string& name, const std::string& value) {
  return std::string(1, '\0') + static_cast<char>(name.size()) + name +
         static_cast<char>(value.size()) + value;
}

// A gRPC message prefix: not compressed, `length` bytes (big-endian).
std::string MessagePrefix(std::uint32_t length) {
  std::string prefix(1, '\0');
  for (int shift : {24, 16, 8, 0}) prefix += static_cast<char>((length >> shift) & 0xff);
  return prefix;
}

// DATA frames of at most 16 KiB (the default SETTINGS_MAX_FRAME_SIZE) carrying `bytes`; the last
// one ends the stream when `end_stream`.
std::string DataFrames(const std::string& bytes, bool end_stream) {
  std::string frames;
  for (std::size_t offset = 0; offset < bytes.size(); offset += 16384) {
    const bool last = offset + 16384 >= bytes.size();
    frames += Frame(kData, last && end_stream ? kEndStream : 0, 1, bytes.substr(offset, 16384));
  }
  return frames;
}

struct StreamOutcome {
  std::vector<v1::BackwardResponse> answers;
  bool ended = false;    // trailers with END_STREAM, or RST_STREAM, on stream 1
  std::string trailers;  // their HPACK bytes (gRPC writes grpc-message as a plain literal)
};

// Sends `body` (the gRPC bytes of stream 1) on a new connection after the headers of a call of
// `method` of the service (and `extra_headers`, HPACK), then reads the server's frames until
// stream 1 ends or `seconds` pass.
StreamOutcome RunRawStream(int port, const std::string& body, double seconds,
                           const std::string& method = "Backward",
                           const std::string& extra_headers = "") {
  StreamOutcome outcome;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const std::string headers = Literal(":method", "POST") + Literal(":scheme", "http") +
                              Literal(":path", "/attngrad.v1.AttentionGradient/" + method) +
                              Literal(":authority", "127.0.0.1:" + std::to_string(port)) +
                              Literal("content-type", "application/grpc") +
                              Literal("te", "trailers") + extra_headers;
  const std::string out = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") +
                          Frame(kSettings, 0, 0, "") + Frame(kHeaders, kEndHeaders, 1, headers) +
                          body;
  EXPECT_EQ(send(fd, out.data(), out.size(), MSG_NOSIGNAL), static_cast<ssize_t>(out.size()));

  std::string in, messages;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!outcome.ended && std::chrono::steady_clock::now() < deadline) {
    pollfd readable{fd, POLLIN, 0};
    if (poll(&readable, 1, 100) <= 0) continue;
    char buffer[65536];
    const ssize_t received = read(fd, buffer, sizeof(buffer));
    if (received <= 0) break;
    in.append(buffer, static_cast<std::size_t>(received));
    while (in.size() >= 9) {
      const std::size_t length = (static_cast<std::uint8_t>(in[0]) << 16) |
                                 (static_cast<std::uint8_t>(in[1]) << 8) |
                                 static_cast<std::uint8_t>(in[2]);
      if (in.size() < 9 + length) break;
      const std::uint8_t type = in[3], flags = in[4];
      const std::uint32_t stream =
          ntohl(*reinterpret_cast<const std::uint32_t*>(in.data() + 5)) & 0x7fffffffu;
      const std::string payload = in.substr(9, length);
      in.erase(0, 9 + length);
      if (type == kSettings && (flags & kAck) == 0) {
        const std::string ack = Frame(kSettings, kAck, 0, "");
        send(fd, ack.data(), ack.size(), MSG_NOSIGNAL);
      }
      if (stream != 1) continue;
      if (type == kData) messages += payload;
      if ((type == kHeaders && (flags & kEndStream) != 0) || type == kRstStream) {
        outcome.ended = true;
        if (type == kHeaders) outcome.trailers = payload;
      }
    }
  }
  close(fd);
  while (messages.size() >= 5) {  // the answers' gRPC messages
    const std::uint32_t length =
        ntohl(*reinterpret_cast<const std::uint32_t*>(messages.data() + 1));
    if (messages.size() < 5 + length) break;
    v1::BackwardResponse answer;
    EXPECT_TRUE(answer.ParseFromString(messages.substr(5, length)));
    outcome.answers.push_back(answer);
    messages.erase(0, 5 + length);
  }
  return outcome;
}

// The number of calls of `method` /metrics has recorded as ended with `code`.
int CallsEndedWith(int metrics_port, const std::string& method, const std::string& code) {
  const std::string page = HttpGet(metrics_port, "/metrics");
  const std::string prefix = "attngrad_rpc_duration_seconds_count{";
  for (std::size_t start = page.find(prefix); start != std::string::npos;
       start = page.find(prefix, start + 1)) {
    const std::string line = page.substr(start, page.find('\n', start) - start);
    if (line.find("method=\"" + method + "\"") != std::string::npos &&
        line.find("code=\"" + code + "\"") != std::string::npos) {
      return std::stoi(line.substr(line.rfind(' ') + 1));
    }
  }
  return 0;
}

// The calls of `method` that /metrics records as ended with `code`, once gRPC has closed them (a
// moment after the client saw their end): waits up to 5 s for at least one.
int RecordedCalls(int metrics_port, const std::string& method, const std::string& code) {
  int calls = 0;
  for (int attempt = 0; attempt < 50 && calls == 0; ++attempt) {
    calls = CallsEndedWith(metrics_port, method, code);
    if (calls == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return calls;
}

class TruncatedMessageTest : public ServerTest {
 protected:
  // A whole ACCUMULATE batch (id 1) as a gRPC message, then the first 100 bytes of batch 2 behind
  // a length prefix that promises all of it.
  std::string WholeThenCut() {
    const Batch batch = MakeBatch(config(), 1, 1, 21);
    const std::string first =
        MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_ACCUMULATE).SerializeAsString();
    const std::string second =
        MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_ACCUMULATE).SerializeAsString();
    EXPECT_GT(second.size(), 20000u);  // the prefix promises ~24 kB
    return MessagePrefix(static_cast<std::uint32_t>(first.size())) + first +
           MessagePrefix(static_cast<std::uint32_t>(second.size())) + second.substr(0, 100);
  }
  long long WindowBatches() {
    const Fetched fetched = Fetch(stub(), v1::FetchGradientsRequest());
    EXPECT_TRUE(fetched.status.ok()) << fetched.status.error_message();
    return fetched.state.batches();
  }
};

// A client that declared the end marker: the stream cut inside batch 2 ends with DATA_LOSS naming
// the marker it expected after the one whole request; batch 1 stays answered and accumulated.
TEST_F(TruncatedMessageTest, ACutLastMessageOfADeclaredStreamEndsWithDataLossNamingIt) {
  const std::string declared = Literal("attngrad-end-marker", "1");
  const StreamOutcome outcome =
      RunRawStream(server().port(), DataFrames(WholeThenCut(), true), 30, "Backward", declared);
  ASSERT_TRUE(outcome.ended) << "stream 1 did not end";
  ASSERT_EQ(outcome.answers.size(), 1u);
  EXPECT_EQ(outcome.answers[0].batch_id(), 1u);
  EXPECT_FALSE(outcome.answers[0].has_error()) << outcome.answers[0].error().message();
  for (const char* named : {"without its end marker", "inside or before a message",
                            "after the 1 request(s) that arrived whole", "end.requests"}) {
    EXPECT_NE(outcome.trailers.find(named), std::string::npos)
        << named << " in " << outcome.trailers;
  }
  EXPECT_EQ(RecordedCalls(server().metrics_port(), "Backward", "DATA_LOSS"), 1);
  EXPECT_EQ(CallsEndedWith(server().metrics_port(), "Backward", "OK"), 0);
  EXPECT_EQ(WindowBatches(), 1);

  // The same client's whole stream: batch 1, then the marker counting it, then END_STREAM: OK.
  const std::string first =
      MakeRequest(config(), MakeBatch(config(), 1, 1, 22), 3, v1::GRADIENT_MODE_ACCUMULATE)
          .SerializeAsString();
  v1::BackwardRequest marker;
  marker.mutable_end()->set_requests(1);
  const std::string end = marker.SerializeAsString();
  const StreamOutcome whole = RunRawStream(
      server().port(),
      DataFrames(MessagePrefix(first.size()) + first + MessagePrefix(end.size()) + end, true), 30,
      "Backward", declared);
  ASSERT_TRUE(whole.ended);
  EXPECT_EQ(whole.answers.size(), 1u);
  EXPECT_EQ(RecordedCalls(server().metrics_port(), "Backward", "OK"), 1);
  EXPECT_EQ(WindowBatches(), 2);
}

// A client that did not declare the marker (an older one): gRPC reports the cut as a clean
// half-close and the stream ends OK, as it always did.
TEST_F(TruncatedMessageTest, ACutLastMessageOfAnUndeclaredStreamLooksLikeACleanHalfClose) {
  const StreamOutcome outcome = RunRawStream(server().port(), DataFrames(WholeThenCut(), true), 30);
  ASSERT_TRUE(outcome.ended) << "stream 1 did not end";
  ASSERT_EQ(outcome.answers.size(), 1u);
  EXPECT_EQ(outcome.answers[0].batch_id(), 1u);
  EXPECT_FALSE(outcome.answers[0].has_error()) << outcome.answers[0].error().message();

  // The call ended OK, as gRPC reported a clean half-close to the reactor.
  EXPECT_EQ(RecordedCalls(server().metrics_port(), "Backward", "OK"), 1)
      << "gRPC now ends a stream cut inside a message otherwise: update server/README.md (A "
         "stream cut inside its last message)";
  // Only the complete batch was accumulated; the cut one was never handed to the server.
  EXPECT_EQ(WindowBatches(), 1);

  // A stream that really ends after the first batch is the same to the server: one answer, OK.
  const std::string first =
      MakeRequest(config(), MakeBatch(config(), 1, 1, 21), 1, v1::GRADIENT_MODE_ACCUMULATE)
          .SerializeAsString();
  const StreamOutcome clean =
      RunRawStream(server().port(), DataFrames(MessagePrefix(first.size()) + first, true), 30);
  ASSERT_TRUE(clean.ended);
  EXPECT_EQ(clean.answers.size(), 1u);
}

// A LoadWeights upload cut inside its only chunk: gRPC reports a clean half-close here too, and the
// upload is refused as incomplete (INVALID_ARGUMENT); the weights keep their version.
TEST_F(TruncatedMessageTest, ALoadWeightsUploadCutInsideAChunkIsRefusedAsIncomplete) {
  grpc::ClientContext info_context;
  v1::GetModelInfoResponse before;
  ASSERT_TRUE(stub().GetModelInfo(&info_context, {}, &before).ok());
  v1::LoadWeightsRequest chunk;
  chunk.set_name(v1::WEIGHT_NAME_Q_NORM);
  chunk.set_dtype(v1::DTYPE_FLOAT32);
  chunk.add_shape(config().head_dim);
  chunk.set_data(std::string(config().head_dim * sizeof(float), '\0'));
  const std::string whole = chunk.SerializeAsString();
  const std::string cut =
      MessagePrefix(static_cast<std::uint32_t>(whole.size())) + whole.substr(0, whole.size() / 2);
  const StreamOutcome outcome =
      RunRawStream(server().port(), DataFrames(cut, true), 30, "LoadWeights");
  ASSERT_TRUE(outcome.ended);
  EXPECT_EQ(RecordedCalls(server().metrics_port(), "LoadWeights", "INVALID_ARGUMENT"), 1);
  grpc::ClientContext after_context;
  v1::GetModelInfoResponse after;
  ASSERT_TRUE(stub().GetModelInfo(&after_context, {}, &after).ok());
  EXPECT_EQ(after.weights_version(), before.weights_version());
}

// A unary request cut inside its message (or a call that ends before any message) is refused with
// INVALID_ARGUMENT naming the method (before: gRPC's UNIMPLEMENTED without a message).
TEST_F(TruncatedMessageTest, AUnaryRequestCutInsideItsMessageIsInvalidArgument) {
  v1::ZeroGradientsRequest request;
  request.set_layer(0);
  request.set_expected_window_id(0x123456789abcdefULL);
  const std::string whole = request.SerializeAsString();
  const std::string cut =
      MessagePrefix(static_cast<std::uint32_t>(whole.size())) + whole.substr(0, whole.size() / 2);
  ASSERT_TRUE(RunRawStream(server().port(), DataFrames(cut, true), 30, "ZeroGradients").ended);
  ASSERT_TRUE(
      RunRawStream(server().port(), Frame(kData, kEndStream, 1, ""), 30, "GetModelInfo").ended);
  for (const char* method : {"ZeroGradients", "GetModelInfo"}) {
    EXPECT_EQ(RecordedCalls(server().metrics_port(), method, "INVALID_ARGUMENT"), 1) << method;
  }
}

}  // namespace
}  // namespace attngrad::server::testing
