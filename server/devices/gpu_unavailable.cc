// CreateGpuWorkers and CopyWeightsFromDevice of a build without CUDA (ATTNGRAD_HAVE_CUDA unset).
#include "devices/device_weights.h"
#include "devices/gpu_worker.h"

namespace attngrad::server {

absl::StatusOr<GpuWorkers> CreateGpuWorkers(const std::vector<int>&, const LayerSlots&, int,
                                            NcclMode, ServerMetrics*) {
  return absl::UnavailableError(
      "--devices: this server was built without CUDA (ATTNGRAD_CUDA=OFF); use --devices=cpu");
}

absl::StatusOr<std::shared_ptr<const DeviceLayerWeights>> CopyWeightsFromDevice(
    const LayerConfig&, const PerWeight<DeviceWeightSource>&) {
  return absl::FailedPreconditionError(
      "region: this server was built without CUDA, so it holds no weights in GPU memory");
}

absl::Status CopyToDeviceMemory(const RegionBytes&, const void*, std::size_t) {
  return absl::FailedPreconditionError(
      "destinations: this server was built without CUDA, so it writes no GPU memory");
}

}  // namespace attngrad::server
