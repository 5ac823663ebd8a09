// A running attngrad server: the device workers, the gRPC server (AttentionGradient, grpc.health.v1
// and reflection) and the Prometheus /metrics endpoint. Used by main.cc and, in-process, by the
// tests.
#ifndef ATTNGRAD_SERVER_SERVER_H_
#define ATTNGRAD_SERVER_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/tls.h"
#include "scheduling/memory_budget.h"
#include "server_options.h"
#include "weights/model.h"

namespace grpc {
class Server;
}

namespace attngrad::server {

class GradientCore;
class GradientService;
class MetricsHttpServer;
class RegionSocketListener;
class ServerMetrics;

// The --devices value resolved: GPU indices, or none for the CPU backend.
struct DeviceSelection {
  bool cpu = false;
  std::vector<int> gpus;
};
absl::StatusOr<DeviceSelection> ParseDevices(const std::string& devices, int gpu_count);

// The layers --weights, --model, --layers, --weights_seed and --weights_layer ask for: a model
// directory (config.json + safetensors) or a named model's random weights, whole or a range; else
// the seed's single layer (random SPEC weights as layer 0, or --weights_layer of a file).
absl::StatusOr<ServedModel> LoadServedModel(const ServerOptions& options);
// One line for the start-up log: which layers, how much fp32 memory, from where.
std::string ModelSummary(const ServedModel& model);

// Raises the soft limit of open descriptors (RLIMIT_NOFILE) to the hard limit: each connection
// takes one, and at the soft default (often 1024) a burst of idle connections stopped the listener
// ("Too many open files"). One line for the start-up log says what was done.
std::string RaiseOpenFileLimit();

class GradientServer {
 public:
  // Loads the weights, starts the workers, binds the ports and starts serving.
  static absl::StatusOr<std::unique_ptr<GradientServer>> Start(const ServerOptions& options);
  ~GradientServer();  // Shutdown(0) if not done

  int port() const { return port_; }                  // the bound gRPC port
  int metrics_port() const { return metrics_port_; }  // 0 when metrics are off
  const std::string& instance_id() const { return instance_id_; }
  // How a fetch sums the devices' accumulators: with NCCL (ncclReduce onto the first GPU) or on
  // the host; gradient_sum() is one line saying which and why (main.cc logs it at start-up).
  bool uses_nccl() const { return uses_nccl_; }
  const std::string& nccl_version() const { return nccl_version_; }  // "2.28.9"; empty without
  const std::string& gradient_sum() const { return gradient_sum_; }
  // Lines for the start-up log: the transport (plaintext, TLS, mutual TLS), authentication (on
  // with N tokens, or OFF said loudly) and the interfaces gRPC and /metrics listen on.
  const std::vector<std::string>& security_summary() const { return security_summary_; }
  const std::string& model_summary() const { return model_summary_; }
  // Where clients pass sealed memfds to register shared memory; empty when --region_socket=off.
  const std::string& region_socket_path() const;
  // Host memory of data in flight, in all and per client (--max_inflight_bytes).
  const MemoryBudget& inflight_memory() const;

  // Stops accepting RPCs, marks health NOT_SERVING, ends the Backward streams with no batch in
  // flight (UNAVAILABLE) and lets running RPCs (and their batches) finish for up to `grace`, then
  // cancels the rest, drains the workers and stops. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  GradientServer() = default;
  // Starts the region socket of --region_socket (`flag`); the start-up log's line about it. An
  // explicit path that cannot be served is an error; the default one turns shared memory off.
  static absl::StatusOr<std::string> StartRegionSocket(const std::string& flag,
                                                       GradientServer& server);

  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<GradientCore> core_;
  std::unique_ptr<GradientService> service_;
  std::unique_ptr<TlsReloader> tls_reloader_;            // TLS only; destroyed after server_
  std::unique_ptr<RegionSocketListener> region_socket_;  // destroyed before service_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string instance_id_;
  bool uses_nccl_ = false;
  std::string nccl_version_;
  std::string gradient_sum_;
  std::vector<std::string> security_summary_;
  std::string model_summary_;
  bool stopped_ = false;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_SERVER_H_
