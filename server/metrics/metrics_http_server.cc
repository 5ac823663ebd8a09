#include "metrics/metrics_http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "prometheus/text_serializer.h"

namespace attngrad::server {
namespace {

constexpr int kRequestTimeoutMs = 5000;
constexpr size_t kMaxRequestBytes = 16384;

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

// Writes all of `data`; a client that stops reading only loses its own answer.
void WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t written = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (written <= 0) {
      if (written < 0 && errno == EINTR) continue;
      return;
    }
    data.remove_prefix(static_cast<size_t>(written));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry) {
  std::string host, port;
  if (absl::Status status = SplitHostPort(listen_address, &host, &port); !status.ok()) return status;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* addresses = nullptr;
  if (const int error = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints,
                                    &addresses);
      error != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: cannot resolve \"", listen_address, "\": ", gai_strerror(error)));
  }
  int listen_fd = -1;
  std::string last_error = "no address";
  for (addrinfo* address = addresses; address != nullptr && listen_fd < 0; address = address->ai_next) {
    const int fd = socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC, address->ai_protocol);
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
  const int bound_port = ntohs(bound.ss_family == AF_INET6
                                   ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                   : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    close(listen_fd);
    return absl::InternalError(absl::StrCat("metrics server: pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(listen_fd, wake[0], wake[1], bound_port, std::move(registry)));
}

MetricsHttpServer::MetricsHttpServer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
                                     std::shared_ptr<prometheus::Registry> registry)
    : listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      registry_(std::move(registry)),
      thread_([this] { Serve(); }) {}

MetricsHttpServer::~MetricsHttpServer() {
  close(wake_write_fd_);  // wakes Serve(), which sees the pipe's end of file
  thread_.join();
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
    const int connection = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    Answer(connection);
    close(connection);
  }
}

void MetricsHttpServer::Answer(int connection_fd) const {
  // Read the request head (up to the blank line), waiting at most kRequestTimeoutMs per read.
  std::string request;
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    pollfd readable{connection_fd, POLLIN, 0};
    if (poll(&readable, 1, kRequestTimeoutMs) <= 0) return;
    const ssize_t received = recv(connection_fd, buffer, sizeof(buffer), 0);
    if (received <= 0) return;
    request.append(buffer, static_cast<size_t>(received));
  }
  const absl::string_view line = absl::string_view(request).substr(0, request.find("\r\n"));
  const bool is_get = absl::StartsWith(line, "GET ");
  const bool is_head = absl::StartsWith(line, "HEAD ");
  const size_t path_start = line.find(' ') + 1;
  const size_t path_end = line.find_first_of(" ?", path_start);
  const absl::string_view path = line.substr(path_start, path_end - path_start);

  std::string status = "200 OK", content_type = "text/plain; version=0.0.4; charset=utf-8", body;
  if (!is_get && !is_head) {
    status = "405 Method Not Allowed";
    content_type = "text/plain";
    body = "only GET and HEAD\n";
  } else if (path != "/metrics") {
    status = "404 Not Found";
    content_type = "text/plain";
    body = "metrics are at /metrics\n";
  } else {
    body = prometheus::TextSerializer().Serialize(registry_->Collect());
  }
  std::string head = absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                                  "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  WriteAll(connection_fd, head);
  if (!is_head) WriteAll(connection_fd, body);
}

}  // namespace attngrad::server
