// The projection GEMMs of SPEC section 2 (steps 1, 5 and 9: qkv = X Wqkv^T, dA = dY Wo,
// dWo = dY^T A, dX = dqkv Wqkv, dWqkv = dqkv^T X) through cuBLASLt plans, and the side streams
// that one call forks its concurrent stages onto. Internal to kernels/.
//
// A GEMM is described in cuBLAS's column-major terms (D = alpha op(A) op(B) + beta D, D is m x n).
// A row-major matrix [rows, cols] is the column-major matrix [cols x rows] with the same leading
// dimension, so every product of the pipeline maps onto one such description (backward_device.cu).
//
// A plan (GemmPlan: matmul descriptor, matrix layouts, the algorithm cuBLASLt's heuristic picked)
// is made once per shape and device and kept by that device's DeviceContext (device_context.h).
#ifndef ATTNGRAD_KERNELS_CUDA_PROJECTION_GEMM_H_
#define ATTNGRAD_KERNELS_CUDA_PROJECTION_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attngrad/attngrad.h"
#include "attngrad/cuda_resources.h"

namespace attngrad::cuda {

// Arithmetic of one GEMM: exact fp32, fp32 operands on TF32 tensor cores, or fp16 operands; every
// mode accumulates in fp32.
// kFp16FromFp32: fp32 operands that cuBLASLt rounds to fp16 itself (CUBLAS_COMPUTE_32F_FAST_16F).
enum class GemmArithmetic { kFp32, kTf32, kFp16, kFp16FromFp32 };

// Bytes of cuBLASLt workspace every GEMM may use (carved from the caller's workspace).
inline constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;

struct GemmSpec {
  bool transpose_a = false;
  bool transpose_b = false;
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int lda = 0;
  const void* b = nullptr;
  int ldb = 0;
  void* d = nullptr;  // also C when beta != 0
  int ldd = 0;
  GemmArithmetic arithmetic = GemmArithmetic::kFp32;
  bool d_is_half = false;  // D element type: fp16 (only with kFp16) or fp32
  float alpha = 1.f;
  float beta = 0.f;
  // When set (both), alpha and beta are read from device memory when the GEMM runs instead
  // (cuBLASLt's device pointer mode): the FP16 mode's 1/s (GradientScale, stages.h).
  const float* device_alpha = nullptr;
  const float* device_beta = nullptr;
  bool device_scalars() const { return device_alpha != nullptr; }
};

// One fully specified cuBLASLt algorithm (what cublasLtMatmulAlgoConfigGetAttribute reports), so a
// measured choice can be written down and used instead of the heuristic's.
struct GemmAlgorithm {
  int id = 0;
  std::uint32_t tile = 0, stages = 0;
  std::int32_t split_k = 1;
  std::uint32_t reduction = 0, swizzle = 0, custom = 0;
  std::uint16_t cluster = 0, inner_shape = 0;
  static GemmAlgorithm Of(const cublasLtMatmulAlgo_t& algo);
};

// One cuBLASLt plan: descriptor, layouts and the chosen algorithm. Immutable once made.
class GemmPlan {
 public:
  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan();

  // Builds the descriptors and asks the heuristic for an algorithm (host-side work only): its
  // first choice, or the one of rank `heuristic_rank` in its list (benchmarks compare them).
  static constexpr int kMaxHeuristicRank = 32;
  attngrad_status Init(cublasLtHandle_t handle, const GemmSpec& spec, int alignment,
                       int heuristic_rank = 0);
  // Builds the descriptors with the given algorithm instead of asking the heuristic;
  // ATTNGRAD_UNSUPPORTED when cuBLASLt's check rejects it for this shape and device (or it needs
  // more than kGemmWorkspaceBytes of workspace).
  attngrad_status InitWithAlgorithm(cublasLtHandle_t handle, const GemmSpec& spec,
                                    const GemmAlgorithm& algorithm);
  attngrad_status Run(cublasLtHandle_t handle, const GemmSpec& spec, void* gemm_workspace,
                      cudaStream_t stream) const;
  const cublasLtMatmulAlgo_t& algo() const { return algo_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  attngrad_status Describe(const GemmSpec& spec);  // descriptor and layouts
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr;
  cublasLtMatrixLayout_t layout_b_ = nullptr;
  cublasLtMatrixLayout_t layout_d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  std::size_t workspace_bytes_ = 0;
};

// The events that fork one call's work from the caller's stream onto the lane and the side stream
// and join it back, each recorded once per call on one stream and waited for on another
// (backward_device.cu's RunBackwardPipeline says where).
enum class ForkJoinEvent : int {
  kLaneForked,            // caller -> lane: the call starts
  kSideForked,            // lane -> side: the side stream may read the inputs
  kGradAttentionReady,    // side -> lane: dA = dY Wo, read by the attention forward
  kAttentionForwardDone,  // lane -> side: A, lse and Delta, read by the dQ half and dWo
  kGradQueryReady,        // side -> lane: dq', read by rope_rmsnorm_backward
  kGradQkvReady,          // lane -> side: dq, dk, dv and the norm-weight partials
  kSideDone,              // side -> lane: everything on the side stream
  kLaneDone,              // lane -> caller: the call ends
};
inline constexpr int kForkJoinEvents = 8;

// Two streams of one call besides the caller's, and the events that fork work onto them from the
// caller's stream and join it back (graph-capturable: every fork is an event recorded on one stream
// and waited for on another): `stream()` at the default priority for the work beside the critical
// path, `lane()` at the device's greatest priority for the critical path itself, so that its
// kernels' blocks are scheduled first when both have some waiting.
class SideStream {
 public:
  attngrad_status Init();
  cudaStream_t stream() const { return stream_.get(); }
  cudaStream_t lane() const { return lane_.get(); }
  cudaEvent_t event(ForkJoinEvent which) const { return events_[static_cast<int>(which)].get(); }

 private:
  Stream stream_;
  Stream lane_;
  Event events_[kForkJoinEvents];
};

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_PROJECTION_GEMM_H_
