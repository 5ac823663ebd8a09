// Connections that never call are closed: a client that opens connections (HTTP/2 preface and
// SETTINGS, no credentials, no call) and leaves them open cannot hold the server's descriptors, and
// the listener serves new clients afterwards.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

constexpr int kIdleTimeoutSeconds = 1;

// A TCP connection to 127.0.0.1:`port` that has sent the HTTP/2 client preface and an empty
// SETTINGS frame, and then nothing; -1 when it could not connect.
int OpenIdleConnection(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const std::string preface = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") +
                              std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      write(fd, preface.data(), preface.size()) != static_cast<ssize_t>(preface.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closed `fd` (end of file or reset) within `seconds`; what it sends before
// (SETTINGS, GOAWAY, PING) is read and dropped.
bool ClosedByServerWithin(int fd, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  char buffer[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd readable{fd, POLLIN, 0};
    if (poll(&readable, 1, 100) <= 0) continue;
    const ssize_t n = read(fd, buffer, sizeof buffer);
    if (n <= 0) return true;
  }
  return false;
}

class ConnectionLimitsTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override {
    options.connection_idle_timeout_seconds = kIdleTimeoutSeconds;
  }
};

TEST_F(ConnectionLimitsTest, IdleConnectionsThatNeverCallAreClosed) {
  std::vector<int> connections;
  for (int i = 0; i < 64; ++i) {
    const int fd = OpenIdleConnection(server().port());
    ASSERT_GE(fd, 0) << "connection " << i;
    connections.push_back(fd);
  }
  // gRPC's graceful GOAWAY waits up to 20 s for a PING answer that these clients never send.
  const auto start = std::chrono::steady_clock::now();
  int closed = 0;
  for (const int fd : connections) {
    const double left =
        40 - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (ClosedByServerWithin(fd, left)) ++closed;
    close(fd);
  }
  EXPECT_EQ(closed, static_cast<int>(connections.size()))
      << "idle connections left open by the server";
  // The listener still serves a new client.
  auto stub = NewStub();
  grpc::ClientContext context;
  v1::GetModelInfoResponse info;
  const grpc::Status status = stub->GetModelInfo(&context, {}, &info);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST(ConnectionLimitsOptionsTest, NegativeIdleTimeoutIsRefused) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.devices = "cpu";
  options.connection_idle_timeout_seconds = -1;
  const absl::Status refused = GradientServer::Start(options).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("--connection_idle_timeout_seconds"), std::string::npos);
}

}  // namespace
}  // namespace attngrad::server::testing
