// GPU device workers (one per CUDA device), available when the server is built with CUDA
// (ATTNGRAD_HAVE_CUDA); without it CreateGpuWorkers returns UNAVAILABLE.
#ifndef ATTNGRAD_SERVER_GPU_WORKER_H_
#define ATTNGRAD_SERVER_GPU_WORKER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attngrad/common/buffer_pool.h"
#include "scheduling/device_worker.h"

namespace attngrad::server {

// --nccl: whether the GPUs' accumulators are summed with NCCL at a fetch (two or more GPUs;
// one device has nothing to sum).
enum class NcclMode {
  kAuto,  // NCCL when nccl.h was found at build time and libnccl.so.2 loads, else on the host
  kOn,    // with two or more GPUs: NCCL or no start (an error says why not)
  kOff,   // always on the host
};

// How a fetch sums the devices' accumulators.
struct GradientSumPath {
  bool nccl = false;         // ncclReduce onto the first GPU, else a host-side sum
  std::string nccl_version;  // "2.28.9" when nccl
  std::string description;   // one line for the log, saying why
};

class DeviceMemoryOpener;  // rpc/regions.h

struct GpuWorkers {
  std::vector<std::unique_ptr<DeviceWorker>> workers;
  GradientSumPath sum;
  // Opens same-host clients' CUDA IPC regions on these devices (devices/cuda_ipc_memory.h).
  std::shared_ptr<DeviceMemoryOpener> device_memory;
  // Page-locked memory that received batches are staged into on arrival (scheduling/staging.h).
  std::shared_ptr<common::BufferPool> arrival_staging;
};

// One started worker per CUDA device index in `devices`. Each uploads every layer of `layers` to
// its device once (a layer the kernels do not support, e.g. head_dim 256 while the kernels lack
// it, is refused per batch with UNIMPLEMENTED naming the kernels' reason) and
// keeps up to `pipeline_depth` (at least 3: copy-in, compute, copy-out) batches in flight. With two
// or more devices and NCCL usable (see NcclMode), the workers share one NCCL communicator each
// (ncclCommInitAll, made here) and a fetch reduces their accumulators onto the first device.
absl::StatusOr<GpuWorkers> CreateGpuWorkers(const std::vector<int>& devices,
                                            const LayerSlots& layers, int pipeline_depth,
                                            NcclMode nccl, ServerMetrics* metrics);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_GPU_WORKER_H_
