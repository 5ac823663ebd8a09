// MetricsHttpServer: serves a prometheus-cpp registry as the Prometheus text exposition at
// GET /metrics over plain HTTP/1.1. One thread accepts; each connection is served on its own thread
// (at most max_connections at once; beyond that a connection is answered 503 and closed), and a
// connection gets read_timeout for its whole request head and write_timeout for its whole answer,
// so a slow or stalled client holds one thread for a bounded time and never delays the others.
// The request head is parsed by ParseHttpRequestHead (http_request.h).
//
// prometheus-cpp's own Exposer is not used: Debian's civetweb starts its threads with a fixed
// 100 KiB stack, and in a server linked with cuBLASLt (which has ~94 KiB of static TLS, carved out
// of every thread's stack by glibc) those threads cannot be created, so the Exposer fails to start.
// The threads here have the ordinary (8 MiB) stack.
#ifndef ATTNGRAD_SERVER_METRICS_HTTP_SERVER_H_
#define ATTNGRAD_SERVER_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <cstddef>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "prometheus/registry.h"

namespace attngrad::server {

struct MetricsHttpOptions {
  absl::Duration read_timeout = absl::Seconds(5);    // for the whole request head
  absl::Duration write_timeout = absl::Seconds(10);  // for the whole answer
  int max_connections = 16;                          // served at once
  std::size_t max_request_bytes = 8192;              // request head; larger: 431
};

class MetricsHttpServer {
 public:
  // Binds `listen_address` ("host:port", "[v6]:port"; port 0 picks a free one) and starts serving.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry,
      const MetricsHttpOptions& options = MetricsHttpOptions());
  ~MetricsHttpServer();  // stops every thread (open connections are closed) and the socket

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  struct Connection {
    std::thread thread;
    std::atomic<bool> finished{false};
  };

  MetricsHttpServer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
                    std::shared_ptr<prometheus::Registry> registry,
                    const MetricsHttpOptions& options);
  void Serve();
  void JoinFinishedConnections();
  void Answer(int connection_fd) const;
  // Sends all of `data` before `deadline`; false when the client does not take it in time, the
  // connection fails or the server stops.
  bool SendAll(int connection_fd, absl::string_view data, absl::Time deadline) const;
  // Waits for `events` on the connection until `deadline`; false on timeout, error or stop.
  bool WaitFor(int connection_fd, short events, absl::Time deadline) const;

  int listen_fd_;
  int wake_read_fd_;  // a pipe whose write end the destructor closes to stop every thread
  int wake_write_fd_;
  int port_;
  std::shared_ptr<prometheus::Registry> registry_;
  MetricsHttpOptions options_;
  std::list<Connection> connections_;  // only the accepting thread touches it (and the destructor)
  std::thread thread_;                 // the accepting thread: Serve()
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_METRICS_HTTP_SERVER_H_
