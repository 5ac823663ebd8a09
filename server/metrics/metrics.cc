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

}  // namespace

ServerMetrics::ServerMetrics(const std::string& version)
    : registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  batch_duration_ =
      &BuildHistogram()
           .Name("attngrad_batch_duration_seconds")
           .Help("End-to-end time of one batch in the server (queue to response ready)")
           .Register(*registry_);
  stage_duration_ = &BuildHistogram()
                         .Name("attngrad_stage_duration_seconds")
                         .Help("Time of one batch in each stage: queue, copy_in, compute, copy_out")
                         .Register(*registry_);
  rpc_duration_ = &BuildHistogram()
                       .Name("attngrad_rpc_duration_seconds")
                       .Help("Duration of each RPC (streams: from start to finish)")
                       .Register(*registry_);
  batches_ =
      &BuildCounter().Name("attngrad_batches_total").Help("Batches computed").Register(*registry_);
  tokens_ = &BuildCounter()
                 .Name("attngrad_tokens_total")
                 .Help("Tokens (B*S) computed")
                 .Register(*registry_);
  received_bytes_ = &BuildCounter()
                         .Name("attngrad_received_bytes_total")
                         .Help("Tensor payload bytes received")
                         .Register(*registry_);
  sent_bytes_ = &BuildCounter()
                     .Name("attngrad_sent_bytes_total")
                     .Help("Tensor payload bytes sent")
                     .Register(*registry_);
  errors_ = &BuildCounter()
                 .Name("attngrad_errors_total")
                 .Help("Errors returned, by method and gRPC code (in-band batch errors included)")
                 .Register(*registry_);
  inflight_ = &BuildGauge()
                   .Name("attngrad_inflight_batches")
                   .Help("Batches queued or being computed on a device")
                   .Register(*registry_);
  queue_depth_ = &BuildGauge()
                      .Name("attngrad_queue_depth")
                      .Help("Batches waiting in a device's queue")
                      .Register(*registry_);
  queue_capacity_ = &BuildGauge()
                         .Name("attngrad_queue_capacity")
                         .Help("Batches a device works on at once (--queue_depth)")
                         .Register(*registry_);
  memory_used_ = &BuildGauge()
                      .Name("attngrad_device_memory_used_bytes")
                      .Help("Device memory in use")
                      .Register(*registry_);
  memory_total_ = &BuildGauge()
                       .Name("attngrad_device_memory_total_bytes")
                       .Help("Device memory in total")
                       .Register(*registry_);
  weights_version_ = &BuildGauge()
                          .Name("attngrad_weights_version")
                          .Help("Version of the weights in use")
                          .Register(*registry_)
                          .Add({});
  accumulated_batches_ = &BuildGauge()
                              .Name("attngrad_accumulated_batches")
                              .Help("Batches accumulated in the current window")
                              .Register(*registry_)
                              .Add({});
  accumulated_tokens_ = &BuildGauge()
                             .Name("attngrad_accumulated_tokens")
                             .Help("Tokens accumulated in the current window")
                             .Register(*registry_)
                             .Add({});
  accumulation_window_id_ = &BuildGauge()
                                 .Name("attngrad_accumulation_window_id")
                                 .Help("Id of the current accumulation window")
                                 .Register(*registry_)
                                 .Add({});
  auto& tls_reloads = BuildCounter()
                          .Name("attngrad_tls_reloads_total")
                          .Help(
                              "Changed TLS files: applied, or rejected by the checks (the last "
                              "good credentials kept)")
                          .Register(*registry_);
  tls_reloads_applied_ = &tls_reloads.Add({{"result", "applied"}});
  tls_reloads_rejected_ = &tls_reloads.Add({{"result", "rejected"}});
  BuildGauge()
      .Name("attngrad_build_info")
      .Help("Build information (value 1)")
      .Register(*registry_)
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
