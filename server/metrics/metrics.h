// The server's Prometheus metrics (names and labels as in the team conventions; bounded labels
// only: method, code, mode, stage, device, version, path, nccl_version, result). One ServerMetrics
// per server; thread-safe.
#ifndef ATTNGRAD_SERVER_METRICS_H_
#define ATTNGRAD_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace attngrad::server {

struct StageSeconds {
  double queue = 0, copy_in = 0, compute = 0, copy_out = 0, total = 0;
};

class ServerMetrics {
 public:
  explicit ServerMetrics(const std::string& version);

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // One finished batch on `device` ("cpu", "cuda:0", ...); mode "return" or "accumulate" (a
  // backward batch) or "forward" (a FORWARD batch: the layer's output).
  void ObserveBatch(const std::string& mode, const std::string& device, long long tokens,
                    const StageSeconds& stages);
  // One finished RPC (method "Backward", "GetModelInfo", ..., or "unknown" for a path the service
  // does not define; code a gRPC code name); recorded by
  // rpc/rpc_metrics_interceptor.h for every call, with CountError for those not OK.
  void ObserveRpc(const std::string& method, const std::string& code, double seconds);
  void CountError(const std::string& method, const std::string& code);
  void AddReceivedBytes(const std::string& method, double bytes);
  void AddSentBytes(const std::string& method, double bytes);

  // Per-device gauges (created on first use).
  prometheus::Gauge& Inflight(const std::string& device);
  prometheus::Gauge& QueueDepth(const std::string& device);
  prometheus::Gauge& QueueCapacity(const std::string& device);
  prometheus::Gauge& DeviceMemoryUsed(const std::string& device);
  prometheus::Gauge& DeviceMemoryTotal(const std::string& device);

  // attngrad_gradient_sum_info{path="nccl"|"host",nccl_version} = 1: how fetches sum the devices'
  // accumulators (set once at start-up).
  void SetGradientSumPath(const std::string& path, const std::string& nccl_version);

  // attngrad_tls_reloads_total{result="applied"|"rejected"}: changed TLS files put in use, or
  // refused (the last good credentials kept).
  void CountTlsReload(bool applied);

  prometheus::Gauge& weights_version() { return *weights_version_; }
  prometheus::Gauge& accumulated_batches() { return *accumulated_batches_; }
  prometheus::Gauge& accumulated_tokens() { return *accumulated_tokens_; }
  prometheus::Gauge& accumulation_window_id() { return *accumulation_window_id_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>* batch_duration_;
  prometheus::Family<prometheus::Histogram>* stage_duration_;
  prometheus::Family<prometheus::Histogram>* rpc_duration_;
  prometheus::Family<prometheus::Counter>* batches_;
  prometheus::Family<prometheus::Counter>* tokens_;
  prometheus::Family<prometheus::Counter>* received_bytes_;
  prometheus::Family<prometheus::Counter>* sent_bytes_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Family<prometheus::Gauge>* inflight_;
  prometheus::Family<prometheus::Gauge>* queue_depth_;
  prometheus::Family<prometheus::Gauge>* queue_capacity_;
  prometheus::Family<prometheus::Gauge>* memory_used_;
  prometheus::Family<prometheus::Gauge>* memory_total_;
  prometheus::Counter* tls_reloads_applied_;
  prometheus::Counter* tls_reloads_rejected_;
  prometheus::Gauge* weights_version_;
  prometheus::Gauge* accumulated_batches_;
  prometheus::Gauge* accumulated_tokens_;
  prometheus::Gauge* accumulation_window_id_;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_METRICS_H_
