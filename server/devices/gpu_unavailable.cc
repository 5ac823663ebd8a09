// CreateGpuWorkers of a build without CUDA (ATTNGRAD_HAVE_CUDA unset).
#include "devices/gpu_worker.h"

namespace attngrad::server {

absl::StatusOr<GpuWorkers> CreateGpuWorkers(const std::vector<int>&, const LayerSlots&, int,
                                            NcclMode, ServerMetrics*) {
  return absl::UnavailableError(
      "--devices: this server was built without CUDA (ATTNGRAD_CUDA=OFF); use --devices=cpu");
}

}  // namespace attngrad::server
