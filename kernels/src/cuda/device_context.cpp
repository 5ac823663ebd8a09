// The per-device state of the GPU backward: its cuBLASLt handle, plan cache and side-stream pool
// (see device_context.h).
#include "cuda/device_context.h"

#include <cstddef>
#include <cstdint>
#include <utility>

namespace attngrad::cuda {
namespace {

// Largest power of two (at most 256) dividing the address: the alignment cuBLASLt may assume.
int AlignmentOf(const void* pointer) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && (address % static_cast<std::uintptr_t>(alignment)) != 0) alignment /= 2;
  return alignment;
}

}  // namespace

attngrad_status DeviceContext::AcquireSideStream(SideStream** side) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (idle_side_streams_.empty()) {
    auto fresh = std::make_unique<SideStream>();
    const attngrad_status status = fresh->Init();
    if (status != ATTNGRAD_OK) return status;
    idle_side_streams_.push_back(fresh.get());
    side_streams_.push_back(std::move(fresh));
  }
  *side = idle_side_streams_.back();
  idle_side_streams_.pop_back();
  return ATTNGRAD_OK;
}

void DeviceContext::ReleaseSideStream(SideStream* side) {
  std::lock_guard<std::mutex> lock(mutex_);
  idle_side_streams_.push_back(side);
}

DeviceContext::~DeviceContext() {
  side_streams_.clear();
  plans_.clear();
  if (handle_) cublasLtDestroy(handle_);
}

attngrad_status DeviceContext::Init() {
  return cublasLtCreate(&handle_) == CUBLAS_STATUS_SUCCESS ? ATTNGRAD_OK : ATTNGRAD_INTERNAL;
}

attngrad_status DeviceContext::Gemm(const GemmSpec& spec, void* gemm_workspace,
                                    cudaStream_t stream) {
  if (spec.m <= 0 || spec.n <= 0 || spec.k <= 0) return ATTNGRAD_INTERNAL;
  int alignment = AlignmentOf(spec.a);
  if (AlignmentOf(spec.b) < alignment) alignment = AlignmentOf(spec.b);
  if (AlignmentOf(spec.d) < alignment) alignment = AlignmentOf(spec.d);
  const PlanKey key{spec.transpose_a ? 1 : 0,
                    spec.transpose_b ? 1 : 0,
                    spec.m,
                    spec.n,
                    spec.k,
                    spec.lda,
                    spec.ldb,
                    spec.ldd,
                    static_cast<int>(spec.arithmetic),
                    spec.d_is_half ? 1 : 0,
                    alignment,
                    spec.device_scalars() ? 1 : 0};
  const GemmPlan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found == plans_.end()) {
      auto fresh = std::make_unique<GemmPlan>();
      const attngrad_status status = fresh->Init(handle_, spec, alignment);
      if (status != ATTNGRAD_OK) return status;
      found = plans_.emplace(key, std::move(fresh)).first;
    }
    plan = found->second.get();
  }
  return plan->Run(handle_, spec, gemm_workspace, stream);
}

DeviceContextRegistry& DeviceContextRegistry::Instance() {
  static DeviceContextRegistry registry;  // thread-safe initialisation (C++11 function statics)
  return registry;
}

attngrad_status DeviceContextRegistry::Get(int device, DeviceContext** context) {
  if (device < 0) return ATTNGRAD_INTERNAL;
  std::lock_guard<std::mutex> lock(mutex_);
  if (contexts_.size() <= static_cast<std::size_t>(device)) contexts_.resize(device + 1);
  if (!contexts_[device]) {
    auto fresh = std::make_unique<DeviceContext>(device);
    const attngrad_status status = fresh->Init();
    if (status != ATTNGRAD_OK) return status;
    contexts_[device] = std::move(fresh);
  }
  *context = contexts_[device].get();
  return ATTNGRAD_OK;
}

}  // namespace attngrad::cuda
