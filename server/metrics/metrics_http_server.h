// MetricsHttpServer: serves a prometheus-cpp registry as the Prometheus text exposition at
// GET /metrics over plain HTTP/1.1, on one thread with an ordinary (8 MiB) stack.
//
// prometheus-cpp's own Exposer is not used: Debian's civetweb starts its threads with a fixed
// 100 KiB stack, and in a server linked with cuBLASLt (which has ~94 KiB of static TLS, carved out
// of every thread's stack by glibc) those threads cannot be created, so the Exposer fails to start.
#ifndef ATTNGRAD_SERVER_METRICS_HTTP_SERVER_H_
#define ATTNGRAD_SERVER_METRICS_HTTP_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace attngrad::server {

class MetricsHttpServer {
 public:
  // Binds `listen_address` ("host:port", "[v6]:port"; port 0 picks a free one) and starts serving.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsHttpServer();  // stops the thread and closes the socket

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
                    std::shared_ptr<prometheus::Registry> registry);
  void Serve();
  void Answer(int connection_fd) const;

  int listen_fd_;
  int wake_read_fd_;   // a pipe whose write end the destructor closes to stop Serve()
  int wake_write_fd_;
  int port_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::thread thread_;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_METRICS_HTTP_SERVER_H_
