// cli/http_get.h against a one-shot HTTP server on a loopback socket: the status and body
// come back, the request is what a server expects, and bad replies or closed ports are errors.
#include "cli/http_get.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace attngrad::cli {
namespace {

// Listens on 127.0.0.1 (a free port), accepts one connection, reads the request up to the blank
// line and answers `reply`, then closes.
class OneShotServer {
 public:
  explicit OneShotServer(std::string reply) : reply_(std::move(reply)) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = 0;
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(listen(listener_, 1), 0);
    socklen_t length = sizeof address;
    getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~OneShotServer() {
    thread_.join();
    close(listener_);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  // The request as received (valid after the client has its answer).
  const std::string& request() const { return request_; }

 private:
  void Serve() {
    const int connection = accept(listener_, nullptr, nullptr);
    if (connection < 0) return;
    char buffer[4096];
    while (request_.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = read(connection, buffer, sizeof buffer);
      if (n <= 0) break;
      request_.append(buffer, static_cast<std::size_t>(n));
    }
    const ssize_t written = write(connection, reply_.data(), reply_.size());
    EXPECT_EQ(written, static_cast<ssize_t>(reply_.size()));
    close(connection);
  }

  std::string reply_;
  std::string request_;
  int listener_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(HttpGetTest, ReturnsStatusAndBody) {
  std::string body = "attngrad_up 1\n";
  body.append(200000, 'x');  // larger than one read
  OneShotServer server(absl::StrCat("HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", body));
  absl::StatusOr<HttpResponse> response = HttpGet(server.address(), "/metrics?x=1");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->body, body);
  EXPECT_EQ(server.request().rfind("GET /metrics?x=1 HTTP/1.0\r\n", 0), 0u) << server.request();
  EXPECT_NE(server.request().find("Host: " + server.address()), std::string::npos);
}

TEST(HttpGetTest, OtherStatusCodesAreReturned) {
  OneShotServer server("HTTP/1.1 404 Not Found\r\n\r\nno such page");
  absl::StatusOr<HttpResponse> response = HttpGet(server.address(), "/nope");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 404);
  EXPECT_EQ(response->body, "no such page");
}

TEST(HttpGetTest, ABadReplyIsDataLoss) {
  OneShotServer server("garbage");
  EXPECT_EQ(HttpGet(server.address(), "/").status().code(), absl::StatusCode::kDataLoss);
}

TEST(HttpGetTest, ConnectionAndAddressErrors) {
  int port = 0;
  {  // a port that was free a moment ago, closed again
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    socklen_t length = sizeof address;
    getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
    port = ntohs(address.sin_port);
    close(fd);
  }
  EXPECT_EQ(HttpGet(absl::StrCat("127.0.0.1:", port), "/", absl::Seconds(2)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(HttpGet("no-port-here", "/").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HttpGetTest, UrlEncode) {
  EXPECT_EQ(UrlEncode("rate(x[1m]) > 0"), "rate%28x%5B1m%5D%29%20%3E%200");
  EXPECT_EQ(UrlEncode("a-b_c.d~e"), "a-b_c.d~e");
}

}  // namespace
}  // namespace attngrad::cli
