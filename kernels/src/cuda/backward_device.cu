// Stage: the whole GPU backward of SPEC section 2 — the pipeline that strings the stages together on
// the caller's stream with memory carved from the caller's workspace (no allocation, no host
// synchronisation, so a caller can capture it in a CUDA graph):
//   convert (FP16 mode)  X, dY (times the power of two s found on the device), Wq|Wk|Wv, Wo
//                        -> fp16 operands; every output GEMM then has alpha = 1/s (stages.h)
//   qkv GEMM             qkv = X [Wq;Wk;Wv]^T                       (step 1)
//   rmsnorm_rope         q', k' and 1/rms                            (steps 2-3)
//   grad_attn GEMM       dA = dY Wo                                  (step 5)
//   attention_forward    A, the log-sum-exp, Delta = rowsum(dA * A)  (step 4)
//   grad_o GEMM          dWo (+)= dY^T A                             (step 5)
//   attention_backward   dq', dk', dv                                (step 6)
//   rope_rmsnorm_bwd     dq, dk (+ dv) as one operand, norm-weight gradients (steps 7-8)
//   grad_x GEMM          dX = [dq dk dv] [Wq;Wk;Wv]                  (step 9)
//   grad_w_qkv GEMMs     dWq, dWk, dWv (+)= [dq dk dv]^T X            (step 9)
// and the attngrad::BackwardDevice / DeviceWorkspaceSize / DeviceCount entry points of backward.h.
//
// Two streams forked from and joined back to the caller's stream with events: the critical path
// on a lane of the greatest priority, the independent work beside it on a side stream of the
// default priority (it overlaps the attention at small sizes, where one GEMM does not fill the
// GPU, and yields SMs to the lane's kernels when both have blocks waiting):
//   lane:            convert X, W | qkv GEMM, rmsnorm_rope | (wait dA) attention_forward (+ Delta)
//                    | attention_backward dK/dV half | (wait dQ) rope_rmsnorm_bwd | grad_x GEMM,
//                    dWv | (wait side)
//   side stream:     dY's scale, convert dY, Wo | grad_attn GEMM | (wait A) attention_backward
//                    dQ half, grad_o GEMM | (wait dqkv) norm-weight gradients' final sum, dWq, dWk
// With a StageObserver (per-stage timing) everything runs on the caller's stream, in that order.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "attngrad/backward.h"
#include "cuda/attention.h"
#include "cuda/pipeline.h"
#include "cuda/projection_gemm.h"
#include "cuda/stages.h"
#include "validate.h"

namespace attngrad {
namespace cuda {
namespace {

constexpr std::size_t kAlignment = 256;

std::size_t RoundUp(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// What one precision mode uses for each kind of arithmetic.
struct ModeChoice {
  GemmArithmetic gemm;
  OperandType operand;
  AttentionOperand attention;
  bool half() const { return operand == OperandType::kHalf; }
};

ModeChoice ChoiceOf(Precision resolved) {
  switch (resolved) {
    case Precision::kFp16:
      return {GemmArithmetic::kFp16, OperandType::kHalf, AttentionOperand::kFp16};
    case Precision::kTf32:
      return {GemmArithmetic::kTf32, OperandType::kFloat, AttentionOperand::kTf32};
    default:
      return {GemmArithmetic::kFp32, OperandType::kFloat, AttentionOperand::kFp32};
  }
}

AttentionProblem ProblemOf(const LayerConfig& config, int batch, int seq_len,
                           const Scalars& scalars, const ModeChoice& mode) {
  AttentionProblem problem;
  problem.batch = batch;
  problem.seq_len = seq_len;
  problem.num_heads = config.num_heads;
  problem.num_kv_heads = config.num_kv_heads;
  problem.scaling = scalars.scaling;
  problem.softcap = scalars.softcap;
  problem.operand = mode.attention;
  return problem;
}

// Byte offsets (from the 256-aligned start of the workspace) of every intermediate tensor.
// Tensors a mode does not use get zero bytes.
struct WorkspaceLayout {
  std::size_t x_half = 0, grad_y_half = 0, w_qkv_half = 0, w_o_half = 0, gradient_scale = 0;
  std::size_t qkv = 0, attention_operands = 0, inv_rms = 0;
  std::size_t attention_out = 0, attention_out_half = 0, lse = 0;
  std::size_t grad_attention = 0, grad_q_rot = 0, grad_k_rot = 0, grad_v = 0;
  std::size_t grad_qkv = 0, partials = 0, attention_workspace = 0;
  std::size_t gemm_workspace = 0, side_gemm_workspace = 0;  // one per stream
  std::size_t attention_workspace_bytes = 0;
  std::size_t total = 0;  // including the slack to align the start

  WorkspaceLayout(const LayerConfig& config, int batch, int seq_len, const ModeChoice& mode) {
    const std::size_t tokens = static_cast<std::size_t>(batch) * seq_len;
    const std::size_t hidden = config.hidden_size;
    const std::size_t q_width = config.q_out();
    const std::size_t kv_width = config.kv_out();
    const std::size_t qkv_width = q_width + 2 * kv_width;
    const std::size_t operand_bytes = mode.half() ? sizeof(__half) : sizeof(float);
    std::size_t cursor = 0;
    auto carve = [&cursor](std::size_t bytes) {
      const std::size_t offset = cursor;
      cursor += RoundUp(bytes);
      return offset;
    };
    if (mode.half()) {
      x_half = carve(tokens * hidden * sizeof(__half));
      grad_y_half = carve(tokens * hidden * sizeof(__half));
      w_qkv_half = carve(qkv_width * hidden * sizeof(__half));
      w_o_half = carve(hidden * q_width * sizeof(__half));
      attention_out_half = carve(tokens * q_width * sizeof(__half));
      gradient_scale = carve(sizeof(GradientScale));
    }
    qkv = carve(tokens * qkv_width * sizeof(float));
    attention_operands = carve(tokens * qkv_width * operand_bytes);
    inv_rms = carve(tokens * (config.num_heads + config.num_kv_heads) * sizeof(float));
    if (!mode.half()) attention_out = carve(tokens * q_width * sizeof(float));  // FP16: fp16 A only
    lse = carve(tokens * config.num_heads * sizeof(float));
    grad_attention = carve(tokens * q_width * operand_bytes);
    grad_q_rot = carve(tokens * q_width * sizeof(float));
    grad_k_rot = carve(tokens * kv_width * sizeof(float));
    grad_v = carve(tokens * kv_width * sizeof(float));
    grad_qkv = carve(tokens * qkv_width * operand_bytes);
    partials = carve(RopeRmsNormBackwardPartialsBytes(static_cast<int>(tokens)));
    attention_workspace_bytes =
        AttentionBackwardWorkspaceSize(ProblemOf(config, batch, seq_len, Scalars{}, mode));
    attention_workspace = carve(attention_workspace_bytes);
    gemm_workspace = carve(kGemmWorkspaceBytes);
    side_gemm_workspace = carve(kGemmWorkspaceBytes);
    total = cursor + kAlignment;
  }
};

bool Supported(const LayerConfig& config) {
  return config.IsValid() && config.head_dim == kHeadDim;
}

bool Aligned16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

#define ATTNGRAD_RETURN_IF_ERROR(expression)        \
  do {                                              \
    const attngrad_status status_ = (expression);   \
    if (status_ != ATTNGRAD_OK) return status_;     \
  } while (0)

}  // namespace

Precision ResolvePrecision(Precision precision, int batch, int seq_len) {
  if (precision != Precision::kAuto) return precision;
  (void)batch;
  (void)seq_len;
  return Precision::kFp16;
}

attngrad_status RunBackwardPipeline(const LayerConfig& config, int batch, int seq_len,
                                    const Scalars& scalars, Precision precision, bool accumulate,
                                    const BackwardInputs& in, const BackwardOutputs& out,
                                    void* workspace, std::size_t workspace_size,
                                    cudaStream_t caller_stream, StageObserver* observer,
                                    SideStream* given_side) {
  if (!IsValidPrecision(static_cast<int>(precision))) return ATTNGRAD_INVALID_ARGUMENT;
  if (!Supported(config)) return ATTNGRAD_UNSUPPORTED;
  ATTNGRAD_RETURN_IF_ERROR(ValidateBackwardArguments(config, batch, seq_len, scalars, in, out));
  // The element-wise kernels read 16 bytes at a time from these (cudaMalloc gives 256).
  if (!Aligned16(in.cos) || !Aligned16(in.sin) || !Aligned16(in.q_norm_weight) ||
      !Aligned16(in.k_norm_weight)) {
    return ATTNGRAD_INVALID_ARGUMENT;
  }
  const ModeChoice mode = ChoiceOf(ResolvePrecision(precision, batch, seq_len));
  const WorkspaceLayout layout(config, batch, seq_len, mode);
  if (workspace == nullptr || workspace_size < layout.total) return ATTNGRAD_WORKSPACE_TOO_SMALL;

  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return ATTNGRAD_CUDA_ERROR;
  DeviceContext* context = nullptr;
  ATTNGRAD_RETURN_IF_ERROR(DeviceContextRegistry::Instance().Get(device, &context));
  SideStreamLease side_lease(context);
  SideStream* side_stream = nullptr;  // null with an observer: everything on the caller's stream
  if (observer == nullptr) {
    if (given_side == nullptr) ATTNGRAD_RETURN_IF_ERROR(side_lease.Acquire());
    side_stream = given_side != nullptr ? given_side : side_lease.get();
  }
  // `stream` carries the critical path: the side's high-priority lane, forked from the caller's
  // stream here and joined back at the end.
  const cudaStream_t stream = side_stream != nullptr ? side_stream->lane() : caller_stream;
  const cudaStream_t side = side_stream != nullptr ? side_stream->stream() : caller_stream;
  // mark(i, s): event i of the side stream records what is enqueued so far on s; wait(i, s): s
  // waits for it.
  auto mark = [side_stream](int index, cudaStream_t signaller) {
    if (side_stream == nullptr) return ATTNGRAD_OK;
    return cudaEventRecord(side_stream->event(index), signaller) == cudaSuccess
               ? ATTNGRAD_OK
               : ATTNGRAD_CUDA_ERROR;
  };
  auto wait = [side_stream](int index, cudaStream_t waiter) {
    if (side_stream == nullptr) return ATTNGRAD_OK;
    return cudaStreamWaitEvent(waiter, side_stream->event(index), 0) == cudaSuccess
               ? ATTNGRAD_OK
               : ATTNGRAD_CUDA_ERROR;
  };
  auto order = [&mark, &wait](int index, cudaStream_t signaller, cudaStream_t waiter) {
    const attngrad_status status = mark(index, signaller);
    return status == ATTNGRAD_OK ? wait(index, waiter) : status;
  };
  ATTNGRAD_RETURN_IF_ERROR(order(6, caller_stream, stream));  // fork the lane

  auto* base = reinterpret_cast<unsigned char*>(
      RoundUp(reinterpret_cast<std::uintptr_t>(workspace)));
  auto at = [base](std::size_t offset) { return static_cast<void*>(base + offset); };
  auto stage_done = [observer, stream](const char* stage) {
    if (observer) observer->StageDone(stage, stream);
  };

  const int tokens = batch * seq_len;
  const int hidden = config.hidden_size;
  const int q_width = config.q_out();
  const int kv_width = config.kv_out();
  const int qkv_width = q_width + 2 * kv_width;
  const float weight_beta = accumulate ? 1.f : 0.f;
  void* gemm_workspace = at(layout.gemm_workspace);
  void* side_gemm_workspace = at(layout.side_gemm_workspace);
  float* qkv = static_cast<float*>(at(layout.qkv));

  // Operands of the projection GEMMs: fp16 copies in FP16 mode, the caller's fp32 tensors otherwise.
  // FP16 mode: the GEMMs whose results are outputs read alpha = 1/s and beta from here.
  GradientScale* gradient_scale =
      mode.half() ? static_cast<GradientScale*>(at(layout.gradient_scale)) : nullptr;
  auto unscale = [gradient_scale, accumulate](GemmSpec& spec, bool weight_gradient) {
    if (gradient_scale == nullptr) return;
    spec.device_alpha = &gradient_scale->inverse;
    spec.device_beta = weight_gradient && accumulate ? &gradient_scale->one : &gradient_scale->zero;
  };
  const void* x_operand = in.hidden_states;
  const void* grad_y_operand = in.grad_output;
  const void* w_o_operand = in.o_weight;
  const void* w_q_operand = in.q_weight;
  const void* w_k_operand = in.k_weight;
  const void* w_v_operand = in.v_weight;
  if (mode.half()) {
    auto* x_half = static_cast<__half*>(at(layout.x_half));
    auto* grad_y_half = static_cast<__half*>(at(layout.grad_y_half));
    auto* w_qkv_half = static_cast<__half*>(at(layout.w_qkv_half));
    auto* w_o_half = static_cast<__half*>(at(layout.w_o_half));
    const std::size_t activations = static_cast<std::size_t>(tokens) * hidden;
    const std::size_t q_weight = static_cast<std::size_t>(q_width) * hidden;
    const std::size_t kv_weight = static_cast<std::size_t>(kv_width) * hidden;
    // The side stream converts dY and Wo for its grad_attn GEMM while this one converts X and
    // Wq|Wk|Wv for the qkv GEMM. (Converting X and Wq|Wk|Wv first, alone, measured slower at
    // small T on the H200: bench/RESULTS.md run 7.)
    ATTNGRAD_RETURN_IF_ERROR(order(0, stream, side));
    const ConvertSegment side_segments[] = {
        {in.grad_output, grad_y_half, activations, 1.f, gradient_scale},
        {in.o_weight, w_o_half, static_cast<std::size_t>(hidden) * q_width, 1.f},
    };
    ATTNGRAD_RETURN_IF_ERROR(ConvertToHalf(side_segments, 2, side));
    ATTNGRAD_RETURN_IF_ERROR(RescaleToHalf(side_segments[0], side));
    const ConvertSegment main_segments[] = {
        {in.hidden_states, x_half, activations, 1.f},
        {in.q_weight, w_qkv_half, q_weight, 1.f},
        {in.k_weight, w_qkv_half + q_weight, kv_weight, 1.f},
        {in.v_weight, w_qkv_half + q_weight + kv_weight, kv_weight, 1.f},
    };
    ATTNGRAD_RETURN_IF_ERROR(ConvertToHalf(main_segments, 4, stream));
    x_operand = x_half;
    grad_y_operand = grad_y_half;
    w_o_operand = w_o_half;
    w_q_operand = w_qkv_half;
    w_k_operand = w_qkv_half + q_weight;
    w_v_operand = w_qkv_half + q_weight + kv_weight;
    stage_done("convert");
  }
  const std::size_t operand_bytes = mode.half() ? sizeof(__half) : sizeof(float);
  auto offset_operand = [operand_bytes](const void* pointer, std::size_t elements) {
    return static_cast<const void*>(static_cast<const unsigned char*>(pointer) +
                                    elements * operand_bytes);
  };

  if (!mode.half()) {
    ATTNGRAD_RETURN_IF_ERROR(order(0, stream, side));  // fork: the side stream may read the inputs
  }

  // Step 1: qkv[T, qkv_width] = X W^T. Column-major: qkv^T (qkv_width x T) = W (T-op) * X^T.
  // FP16: one product over the contiguous fp16 [Wq;Wk;Wv]; fp32 modes: one per weight, each into
  // its columns of qkv.
  {
    GemmSpec spec;
    spec.transpose_a = true;
    spec.n = tokens;
    spec.k = hidden;
    spec.lda = hidden;
    spec.b = x_operand;
    spec.ldb = hidden;
    spec.ldd = qkv_width;
    spec.arithmetic = mode.gemm;
    if (mode.half()) {
      spec.m = qkv_width;
      spec.a = w_q_operand;
      spec.d = qkv;
      ATTNGRAD_RETURN_IF_ERROR(context->Gemm(spec, gemm_workspace, stream));
    } else {
      const void* weights[3] = {w_q_operand, w_k_operand, w_v_operand};
      const int rows[3] = {q_width, kv_width, kv_width};
      int first_row = 0;
      for (int i = 0; i < 3; ++i) {
        spec.m = rows[i];
        spec.a = weights[i];
        spec.d = qkv + first_row;
        ATTNGRAD_RETURN_IF_ERROR(context->Gemm(spec, gemm_workspace, stream));
        first_row += rows[i];
      }
    }
    stage_done("qkv_gemm");
  }

  // Steps 2-3: q', k' (and v in fp16) as the attention's operands; 1/rms kept.
  HeadLayout heads;
  heads.tokens = tokens;
  heads.num_heads = config.num_heads;
  heads.num_kv_heads = config.num_kv_heads;
  void* attention_operands = at(layout.attention_operands);
  float* inv_rms = static_cast<float*>(at(layout.inv_rms));
  ATTNGRAD_RETURN_IF_ERROR(RmsNormRopeForward(heads, qkv, in.cos, in.sin, in.q_norm_weight,
                                              in.k_norm_weight, scalars.eps, mode.operand,
                                              /*write_v=*/mode.half(), attention_operands,
                                              inv_rms, stream));
  stage_done("rmsnorm_rope");
  const void* q_operand = attention_operands;
  const void* k_operand = offset_operand(attention_operands, q_width);
  // fp32 modes read v straight from the projections (same row stride).
  const void* v_operand = mode.half() ? offset_operand(attention_operands, q_width + kv_width)
                                      : static_cast<const void*>(qkv + q_width + kv_width);

  // Step 5a: dA[T, q_width] = dY Wo. Column-major: dA^T = Wo^T (as stored) * dY^T.
  void* grad_attention = at(layout.grad_attention);
  {
    GemmSpec spec;
    spec.m = q_width;
    spec.n = tokens;
    spec.k = hidden;
    spec.a = w_o_operand;
    spec.lda = q_width;
    spec.b = grad_y_operand;
    spec.ldb = hidden;
    spec.d = grad_attention;
    spec.ldd = q_width;
    spec.arithmetic = mode.gemm;
    spec.d_is_half = mode.half();
    ATTNGRAD_RETURN_IF_ERROR(context->Gemm(spec, side_gemm_workspace, side));
    ATTNGRAD_RETURN_IF_ERROR(mark(2, side));  // dA is ready for the attention backward
    stage_done("grad_attn_gemm");
  }

  // Step 4: A and the log-sum-exp, and the backward's Delta = rowsum(dA * A) from A in registers
  // (so the forward waits for dA; the grad_attn GEMM is the smaller product, done first).
  const AttentionProblem problem = ProblemOf(config, batch, seq_len, scalars, mode);
  // A in fp32 only where the grad_o GEMM reads it (fp32 modes); the FP16 mode's backward takes
  // Delta from the forward and its GEMM reads the fp16 copy.
  float* attention_out = mode.half() ? nullptr : static_cast<float*>(at(layout.attention_out));
  void* attention_out_half = mode.half() ? at(layout.attention_out_half) : nullptr;
  float* lse = static_cast<float*>(at(layout.lse));
  ATTNGRAD_RETURN_IF_ERROR(wait(2, stream));
  FusedDelta fused_delta;
  fused_delta.grad_out = grad_attention;
  fused_delta.ldo = q_width;
  fused_delta.backward_workspace = at(layout.attention_workspace);
  ATTNGRAD_RETURN_IF_ERROR(AttentionForward(problem, q_operand, qkv_width, k_operand, v_operand,
                                            qkv_width, attention_out, attention_out_half, lse,
                                            stream, &fused_delta));
  stage_done("attention_forward");
  ATTNGRAD_RETURN_IF_ERROR(order(1, stream, side));  // A, lse and Delta are ready

  // Step 6, dq' half: on the side stream, beside the dk'/dv half below (independent kernels), then
  // the grad_o GEMM there.
  float* grad_q_rot = static_cast<float*>(at(layout.grad_q_rot));
  float* grad_k_rot = static_cast<float*>(at(layout.grad_k_rot));
  float* grad_v = static_cast<float*>(at(layout.grad_v));
  auto attention_backward = [&](AttentionBackwardPart part, cudaStream_t on) {
    return AttentionBackward(problem, q_operand, qkv_width, k_operand, v_operand, qkv_width,
                             attention_out, grad_attention, q_width, lse, grad_q_rot, grad_k_rot,
                             grad_v, at(layout.attention_workspace),
                             layout.attention_workspace_bytes, on, /*delta_ready=*/true, part);
  };
  ATTNGRAD_RETURN_IF_ERROR(attention_backward(AttentionBackwardPart::kQuery, side));
  ATTNGRAD_RETURN_IF_ERROR(mark(5, side));  // dq' is ready
  stage_done("attention_backward_dq");

  // Step 5b: dWo[hidden, q_width] (+)= dY^T A. Column-major: dWo^T = A^T (as stored) * dY (T-op).
  {
    GemmSpec spec;
    spec.transpose_b = true;
    spec.m = q_width;
    spec.n = hidden;
    spec.k = tokens;
    spec.a = mode.half() ? static_cast<const void*>(attention_out_half) : attention_out;
    spec.lda = q_width;
    spec.b = grad_y_operand;
    spec.ldb = hidden;
    spec.d = out.grad_o_weight;
    spec.ldd = q_width;
    spec.arithmetic = mode.gemm;
    spec.beta = weight_beta;
    unscale(spec, /*weight_gradient=*/true);
    ATTNGRAD_RETURN_IF_ERROR(context->Gemm(spec, side_gemm_workspace, side));
    stage_done("grad_o_gemm");
  }

  // Step 6, dk'/dv half (for short sequences the whole backward, dq' included).
  ATTNGRAD_RETURN_IF_ERROR(attention_backward(AttentionBackwardPart::kKeyValue, stream));
  ATTNGRAD_RETURN_IF_ERROR(wait(5, stream));
  stage_done("attention_backward_dkdv");

  // Steps 7-8: dq, dk, dv side by side as [T, qkv_width]; norm-weight gradients.
  // The norm-weight gradients' final sum runs first on the side stream, beside the grad_x GEMM.
  void* grad_qkv = at(layout.grad_qkv);
  float* partials = static_cast<float*>(at(layout.partials));
  int partial_rows = 0;
  ATTNGRAD_RETURN_IF_ERROR(RopeRmsNormBackward(heads, grad_q_rot, grad_k_rot, grad_v, qkv, inv_rms,
                                               in.cos, in.sin, in.q_norm_weight, in.k_norm_weight,
                                               mode.operand, grad_qkv, partials, &partial_rows,
                                               stream));
  ATTNGRAD_RETURN_IF_ERROR(order(3, stream, side));  // dqkv and the partials are ready
  ATTNGRAD_RETURN_IF_ERROR(NormWeightGradientSum(
      partials, partial_rows, gradient_scale ? &gradient_scale->inverse : nullptr,
      out.grad_q_norm_weight, out.grad_k_norm_weight, accumulate, side));
  stage_done("rope_rmsnorm_backward");

  // Step 9a: dX[T, hidden] = dqkv W. Column-major: dX^T = W^T (as stored) * dqkv^T.
  // FP16: one product with K = qkv_width; fp32 modes: three, added in a fixed order (beta = 1).
  {
    GemmSpec spec;
    spec.m = hidden;
    spec.n = tokens;
    spec.lda = hidden;
    spec.ldb = qkv_width;
    spec.d = out.grad_hidden_states;
    spec.ldd = hidden;
    spec.arithmetic = mode.gemm;
    if (mode.half()) {
      spec.k = qkv_width;
      spec.a = w_q_operand;
      spec.b = grad_qkv;
      unscale(spec, /*weight_gradient=*/false);
      ATTNGRAD_RETURN_IF_ERROR(context->Gemm(spec, gemm_workspace, stream));
    } else {
      const void* weights[3] = {w_q_operand, w_k_operand, w_v_operand};
      const int rows[3] = {q_width, kv_width, kv_width};
      int first_row = 0;
      for (int i = 0; i < 3; ++i) {
        spec.k = rows[i];
        spec.a = weights[i];
        spec.b = offset_operand(grad_qkv, first_row);
        spec.beta = i == 0 ? 0.f : 1.f;
        ATTNGRAD_RETURN_IF_ERROR(context->Gemm(spec, gemm_workspace, stream));
        first_row += rows[i];
      }
    }
    stage_done("grad_x_gemm");
  }

  // Step 9b: dW[rows, hidden] (+)= dqkv[:, rows]^T X. Column-major: dW^T = X^T (as stored) *
  // dqkv[:, rows] (T-op); one product per weight (separate outputs). dWq and dWk on the side stream
  // next to the grad_x GEMM, dWv after it on the caller's stream: at small T all four are bound by
  // memory (grad_x reads the 31.5 MB of fp16 weights, the dW write 63 MB of fp32), and this split
  // gives the two streams ~44 and ~50 MB.
  {
    float* outputs[3] = {out.grad_q_weight, out.grad_k_weight, out.grad_v_weight};
    const int rows[3] = {q_width, kv_width, kv_width};
    int first_row = 0;
    for (int i = 0; i < 3; ++i) {
      GemmSpec spec;
      spec.transpose_b = true;
      spec.m = hidden;
      spec.n = rows[i];
      spec.k = tokens;
      spec.a = x_operand;
      spec.lda = hidden;
      spec.b = offset_operand(grad_qkv, first_row);
      spec.ldb = qkv_width;
      spec.d = outputs[i];
      spec.ldd = hidden;
      spec.arithmetic = mode.gemm;
      spec.beta = weight_beta;
      unscale(spec, /*weight_gradient=*/true);
      ATTNGRAD_RETURN_IF_ERROR(i < 2 ? context->Gemm(spec, side_gemm_workspace, side)
                                     : context->Gemm(spec, gemm_workspace, stream));
      first_row += rows[i];
    }
    stage_done("grad_w_qkv_gemm");
  }
  // Join: the call ends on the caller's stream when both streams are done.
  ATTNGRAD_RETURN_IF_ERROR(order(4, side, stream));
  return order(7, stream, caller_stream);
}

}  // namespace cuda

std::size_t DeviceWorkspaceSize(const LayerConfig& config, int batch, int seq_len,
                                Precision precision) {
  if (!IsValidPrecision(static_cast<int>(precision)) || !cuda::Supported(config) || batch < 1 ||
      seq_len < 1 || static_cast<long long>(batch) * seq_len > kMaxTokens) {
    return 0;
  }
  const cuda::ModeChoice mode = cuda::ChoiceOf(cuda::ResolvePrecision(precision, batch, seq_len));
  return cuda::WorkspaceLayout(config, batch, seq_len, mode).total;
}

namespace cuda {
namespace {

// Every argument of a call, for the graph cache (pipeline_graph.h).
PipelineKey KeyOf(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                  Precision precision, bool accumulate, const BackwardInputs& in,
                  const BackwardOutputs& out, const void* workspace, std::size_t workspace_size) {
  auto word = [](const void* pointer) {
    return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(pointer));
  };
  auto bits = [](float value) {
    std::uint32_t raw = 0;
    static_assert(sizeof raw == sizeof value);
    std::memcpy(&raw, &value, sizeof raw);
    return static_cast<std::uint64_t>(raw);
  };
  const PipelineKey key = {
      word(in.grad_output), word(in.hidden_states), word(in.cos), word(in.sin),
      word(in.q_weight), word(in.k_weight), word(in.v_weight), word(in.o_weight),
      word(in.q_norm_weight), word(in.k_norm_weight), word(out.grad_hidden_states),
      word(out.grad_q_weight), word(out.grad_k_weight), word(out.grad_v_weight),
      word(out.grad_o_weight), word(out.grad_q_norm_weight), word(out.grad_k_norm_weight),
      word(workspace), static_cast<std::uint64_t>(workspace_size),
      static_cast<std::uint64_t>(batch), static_cast<std::uint64_t>(seq_len),
      static_cast<std::uint64_t>(precision), accumulate ? 1u : 0u, bits(scalars.scaling),
      bits(scalars.softcap), bits(scalars.eps), static_cast<std::uint64_t>(config.hidden_size),
      static_cast<std::uint64_t>(config.num_heads), static_cast<std::uint64_t>(config.num_kv_heads),
      static_cast<std::uint64_t>(config.head_dim), 0, 0};
  return key;
}

}  // namespace
}  // namespace cuda

attngrad_status BackwardDevice(const LayerConfig& config, int batch, int seq_len,
                               const Scalars& scalars, Precision precision, bool accumulate,
                               const BackwardInputs& in, const BackwardOutputs& out,
                               void* workspace, std::size_t workspace_size, void* stream) {
  const auto caller_stream = static_cast<cudaStream_t>(stream);
  auto enqueue = [&](cudaStream_t on, cuda::SideStream* side) {
    return cuda::RunBackwardPipeline(config, batch, seq_len, scalars, precision, accumulate, in, out,
                                     workspace, workspace_size, on, /*observer=*/nullptr, side);
  };
  // A caller capturing its stream gets the kernels in its own graph.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(caller_stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    return enqueue(caller_stream, nullptr);
  }
  if (capture != cudaStreamCaptureStatusNone) return enqueue(caller_stream, nullptr);
  int device = 0;
  cuda::DeviceContext* context = nullptr;
  if (cudaGetDevice(&device) != cudaSuccess) return ATTNGRAD_CUDA_ERROR;
  const attngrad_status got = cuda::DeviceContextRegistry::Instance().Get(device, &context);
  if (got != ATTNGRAD_OK) return got;
  return context->pipeline_graphs().Run(
      cuda::KeyOf(config, batch, seq_len, scalars, precision, accumulate, in, out, workspace,
                  workspace_size),
      enqueue, caller_stream, context);
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error so that later calls do not see it
    return 0;
  }
  return count;
}

}  // namespace attngrad
