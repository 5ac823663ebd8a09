// GPU device workers (one per CUDA device), available when the server is built with CUDA
// (ATTNGRAD_HAVE_CUDA); without it CreateGpuWorkers returns UNAVAILABLE.
#ifndef ATTNGRAD_SERVER_GPU_WORKER_H_
#define ATTNGRAD_SERVER_GPU_WORKER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "device_worker.h"

namespace attngrad::server {

// One started worker per CUDA device index in `devices`. Each uploads `weights` to its device and
// keeps up to `pipeline_depth` (at least 3: copy-in, compute, copy-out) batches in flight.
absl::StatusOr<std::vector<std::unique_ptr<DeviceWorker>>> CreateGpuWorkers(
    const std::vector<int>& devices, std::shared_ptr<const LayerWeights> weights,
    int pipeline_depth, ServerMetrics* metrics);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GPU_WORKER_H_
