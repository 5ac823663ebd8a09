// The /metrics HTTP server against slow and hostile clients (one client sending a byte every 4 s
// once made every scrape time out), and its request-head parser.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cli/http_get.h"
#include "metrics/http_request.h"
#include "metrics/metrics_http_server.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace attngrad::server {
namespace {

using Outcome = HttpParseResult::Outcome;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A registry with one counter, so that a scrape has something to show.
std::shared_ptr<prometheus::Registry> TestRegistry() {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("attngrad_test_total")
      .Help("test")
      .Register(*registry)
      .Add({})
      .Increment();
  return registry;
}

// A raw TCP connection to 127.0.0.1:port (-1 on failure).
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Everything the server sends until it closes (or `timeout_seconds` pass); `clean_close` (when
// given) says whether it ended with an orderly close rather than a reset or the timeout.
std::string ReadUntilClosed(int fd, int timeout_seconds, bool* clean_close = nullptr) {
  timeval timeout{timeout_seconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string received;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0)
    received.append(buffer, static_cast<size_t>(n));
  if (clean_close != nullptr) *clean_close = n == 0;
  return received;
}

std::string Address(const MetricsHttpServer& server) {
  return "127.0.0.1:" + std::to_string(server.port());
}

TEST(MetricsHttpServerTest, ScrapeSucceedsWhileASlowClientHoldsAConnection) {
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  // The slow-loris client of the issue: a partial request, one byte at a time, kept open.
  const int slow = Connect((*server)->port());
  ASSERT_GE(slow, 0);
  ASSERT_EQ(send(slow, "G", 1, 0), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server has accepted it
  const auto start = Clock::now();
  absl::StatusOr<cli::HttpResponse> scrape =
      cli::HttpGet(Address(**server), "/metrics", absl::Seconds(2));
  const double seconds = SecondsSince(start);
  ASSERT_TRUE(scrape.ok()) << scrape.status() << " after " << seconds << " s";
  EXPECT_EQ(scrape->status, 200);
  EXPECT_NE(scrape->body.find("attngrad_test_total 1"), std::string::npos) << scrape->body;
  EXPECT_LT(seconds, 1.0);
  ASSERT_EQ(send(slow, "E", 1, MSG_NOSIGNAL), 1);  // still open, still slow
  close(slow);
}

TEST(MetricsHttpServerTest, ManySlowClientsDoNotBlockAScrape) {
  MetricsHttpOptions options;
  options.max_connections = 8;
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> slow;
  for (int i = 0; i < 6; ++i) {
    slow.push_back(Connect((*server)->port()));
    ASSERT_GE(slow.back(), 0);
    ASSERT_EQ(send(slow.back(), "GET /met", 8, 0), 8);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (int round = 0; round < 3; ++round) {
    const auto start = Clock::now();
    absl::StatusOr<cli::HttpResponse> scrape =
        cli::HttpGet(Address(**server), "/metrics", absl::Seconds(2));
    ASSERT_TRUE(scrape.ok()) << scrape.status();
    EXPECT_EQ(scrape->status, 200);
    EXPECT_LT(SecondsSince(start), 1.0);
  }
  for (int fd : slow) close(fd);
}

TEST(MetricsHttpServerTest, TricklingClientIsCutAtTheReadTimeout) {
  MetricsHttpOptions options;
  options.read_timeout = absl::Seconds(1);
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  ASSERT_GE(fd, 0);
  const auto start = Clock::now();
  // A byte every 200 ms: each read alone is quick, the whole head never comes.
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
  bool closed = false;
  for (size_t i = 0; i < request.size() && !closed; ++i) {
    if (send(fd, &request[i], 1, MSG_NOSIGNAL) != 1) closed = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    char byte;
    const ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
    if (n >= 0) closed = true;  // the 408 or the end of the stream
  }
  EXPECT_TRUE(closed);
  EXPECT_LT(SecondsSince(start), 2.5);
  close(fd);
}

TEST(MetricsHttpServerTest, OversizedHeadIsRefused) {
  MetricsHttpOptions options;
  options.max_request_bytes = 1024;
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  ASSERT_GE(fd, 0);
  const std::string request =
      "GET /metrics HTTP/1.1\r\nX-Filler: " + std::string(4096, 'a') + "\r\n\r\n";
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  const std::string answer = ReadUntilClosed(fd, 5);
  EXPECT_EQ(answer.rfind("HTTP/1.1 431 ", 0), 0u) << answer;
  close(fd);
}

TEST(MetricsHttpServerTest, ConnectionsBeyondTheCapAreAnswered503) {
  MetricsHttpOptions options;
  options.max_connections = 2;
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int first = Connect((*server)->port());
  const int second = Connect((*server)->port());
  ASSERT_GE(first, 0);
  ASSERT_GE(second, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int third = Connect((*server)->port());
  ASSERT_GE(third, 0);
  const std::string answer = ReadUntilClosed(third, 5);
  EXPECT_EQ(answer.rfind("HTTP/1.1 503 ", 0), 0u) << answer;
  close(first);
  close(second);
  close(third);
}

TEST(MetricsHttpServerTest, AnswersByMethodAndPath) {
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<cli::HttpResponse> other = cli::HttpGet(Address(**server), "/other");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->status, 404);
  absl::StatusOr<cli::HttpResponse> query = cli::HttpGet(Address(**server), "/metrics?x=1");
  ASSERT_TRUE(query.ok()) << query.status();
  EXPECT_EQ(query->status, 200);

  for (const auto& [request, expected] : std::vector<std::pair<std::string, std::string>>{
           {"POST /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 "},
           {"HEAD /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 200 "},
           {"garbage\r\n\r\n", "HTTP/1.1 400 "}}) {
    const int fd = Connect((*server)->port());
    ASSERT_GE(fd, 0);
    send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    const std::string answer = ReadUntilClosed(fd, 5);
    EXPECT_EQ(answer.rfind(expected, 0), 0u) << request << " -> " << answer;
    if (request.rfind("HEAD", 0) == 0) {
      EXPECT_EQ(answer.substr(answer.find("\r\n\r\n") + 4), "") << answer;  // no body
    }
    close(fd);
  }
}

TEST(MetricsHttpServerTest, AnswerArrivesDespiteAnUnreadRequestBody) {
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int fd = Connect((*server)->port());
    ASSERT_GE(fd, 0);
    // The server reads only the head; the body is still unread when it has answered.
    const std::string request =
        "POST /metrics HTTP/1.1\r\nContent-Length: 32768\r\n\r\n" + std::string(32768, 'x');
    send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    bool clean_close = false;
    const std::string answer = ReadUntilClosed(fd, 5, &clean_close);
    EXPECT_EQ(answer.rfind("HTTP/1.1 405 ", 0), 0u) << "attempt " << attempt << ": " << answer;
    // Before, the server closed with the body unread: the connection was reset (ECONNRESET).
    EXPECT_TRUE(clean_close) << "attempt " << attempt << ": " << std::strerror(errno);
    close(fd);
  }
}

TEST(MetricsHttpServerTest, DestructorClosesHeldConnectionsPromptly) {
  auto server = MetricsHttpServer::Start("127.0.0.1:0", TestRegistry());
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  ASSERT_GE(fd, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto start = Clock::now();
  server->reset();
  EXPECT_LT(SecondsSince(start), 1.0);
  close(fd);
}

TEST(HttpRequestHeadTest, CompleteRequest) {
  const std::string request = "GET /metrics?name=x HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\nrest";
  const HttpParseResult parsed = ParseHttpRequestHead(request, 8192);
  ASSERT_EQ(parsed.outcome, Outcome::kComplete) << parsed.error;
  EXPECT_EQ(parsed.head.method, "GET");
  EXPECT_EQ(parsed.head.path, "/metrics");
  EXPECT_EQ(parsed.head.query, "name=x");
  EXPECT_EQ(parsed.head.minor_version, 1);
  EXPECT_EQ(parsed.head_bytes, request.size() - 4);
  EXPECT_TRUE(ChooseHttpAnswer(parsed).serve_metrics);
}

TEST(HttpRequestHeadTest, BareLineFeeds) {
  const HttpParseResult parsed = ParseHttpRequestHead("HEAD /metrics HTTP/1.0\nHost: a\n\n", 8192);
  ASSERT_EQ(parsed.outcome, Outcome::kComplete) << parsed.error;
  EXPECT_EQ(parsed.head.minor_version, 0);
  const HttpAnswer answer = ChooseHttpAnswer(parsed);
  EXPECT_TRUE(answer.serve_metrics);
  EXPECT_FALSE(answer.send_body);
}

TEST(HttpRequestHeadTest, IncompleteHeadsNeedMore) {
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n";
  for (size_t size = 0; size < request.size() - 1; ++size) {
    EXPECT_EQ(ParseHttpRequestHead(request.substr(0, size), 8192).outcome, Outcome::kNeedMore)
        << size;
  }
}

TEST(HttpRequestHeadTest, TooLarge) {
  const std::string request = "GET /metrics HTTP/1.1\r\nX: " + std::string(200, 'a') + "\r\n\r\n";
  EXPECT_EQ(ParseHttpRequestHead(request, 64).outcome, Outcome::kTooLarge);
  EXPECT_EQ(ParseHttpRequestHead(request.substr(0, 64), 64).outcome, Outcome::kTooLarge);
  EXPECT_EQ(ParseHttpRequestHead(request.substr(0, 63), 64).outcome, Outcome::kNeedMore);
  EXPECT_EQ(ParseHttpRequestHead(request, request.size()).outcome, Outcome::kComplete);
  EXPECT_EQ(ChooseHttpAnswer(ParseHttpRequestHead(request, 64)).status, 431);
}

TEST(HttpRequestHeadTest, BadRequests) {
  for (const std::string request :
       {"\r\n\r\n", "GET\r\n\r\n", "GET /metrics\r\n\r\n", "GET metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/2.0\r\n\r\n", "GET /metrics HTTP/1.1x\r\n\r\n",
        "G(T /metrics HTTP/1.1\r\n\r\n", "GET /met\x01rics HTTP/1.1\r\n\r\n",
        "GET  /metrics HTTP/1.1\r\n\r\n", "GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
        "GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n"}) {
    const HttpParseResult parsed = ParseHttpRequestHead(request, 8192);
    EXPECT_EQ(parsed.outcome, Outcome::kBadRequest) << request;
    EXPECT_FALSE(parsed.error.empty()) << request;
    EXPECT_EQ(ChooseHttpAnswer(parsed).status, 400) << request;
  }
  std::string many_headers = "GET /metrics HTTP/1.1\r\n";
  for (int i = 0; i < 101; ++i) many_headers += "X: y\r\n";
  EXPECT_EQ(ParseHttpRequestHead(many_headers + "\r\n", 1 << 20).outcome, Outcome::kBadRequest);
}

TEST(HttpRequestHeadTest, MethodsAndPaths) {
  EXPECT_EQ(ChooseHttpAnswer(ParseHttpRequestHead("POST /metrics HTTP/1.1\r\n\r\n", 8192)).status,
            405);
  EXPECT_EQ(ChooseHttpAnswer(ParseHttpRequestHead("GET / HTTP/1.1\r\n\r\n", 8192)).status, 404);
  EXPECT_EQ(ChooseHttpAnswer(ParseHttpRequestHead("GET /metricsx HTTP/1.1\r\n\r\n", 8192)).status,
            404);
}

}  // namespace
}  // namespace attngrad::server
