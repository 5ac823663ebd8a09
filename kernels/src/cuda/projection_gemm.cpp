// Stage: the projection GEMMs of SPEC section 2 (steps 1, 5 and 9) through cuBLASLt: their plans
// and the side streams of a call (see projection_gemm.h).
#include "cuda/projection_gemm.h"

#include <cstdint>

namespace attngrad::cuda {
namespace {

cudaDataType_t OperandType(const GemmSpec& spec) {
  return spec.arithmetic == GemmArithmetic::kFp16 ? CUDA_R_16F : CUDA_R_32F;
}

cublasComputeType_t ComputeType(const GemmSpec& spec) {
  switch (spec.arithmetic) {
    case GemmArithmetic::kTf32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case GemmArithmetic::kFp16FromFp32: return CUBLAS_COMPUTE_32F_FAST_16F;
    default: return CUBLAS_COMPUTE_32F;
  }
}

bool Ok(cublasStatus_t status) { return status == CUBLAS_STATUS_SUCCESS; }

}  // namespace

GemmPlan::~GemmPlan() {
  if (layout_d_) cublasLtMatrixLayoutDestroy(layout_d_);
  if (layout_b_) cublasLtMatrixLayoutDestroy(layout_b_);
  if (layout_a_) cublasLtMatrixLayoutDestroy(layout_a_);
  if (desc_) cublasLtMatmulDescDestroy(desc_);
}

attngrad_status GemmPlan::Describe(const GemmSpec& spec) {
  const cudaDataType_t operand = OperandType(spec);
  const cudaDataType_t output = spec.d_is_half ? CUDA_R_16F : CUDA_R_32F;
  if (!Ok(cublasLtMatmulDescCreate(&desc_, ComputeType(spec), CUDA_R_32F)))
    return ATTNGRAD_INTERNAL;
  const cublasOperation_t op_a = spec.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = spec.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtPointerMode_t pointer_mode =
      spec.device_scalars() ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
  if (!Ok(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &op_a,
                                         sizeof(op_a))) ||
      !Ok(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                         sizeof(op_b))) ||
      !Ok(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode,
                                         sizeof(pointer_mode)))) {
    return ATTNGRAD_INTERNAL;
  }
  // Stored shapes: A is m x k (k x m when transposed), B is k x n (n x k when transposed).
  const int a_rows = spec.transpose_a ? spec.k : spec.m;
  const int a_cols = spec.transpose_a ? spec.m : spec.k;
  const int b_rows = spec.transpose_b ? spec.n : spec.k;
  const int b_cols = spec.transpose_b ? spec.k : spec.n;
  if (!Ok(cublasLtMatrixLayoutCreate(&layout_a_, operand, a_rows, a_cols, spec.lda)) ||
      !Ok(cublasLtMatrixLayoutCreate(&layout_b_, operand, b_rows, b_cols, spec.ldb)) ||
      !Ok(cublasLtMatrixLayoutCreate(&layout_d_, output, spec.m, spec.n, spec.ldd))) {
    return ATTNGRAD_INTERNAL;
  }
  return ATTNGRAD_OK;
}

GemmAlgorithm GemmAlgorithm::Of(const cublasLtMatmulAlgo_t& algo) {
  GemmAlgorithm algorithm;
  auto get = [&algo](cublasLtMatmulAlgoConfigAttributes_t attribute, auto* value) {
    std::size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, value, sizeof(*value), &written);
  };
  get(CUBLASLT_ALGO_CONFIG_ID, &algorithm.id);
  get(CUBLASLT_ALGO_CONFIG_TILE_ID, &algorithm.tile);
  get(CUBLASLT_ALGO_CONFIG_STAGES_ID, &algorithm.stages);
  get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &algorithm.split_k);
  get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &algorithm.reduction);
  get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &algorithm.swizzle);
  get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &algorithm.custom);
  get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &algorithm.cluster);
  get(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &algorithm.inner_shape);
  return algorithm;
}

attngrad_status GemmPlan::InitWithAlgorithm(cublasLtHandle_t handle, const GemmSpec& spec,
                                            const GemmAlgorithm& algorithm) {
  const attngrad_status described = Describe(spec);
  if (described != ATTNGRAD_OK) return described;
  const cudaDataType_t operand = OperandType(spec);
  const cudaDataType_t output = spec.d_is_half ? CUDA_R_16F : CUDA_R_32F;
  if (!Ok(cublasLtMatmulAlgoInit(handle, ComputeType(spec), CUDA_R_32F, operand, operand, output,
                                 output, algorithm.id, &algo_))) {
    return ATTNGRAD_UNSUPPORTED;
  }
  auto set = [this](cublasLtMatmulAlgoConfigAttributes_t attribute, const auto& value) {
    return Ok(cublasLtMatmulAlgoConfigSetAttribute(&algo_, attribute, &value, sizeof(value)));
  };
  if (!set(CUBLASLT_ALGO_CONFIG_TILE_ID, algorithm.tile) ||
      !set(CUBLASLT_ALGO_CONFIG_STAGES_ID, algorithm.stages) ||
      !set(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, algorithm.split_k) ||
      !set(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, algorithm.reduction) ||
      !set(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, algorithm.swizzle) ||
      !set(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, algorithm.custom) ||
      !set(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, algorithm.cluster) ||
      !set(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, algorithm.inner_shape)) {
    return ATTNGRAD_UNSUPPORTED;
  }
  cublasLtMatmulHeuristicResult_t result{};
  if (!Ok(cublasLtMatmulAlgoCheck(handle, desc_, layout_a_, layout_b_, layout_d_, layout_d_, &algo_,
                                  &result)) ||
      result.workspaceSize > kGemmWorkspaceBytes) {
    return ATTNGRAD_UNSUPPORTED;
  }
  workspace_bytes_ = result.workspaceSize;
  return ATTNGRAD_OK;
}

attngrad_status GemmPlan::Init(cublasLtHandle_t handle, const GemmSpec& spec, int alignment,
                               int heuristic_rank) {
  if (heuristic_rank < 0 || heuristic_rank >= kMaxHeuristicRank) return ATTNGRAD_INTERNAL;
  const attngrad_status described = Describe(spec);
  if (described != ATTNGRAD_OK) return described;

  cublasLtMatmulPreference_t preference = nullptr;
  if (!Ok(cublasLtMatmulPreferenceCreate(&preference))) return ATTNGRAD_INTERNAL;
  const std::size_t max_workspace = kGemmWorkspaceBytes;
  const std::uint32_t align = static_cast<std::uint32_t>(alignment);
  bool configured =
      Ok(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &max_workspace, sizeof(max_workspace))) &&
      Ok(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align, sizeof(align))) &&
      Ok(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align, sizeof(align))) &&
      Ok(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align, sizeof(align))) &&
      Ok(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align, sizeof(align)));
  cublasLtMatmulHeuristicResult_t results[kMaxHeuristicRank] = {};
  int found = 0;
  if (configured) {
    configured =
        Ok(cublasLtMatmulAlgoGetHeuristic(handle, desc_, layout_a_, layout_b_, layout_d_, layout_d_,
                                          preference, heuristic_rank + 1, results, &found));
  }
  cublasLtMatmulPreferenceDestroy(preference);
  if (!configured || found <= heuristic_rank) return ATTNGRAD_INTERNAL;
  const cublasLtMatmulHeuristicResult_t& result = results[heuristic_rank];
  if (!Ok(result.state)) return ATTNGRAD_INTERNAL;
  algo_ = result.algo;
  workspace_bytes_ = result.workspaceSize;
  return ATTNGRAD_OK;
}

attngrad_status GemmPlan::Run(cublasLtHandle_t handle, const GemmSpec& spec, void* gemm_workspace,
                              cudaStream_t stream) const {
  if (spec.device_scalars() != (spec.device_beta != nullptr)) return ATTNGRAD_INTERNAL;
  const float* alpha = spec.device_scalars() ? spec.device_alpha : &spec.alpha;
  const float* beta = spec.device_scalars() ? spec.device_beta : &spec.beta;
  const cublasStatus_t status = cublasLtMatmul(
      handle, desc_, alpha, spec.a, layout_a_, spec.b, layout_b_, beta, spec.d, layout_d_, spec.d,
      layout_d_, &algo_, gemm_workspace, workspace_bytes_, stream);
  if (status == CUBLAS_STATUS_SUCCESS) return ATTNGRAD_OK;
  return status == CUBLAS_STATUS_EXECUTION_FAILED ? ATTNGRAD_CUDA_ERROR : ATTNGRAD_INTERNAL;
}

attngrad_status SideStream::Init() {
  int least = 0, greatest = 0;
  if (Stream::Create(&stream_) != cudaSuccess ||
      cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
      Stream::CreateWithPriority(&lane_, greatest) != cudaSuccess) {
    return ATTNGRAD_CUDA_ERROR;
  }
  for (Event& event : events_) {
    if (Event::Create(&event, cudaEventDisableTiming) != cudaSuccess) return ATTNGRAD_CUDA_ERROR;
  }
  return ATTNGRAD_OK;
}

}  // namespace attngrad::cuda
