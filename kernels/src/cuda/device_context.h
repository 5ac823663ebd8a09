// The per-device state of the GPU backward: cuBLASLt handle, GEMM plans, the pool of side streams
// and the replayable pipeline graphs of one device (DeviceContext), and the process-wide registry
// of one DeviceContext per device. Internal to kernels/.
//
// Plans (projection_gemm.h's GemmPlan) are created on first use of a shape and reused for every
// later call with that shape on that device. The registry that owns the contexts is one
// process-wide object (DeviceContextRegistry::Instance(), a function-local static with thread-safe
// initialisation); every lookup takes its mutex, plans are never freed or changed once made, so the
// GEMMs themselves run without holding a lock.
#ifndef ATTNGRAD_KERNELS_CUDA_DEVICE_CONTEXT_H_
#define ATTNGRAD_KERNELS_CUDA_DEVICE_CONTEXT_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "attngrad/attngrad.h"
#include "cuda/pipeline_graph.h"
#include "cuda/projection_gemm.h"

namespace attngrad::cuda {

// cuBLASLt handle, plans, side streams and replayable pipeline graphs of one device.
class DeviceContext {
 public:
  explicit DeviceContext(int device) : device_(device) {}
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;
  ~DeviceContext();

  attngrad_status Init();  // creates the cuBLASLt handle; called once by the registry
  int device() const { return device_; }

  // Runs one GEMM on `stream`, creating its plan the first time this shape is seen.
  attngrad_status Gemm(const GemmSpec& spec, void* gemm_workspace, cudaStream_t stream);

  // A side stream for one call's concurrent stages: taken from a pool (created on first need, so
  // at most as many exist as calls ever ran at once on this device) and given back after the call
  // has enqueued its work. A later call that reuses it is ordered after the earlier one's work on
  // it, which is always correct.
  attngrad_status AcquireSideStream(SideStream** side);
  void ReleaseSideStream(SideStream* side);

  // The graphs of repeated calls on this device (pipeline_graph.h).
  PipelineGraphCache& pipeline_graphs() { return pipeline_graphs_; }

 private:
  // Everything the heuristic's choice depends on: shape, leading dimensions, types, pointer
  // alignment, where alpha and beta live.
  using PlanKey = std::tuple<int, int, int, int, int, int, int, int, int, int, int, int>;

  int device_;
  cublasLtHandle_t handle_ = nullptr;
  std::mutex mutex_;
  std::map<PlanKey, std::unique_ptr<GemmPlan>> plans_;
  std::vector<std::unique_ptr<SideStream>> side_streams_;  // all made, owned here
  std::vector<SideStream*> idle_side_streams_;
  PipelineGraphCache pipeline_graphs_;
};

// Holds a side stream for the scope of one call.
class SideStreamLease {
 public:
  explicit SideStreamLease(DeviceContext* context) : context_(context) {}
  SideStreamLease(const SideStreamLease&) = delete;
  SideStreamLease& operator=(const SideStreamLease&) = delete;
  ~SideStreamLease() {
    if (side_) context_->ReleaseSideStream(side_);
  }
  attngrad_status Acquire() { return context_->AcquireSideStream(&side_); }
  SideStream* get() const { return side_; }

 private:
  DeviceContext* context_;
  SideStream* side_ = nullptr;
};

// Process-wide owner of one DeviceContext per device, created lazily and thread-safely.
class DeviceContextRegistry {
 public:
  static DeviceContextRegistry& Instance();
  // The context of `device`, created on first use. Never null when ATTNGRAD_OK is returned.
  attngrad_status Get(int device, DeviceContext** context);

 private:
  DeviceContextRegistry() = default;
  std::mutex mutex_;
  std::vector<std::unique_ptr<DeviceContext>> contexts_;
};

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_DEVICE_CONTEXT_H_
