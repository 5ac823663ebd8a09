// Metric families and their buckets.
#include "metrics/metrics.h"

namespace attngrad::server {
namespace {

// 100 us .. ~105 s, factor 2 (21 buckets): covers a tiny GPU batch to a large CPU batch.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries bounds;
  for (double bound = 1e-4; bound < 120.0; bound *= 2.0) bounds.push_back(bound);
  return bounds;
}

// One metric family registered by name and help text (the exposition lists the families in the
// order they are registered).
prometheus::Family<prometheus::Histogram>& HistogramFamily(prometheus::Registry& registry,
                                                           const char* name, const char* help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry);
}
prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& registry,
                                                       const char* name, const char* help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry);
}
prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& registry, const char* name,
                                                   const char* help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry);
}

}  // namespace

ServerMetrics::ServerMetrics(const std::string& version)
    : registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::Registry& registry = *registry_;
  batch_duration_ =
      &HistogramFamily(registry, "attngrad_batch_duration_seconds",
                       "End-to-end time of one batch in the server (queue to response ready)");
  stage_duration_ =
      &HistogramFamily(registry, "attngrad_stage_duration_seconds",
                       "Time of one batch in each stage: queue, copy_in, compute, copy_out");
  rpc_duration_ = &HistogramFamily(registry, "attngrad_rpc_duration_seconds",
                                   "Duration of each RPC (streams: from start to finish)");
  batches_ = &CounterFamily(registry, "attngrad_batches_total", "Batches computed");
  tokens_ = &CounterFamily(registry, "attngrad_tokens_total", "Tokens (B*S) computed");
  received_bytes_ =
      &CounterFamily(registry, "attngrad_received_bytes_total", "Tensor payload bytes received");
  sent_bytes_ = &CounterFamily(registry, "attngrad_sent_bytes_total", "Tensor payload bytes sent");
  errors_ =
      &CounterFamily(registry, "attngrad_errors_total",
                     "Errors returned, by method and gRPC code (in-band batch errors included)");
  inflight_ = &GaugeFamily(registry, "attngrad_inflight_batches",
                           "Batches queued or being computed on a device");
  queue_depth_ =
      &GaugeFamily(registry, "attngrad_queue_depth", "Batches waiting in a device's queue");
  queue_capacity_ = &GaugeFamily(registry, "attngrad_queue_capacity",
                                 "Batches a device works on at once (--queue_depth)");
  memory_used_ =
      &GaugeFamily(registry, "attngrad_device_memory_used_bytes", "Device memory in use");
  memory_total_ =
      &GaugeFamily(registry, "attngrad_device_memory_total_bytes", "Device memory in total");
  weights_version_ =
      &GaugeFamily(registry, "attngrad_weights_version", "Version of the weights in use").Add({});
  accumulated_batches_ = &GaugeFamily(registry, "attngrad_accumulated_batches",
                                      "Batches accumulated in the current window")
                              .Add({});
  accumulated_tokens_ = &GaugeFamily(registry, "attngrad_accumulated_tokens",
                                     "Tokens accumulated in the current window")
                             .Add({});
  accumulation_window_id_ = &GaugeFamily(registry, "attngrad_accumulation_window_id",
                                         "Id of the current accumulation window")
                                 .Add({});
  auto& tls_reloads = CounterFamily(registry, "attngrad_tls_reloads_total",
                                    "Changed TLS files: applied, or rejected by the checks (the "
                                    "last good credentials kept)");
  tls_reloads_applied_ = &tls_reloads.Add({{"result", "applied"}});
  tls_reloads_rejected_ = &tls_reloads.Add({{"result", "rejected"}});
  GaugeFamily(registry, "attngrad_build_info", "Build information (value 1)")
      .Add({{"version", version}})
      .Set(1);
}

void ServerMetrics::SetGradientSumPath(const std::string& path, const std::string& nccl_version) {
  prometheus::BuildGauge()
      .Name("attngrad_gradient_sum_info")
      .Help(
          "How FetchGradients sums the devices' accumulators: path nccl (ncclReduce) or host "
          "(value 1)")
      .Register(*registry_)
      .Add({{"path", path}, {"nccl_version", nccl_version}})
      .Set(1);
}

void ServerMetrics::CountTlsReload(bool applied) {
  (applied ? tls_reloads_applied_ : tls_reloads_rejected_)->Increment();
}

void ServerMetrics::ObserveBatch(const std::string& mode, const std::string& device,
                                 long long tokens, const StageSeconds& stages) {
  batch_duration_->Add({{"mode", mode}, {"device", device}}, LatencyBuckets())
      .Observe(stages.total);
  const std::pair<const char*, double> per_stage[] = {{"queue", stages.queue},
                                                      {"copy_in", stages.copy_in},
                                                      {"compute", stages.compute},
                                                      {"copy_out", stages.copy_out}};
  for (const auto& [stage, seconds] : per_stage) {
    stage_duration_->Add({{"stage", stage}, {"device", device}}, LatencyBuckets()).Observe(seconds);
  }
  batches_->Add({{"mode", mode}, {"device", device}}).Increment();
  tokens_->Add({{"mode", mode}, {"device", device}}).Increment(static_cast<double>(tokens));
}

void ServerMetrics::ObserveRpc(const std::string& method, const std::string& code, double seconds) {
  rpc_duration_->Add({{"method", method}, {"code", code}}, LatencyBuckets()).Observe(seconds);
}

void ServerMetrics::CountError(const std::string& method, const std::string& code) {
  errors_->Add({{"method", method}, {"code", code}}).Increment();
}

void ServerMetrics::AddReceivedBytes(const std::string& method, double bytes) {
  received_bytes_->Add({{"method", method}}).Increment(bytes);
}

void ServerMetrics::AddSentBytes(const std::string& method, double bytes) {
  sent_bytes_->Add({{"method", method}}).Increment(bytes);
}

prometheus::Gauge& ServerMetrics::Inflight(const std::string& device) {
  return inflight_->Add({{"device", device}});
}
prometheus::Gauge& ServerMetrics::QueueDepth(const std::string& device) {
  return queue_depth_->Add({{"device", device}});
}
prometheus::Gauge& ServerMetrics::QueueCapacity(const std::string& device) {
  return queue_capacity_->Add({{"device", device}});
}
prometheus::Gauge& ServerMetrics::DeviceMemoryUsed(const std::string& device) {
  return memory_used_->Add({{"device", device}});
}
prometheus::Gauge& ServerMetrics::DeviceMemoryTotal(const std::string& device) {
  return memory_total_->Add({{"device", device}});
}

}  // namespace attngrad::server
