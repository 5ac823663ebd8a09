#include "metrics/metrics_http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "metrics/http_request.h"
#include "prometheus/text_serializer.h"

namespace attngrad::server {
namespace {

// Splits "host:port" or "[v6]:port" into host and port.
absl::Status SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: expected host:port, got \"", address, "\""));
  }
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  int port_number = 0;
  if (!absl::SimpleAtoi(*port, &port_number) || port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: bad port in \"", address, "\""));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry,
    const MetricsHttpOptions& options) {
  std::string host, port;
  if (absl::Status status = SplitHostPort(listen_address, &host, &port); !status.ok())
    return status;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* addresses = nullptr;
  if (const int error =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &addresses);
      error != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_listen: cannot resolve \"",
                                                   listen_address, "\": ", gai_strerror(error)));
  }
  int listen_fd = -1;
  std::string last_error = "no address";
  for (addrinfo* address = addresses; address != nullptr && listen_fd < 0;
       address = address->ai_next) {
    const int fd =
        socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC, address->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, address->ai_addr, address->ai_addrlen) == 0 && listen(fd, 64) == 0) {
      listen_fd = fd;
    } else {
      last_error = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(addresses);
  if (listen_fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: cannot listen on ", listen_address, ": ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof(bound);
  getsockname(listen_fd, reinterpret_cast<sockaddr*>(&bound), &bound_size);
  const int bound_port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    close(listen_fd);
    return absl::InternalError(absl::StrCat("metrics server: pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(listen_fd, wake[0], wake[1], bound_port, std::move(registry), options));
}

MetricsHttpServer::MetricsHttpServer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
                                     std::shared_ptr<prometheus::Registry> registry,
                                     const MetricsHttpOptions& options)
    : listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      registry_(std::move(registry)),
      options_(options),
      thread_([this] { Serve(); }) {}

MetricsHttpServer::~MetricsHttpServer() {
  close(wake_write_fd_);  // wakes Serve() and every connection, which see the pipe's end of file
  thread_.join();
  for (Connection& connection : connections_) connection.thread.join();
  close(wake_read_fd_);
  close(listen_fd_);
}

void MetricsHttpServer::Serve() {
  pollfd watched[2] = {{listen_fd_, POLLIN, 0}, {wake_read_fd_, POLLIN, 0}};
  while (true) {
    if (poll(watched, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (watched[1].revents != 0) return;
    if ((watched[0].revents & POLLIN) == 0) continue;
    const int connection_fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (connection_fd < 0) continue;
    JoinFinishedConnections();
    const std::size_t limit = static_cast<std::size_t>(options_.max_connections);
    // A connection that has sent its answer and closed may not have marked itself finished yet
    // (its thread not scheduled since): give such connections up to 100 ms before refusing.
    for (int attempt = 0; attempt < 20 && connections_.size() >= limit; ++attempt) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      JoinFinishedConnections();
    }
    if (connections_.size() >= limit) {
      // Busy: say so without waiting for the request (one non-blocking send; a client that does
      // not read it loses only its own answer).
      static constexpr char kBusy[] =
          "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 36\r\n"
          "Connection: close\r\nRetry-After: 1\r\n\r\ntoo many /metrics connections open\r\n";
      [[maybe_unused]] const ssize_t sent =
          send(connection_fd, kBusy, sizeof(kBusy) - 1, MSG_NOSIGNAL);
      close(connection_fd);
      continue;
    }
    Connection& connection = connections_.emplace_back();
    connection.thread = std::thread([this, connection_fd, &connection] {
      Answer(connection_fd);
      close(connection_fd);
      connection.finished.store(true, std::memory_order_release);
    });
  }
}

void MetricsHttpServer::JoinFinishedConnections() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->finished.load(std::memory_order_acquire)) {
      it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

bool MetricsHttpServer::WaitFor(int connection_fd, short events, absl::Time deadline) const {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd watched[2] = {{connection_fd, events, 0}, {wake_read_fd_, POLLIN, 0}};
    const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(left)) + 1;
    const int ready = poll(watched, 2, timeout_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || watched[1].revents != 0) return false;
    if (ready == 0) continue;  // re-check the deadline
    return (watched[0].revents & (events | POLLERR | POLLHUP)) != 0;
  }
}

bool MetricsHttpServer::SendAll(int connection_fd, absl::string_view data,
                                absl::Time deadline) const {
  while (!data.empty()) {
    const ssize_t written = send(connection_fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (written > 0) {
      data.remove_prefix(static_cast<std::size_t>(written));
      continue;
    }
    if (written < 0 && errno == EINTR) continue;
    if (written < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!WaitFor(connection_fd, POLLOUT, deadline)) return false;
      continue;
    }
    return false;
  }
  return true;
}

void MetricsHttpServer::Answer(int connection_fd) const {
  // Read the request head: all of it within read_timeout (a client trickling bytes gets no more).
  const absl::Time read_deadline = absl::Now() + options_.read_timeout;
  std::string request;
  HttpParseResult parsed;
  char buffer[2048];
  while (true) {
    parsed = ParseHttpRequestHead(request, options_.max_request_bytes);
    if (parsed.outcome != HttpParseResult::Outcome::kNeedMore) break;
    const ssize_t received = recv(connection_fd, buffer, sizeof(buffer), 0);
    if (received > 0) {
      request.append(buffer, static_cast<std::size_t>(received));
      continue;
    }
    if (received == 0) return;  // the client went away before a whole head
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return;
    if (!WaitFor(connection_fd, POLLIN, read_deadline)) {
      // Too slow (or stopping): a short 408 if the socket takes it at once, then close.
      static constexpr char kTimeout[] =
          "HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      [[maybe_unused]] const ssize_t sent =
          send(connection_fd, kTimeout, sizeof(kTimeout) - 1, MSG_NOSIGNAL);
      return;
    }
  }

  const HttpAnswer answer = ChooseHttpAnswer(parsed);
  std::string body = answer.body;
  std::string content_type = "text/plain";
  if (answer.serve_metrics) {
    body = prometheus::TextSerializer().Serialize(registry_->Collect());
    content_type = "text/plain; version=0.0.4; charset=utf-8";
  }
  const std::string head = absl::StrCat(
      "HTTP/1.1 ", answer.status, " ", answer.reason, "\r\nContent-Type: ", content_type,
      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  const absl::Time write_deadline = absl::Now() + options_.write_timeout;
  if (!SendAll(connection_fd, head, write_deadline)) return;
  if (answer.send_body && !SendAll(connection_fd, body, write_deadline)) return;
  // Closing a socket with unread input (a request body, a pipelined request) resets the connection,
  // which can discard the answer before the client reads it: end our side, then read what the
  // client still sends (for at most 200 ms and 64 KiB) before the caller closes.
  shutdown(connection_fd, SHUT_WR);
  const absl::Time drain_deadline = std::min(write_deadline, absl::Now() + absl::Milliseconds(200));
  std::size_t drained = 0;
  while (drained < 65536 && WaitFor(connection_fd, POLLIN, drain_deadline)) {
    const ssize_t received = recv(connection_fd, buffer, sizeof(buffer), 0);
    if (received == 0 || (received < 0 && errno != EINTR && errno != EAGAIN)) break;
    if (received > 0) drained += static_cast<std::size_t>(received);
  }
}

}  // namespace attngrad::server
