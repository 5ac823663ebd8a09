// Stage: the whole GPU backward of SPEC section 2 — the pipeline that strings the stages together
// on the caller's stream with memory carved from the caller's workspace (no allocation, no host
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
// and the attngrad::BackwardDevice / DeviceWorkspaceSize / DeviceCount entry points of backward.h,
// with the overloads of prepared_weights.h: there the FP16 mode reads the projection weights' fp16
// copies a PreparedWeights holds and converts only X and dY (the same values, so the same bits).
//
// The forward entry points of forward.h (ForwardDevice / ForwardWorkspaceSize, both overloads) run
// the same forward stages in the same arithmetic per mode, all on the caller's stream, then one
// more product:
//   convert (FP16 mode)  X, Wq|Wk|Wv, Wo -> fp16 operands (none of the weights when prepared)
//   qkv GEMM, rmsnorm_rope, attention_forward (without Delta)       (steps 1-4)
//   o_proj GEMM          Y = A Wo^T                                  (the layer output)
// with a workspace of the forward's tensors only (Pass::kForward).
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
// With a StageObserver (per-stage timing) everything runs on the caller's stream, in that order,
// unless the observer asks for the overlapped streams (a timeline of the real schedule).
//
// How it is written: a PipelinePlan (widths, attention problem, workspace layout) is computed once
// per call from the configuration, shape and mode; PipelineBuffers are the plan's tensors in the
// caller's workspace; then one function per stage above enqueues its kernels, and the streams meet
// at the named ForkJoinEvents (projection_gemm.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "attngrad/backward.h"
#include "attngrad/forward.h"
#include "attngrad/prepared_weights.h"
#include "cuda/attention.h"
#include "cuda/device_context.h"
#include "cuda/pipeline.h"
#include "cuda/projection_gemm.h"
#include "cuda/stages.h"
#include "validate.h"

namespace attngrad {
namespace cuda {
namespace {

constexpr std::size_t kAlignment = 256;

std::size_t RoundUp(std::size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

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
    default: return {GemmArithmetic::kFp32, OperandType::kFloat, AttentionOperand::kFp32};
  }
}

AttentionProblem ProblemOf(const LayerConfig& config, int batch, int seq_len,
                           const Scalars& scalars, const ModeChoice& mode) {
  AttentionProblem problem;
  problem.batch = batch;
  problem.seq_len = seq_len;
  problem.num_heads = config.num_heads;
  problem.num_kv_heads = config.num_kv_heads;
  problem.head_dim = config.head_dim;
  problem.scaling = scalars.scaling;
  problem.softcap = scalars.capped() ? scalars.softcap : 0.f;  // 0: no soft-cap
  problem.sliding_window = scalars.sliding_window;             // 0: full causal
  problem.operand = mode.attention;
  return problem;
}

// Which entry point a plan serves: the forward (A Wo^T) or the backward, which needs the forward's
// tensors and its own.
enum class Pass { kForward, kBackward };

// Byte offsets (from the 256-aligned start of the workspace) of every intermediate tensor.
// Tensors a mode or a pass does not use get zero bytes (and offset 0: never read nor written).
struct WorkspaceLayout {
  std::size_t x_half = 0, grad_y_half = 0, w_qkv_half = 0, w_o_half = 0, gradient_scale = 0;
  std::size_t qkv = 0, attention_operands = 0, inv_rms = 0;
  std::size_t attention_out = 0, attention_out_half = 0, lse = 0;
  std::size_t grad_attention = 0, grad_q_rot = 0, grad_k_rot = 0, grad_v = 0;
  std::size_t grad_qkv = 0, partials = 0, attention_workspace = 0;
  std::size_t gemm_workspace = 0, side_gemm_workspace = 0;  // one per stream
  std::size_t attention_workspace_bytes = 0;
  std::size_t total = 0;  // including the slack to align the start

  // weights_prepared: the fp16 weights come from a PreparedWeights (no room for them here).
  WorkspaceLayout(const LayerConfig& config, int batch, int seq_len, const ModeChoice& mode,
                  bool weights_prepared, Pass pass) {
    const bool backward = pass == Pass::kBackward;
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
      if (backward) grad_y_half = carve(tokens * hidden * sizeof(__half));
      if (!weights_prepared) {
        w_qkv_half = carve(qkv_width * hidden * sizeof(__half));
        w_o_half = carve(hidden * q_width * sizeof(__half));
      }
      attention_out_half = carve(tokens * q_width * sizeof(__half));
      if (backward) gradient_scale = carve(sizeof(GradientScale));
    }
    qkv = carve(tokens * qkv_width * sizeof(float));
    attention_operands = carve(tokens * qkv_width * operand_bytes);
    inv_rms = carve(tokens * (config.num_heads + config.num_kv_heads) * sizeof(float));
    if (!mode.half()) attention_out = carve(tokens * q_width * sizeof(float));  // FP16: fp16 A only
    lse = carve(tokens * config.num_heads * sizeof(float));
    if (backward) {
      grad_attention = carve(tokens * q_width * operand_bytes);
      grad_q_rot = carve(tokens * q_width * sizeof(float));
      grad_k_rot = carve(tokens * kv_width * sizeof(float));
      grad_v = carve(tokens * kv_width * sizeof(float));
      grad_qkv = carve(tokens * qkv_width * operand_bytes);
      partials = carve(RopeRmsNormBackwardPartialsBytes(static_cast<int>(tokens), config.head_dim));
      attention_workspace_bytes =
          AttentionBackwardWorkspaceSize(ProblemOf(config, batch, seq_len, Scalars{}, mode));
      attention_workspace = carve(attention_workspace_bytes);
    }
    gemm_workspace = carve(kGemmWorkspaceBytes);
    if (backward) side_gemm_workspace = carve(kGemmWorkspaceBytes);  // the forward has one stream
    total = cursor + kAlignment;
  }
};

// The three projections in the order of a qkv row (q heads, then k, then v).
constexpr Weight kQkvWeights[3] = {Weight::kQProj, Weight::kKProj, Weight::kVProj};

// Everything a call's configuration, shape, scalars and mode decide, computed once per call before
// anything is enqueued: the widths of the products, the attention problem, the head layout of the
// element-wise stages and the workspace layout.
struct PipelinePlan {
  Pass pass;
  ModeChoice mode;
  int tokens, hidden, q_width, kv_width, qkv_width;
  int qkv_rows[3];            // rows of Wq, Wk, Wv: their widths in a qkv row
  int qkv_first_row[3];       // where each starts in a qkv row
  std::size_t operand_bytes;  // of the GEMM and attention operands: 2 in FP16 mode, else 4
  AttentionProblem attention;
  HeadLayout heads;
  WorkspaceLayout layout;

  PipelinePlan(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
               const ModeChoice& choice, bool weights_prepared, Pass which)
      : pass(which),
        mode(choice),
        tokens(batch * seq_len),
        hidden(config.hidden_size),
        q_width(config.q_out()),
        kv_width(config.kv_out()),
        qkv_width(config.q_out() + 2 * config.kv_out()),
        qkv_rows{q_width, kv_width, kv_width},
        qkv_first_row{0, q_width, q_width + kv_width},
        operand_bytes(choice.half() ? sizeof(__half) : sizeof(float)),
        attention(ProblemOf(config, batch, seq_len, scalars, choice)),
        layout(config, batch, seq_len, choice, weights_prepared, which) {
    heads.tokens = tokens;
    heads.num_heads = config.num_heads;
    heads.num_kv_heads = config.num_kv_heads;
    heads.head_dim = config.head_dim;
  }
};

// The tensors of one call: the intermediate ones carved from the caller's workspace at the plan's
// offsets, and the operands the products read (fp16 copies in FP16 mode, the caller's fp32
// tensors otherwise). A forward call sets only those of steps 1-4.
struct PipelineBuffers {
  // FP16 mode only (null otherwise).
  __half* x_half = nullptr;
  __half* grad_y_half = nullptr;
  __half* w_qkv_half = nullptr;  // [Wq; Wk; Wv], contiguous (null: prepared, not converted here)
  __half* w_o_half = nullptr;    // (null: prepared)
  GradientScale* gradient_scale = nullptr;  // dY's power of two; the output GEMMs' alpha and beta
  // The projection GEMMs' operands.
  const void* x = nullptr;
  const void* grad_y = nullptr;
  const void* w_o = nullptr;
  const void* w_qkv[3] = {};  // Wq, Wk, Wv (FP16: consecutive parts of w_qkv_half)
  // Steps 1-4.
  float* qkv = nullptr;                // fp32 projections [T, qkv_width]
  void* attention_operands = nullptr;  // q', k' (and v in FP16 mode) [T, qkv_width]
  const void* q = nullptr;             // the attention's operands, row stride qkv_width
  const void* k = nullptr;
  const void* v = nullptr;  // fp32 modes: straight from qkv
  float* inv_rms = nullptr;
  float* attention_out = nullptr;      // A in fp32 (fp32 modes only)
  void* attention_out_half = nullptr;  // A in fp16 (FP16 mode only)
  float* lse = nullptr;
  void* gemm_workspace = nullptr;  // cuBLASLt's, for the lane's GEMMs (every call's)
  // Steps 5-9 (the backward only; null in a forward call).
  void* grad_attention = nullptr;       // dA [T, q_width]
  void* attention_workspace = nullptr;  // Delta (written by the forward) and dK/dV partials
  float* grad_q_rot = nullptr;
  float* grad_k_rot = nullptr;
  float* grad_v = nullptr;
  void* grad_qkv = nullptr;             // dq, dk, dv [T, qkv_width]
  float* partials = nullptr;            // the norm-weight gradients' per-block sums
  void* side_gemm_workspace = nullptr;  // cuBLASLt's, for the side stream's GEMMs

  // `grad_output`: dY (the backward), or null (the forward: no backward tensor is set). `prepared`:
  // the fp16 weights to read in FP16 mode (null: converted into the workspace).
  PipelineBuffers(const PipelinePlan& plan, const ForwardInputs& in, const float* grad_output,
                  void* workspace, const PreparedWeights* prepared) {
    auto* base =
        reinterpret_cast<unsigned char*>(RoundUp(reinterpret_cast<std::uintptr_t>(workspace)));
    auto at = [base](std::size_t offset) { return static_cast<void*>(base + offset); };
    const WorkspaceLayout& layout = plan.layout;
    x = in.hidden_states;
    w_o = in.weights[Weight::kOProj];
    for (int i = 0; i < 3; ++i) w_qkv[i] = in.weights[kQkvWeights[i]];
    if (plan.mode.half()) {
      x_half = static_cast<__half*>(at(layout.x_half));
      x = x_half;
      const __half* qkv_weights = nullptr;
      if (prepared != nullptr) {
        qkv_weights = static_cast<const __half*>(prepared->half_qkv());
        w_o = prepared->half_o();
      } else {
        w_qkv_half = static_cast<__half*>(at(layout.w_qkv_half));
        w_o_half = static_cast<__half*>(at(layout.w_o_half));
        qkv_weights = w_qkv_half;
        w_o = w_o_half;
      }
      for (int i = 0; i < 3; ++i) {
        w_qkv[i] = qkv_weights + static_cast<std::size_t>(plan.qkv_first_row[i]) * plan.hidden;
      }
      attention_out_half = at(layout.attention_out_half);
    } else {
      attention_out = static_cast<float*>(at(layout.attention_out));
    }
    qkv = static_cast<float*>(at(layout.qkv));
    attention_operands = at(layout.attention_operands);
    q = attention_operands;
    k = Offset(plan, attention_operands, plan.q_width);
    v = plan.mode.half() ? Offset(plan, attention_operands, plan.q_width + plan.kv_width)
                         : static_cast<const void*>(qkv + plan.q_width + plan.kv_width);
    inv_rms = static_cast<float*>(at(layout.inv_rms));
    lse = static_cast<float*>(at(layout.lse));
    gemm_workspace = at(layout.gemm_workspace);
    if (plan.pass == Pass::kBackward) SetBackwardTensors(plan, grad_output, base);
  }

  // The tensors of steps 5-9 (the backward's own).
  void SetBackwardTensors(const PipelinePlan& plan, const float* grad_output, unsigned char* base) {
    auto at = [base](std::size_t offset) { return static_cast<void*>(base + offset); };
    const WorkspaceLayout& layout = plan.layout;
    grad_y = grad_output;
    if (plan.mode.half()) {
      grad_y_half = static_cast<__half*>(at(layout.grad_y_half));
      gradient_scale = static_cast<GradientScale*>(at(layout.gradient_scale));
      grad_y = grad_y_half;
    }
    grad_attention = at(layout.grad_attention);
    attention_workspace = at(layout.attention_workspace);
    grad_q_rot = static_cast<float*>(at(layout.grad_q_rot));
    grad_k_rot = static_cast<float*>(at(layout.grad_k_rot));
    grad_v = static_cast<float*>(at(layout.grad_v));
    grad_qkv = at(layout.grad_qkv);
    partials = static_cast<float*>(at(layout.partials));
    side_gemm_workspace = at(layout.side_gemm_workspace);
  }

  // `elements` operands past `pointer` (operands are the plan's operand_bytes wide).
  static const void* Offset(const PipelinePlan& plan, const void* pointer, std::size_t elements) {
    return static_cast<const unsigned char*>(pointer) + elements * plan.operand_bytes;
  }
};

// A failed step of the pipeline as a Status naming it (`what` is a static string).
Status StepStatus(attngrad_status code, const char* what) {
  return code == ATTNGRAD_OK ? Status{} : Status{code, what};
}

#define ATTNGRAD_RETURN_IF_ERROR(expression) \
  do {                                       \
    const Status status_ = (expression);     \
    if (!status_.ok()) return status_;       \
  } while (0)

// One call being enqueued: its plan, buffers and arguments, the streams it runs on and the
// events that order them. `lane` carries the critical path and `side` the work beside it; with a
// serialising StageObserver, and in a forward call, both are the caller's stream and the events are
// not used.
struct PipelineCall {
  const PipelinePlan& plan;
  const PipelineBuffers& buffers;
  const Scalars& scalars;
  bool accumulate;
  const ForwardInputs& in;
  const float* grad_output;    // null in a forward call
  const BackwardOutputs& out;  // all null in a forward call
  DeviceContext* context;
  SideStream* streams;  // null: everything on the caller's stream
  cudaStream_t caller, lane, side;
  StageObserver* observer;

  // `signaller` records `event` (what is enqueued on it so far); `waiter` waits for it.
  Status Signal(ForkJoinEvent event, cudaStream_t signaller) const {
    if (streams == nullptr) return {};
    return StepStatus(cudaEventRecord(streams->event(event), signaller) == cudaSuccess
                          ? ATTNGRAD_OK
                          : ATTNGRAD_CUDA_ERROR,
                      "cudaEventRecord of a fork/join event failed");
  }
  Status Wait(ForkJoinEvent event, cudaStream_t waiter) const {
    if (streams == nullptr) return {};
    return StepStatus(cudaStreamWaitEvent(waiter, streams->event(event), 0) == cudaSuccess
                          ? ATTNGRAD_OK
                          : ATTNGRAD_CUDA_ERROR,
                      "cudaStreamWaitEvent on a fork/join event failed");
  }
  Status Order(ForkJoinEvent event, cudaStream_t signaller, cudaStream_t waiter) const {
    ATTNGRAD_RETURN_IF_ERROR(Signal(event, signaller));
    return Wait(event, waiter);
  }
  // Tells the observer that `stage` is enqueued; `on` is the stream its last kernel ran on (the
  // caller's stream for a serialising observer).
  void StageDone(const char* stage, cudaStream_t on) const {
    if (observer != nullptr) observer->StageDone(stage, on);
  }
  // A GEMM on the lane or on the side stream, each with its own cuBLASLt workspace.
  Status LaneGemm(const GemmSpec& spec, const char* what) const {
    return StepStatus(context->Gemm(spec, buffers.gemm_workspace, lane), what);
  }
  Status SideGemm(const GemmSpec& spec, const char* what) const {
    return StepStatus(context->Gemm(spec, buffers.side_gemm_workspace, side), what);
  }
  // FP16 mode: the GEMMs whose results are outputs read alpha = 1/s (and beta) from the device.
  void Unscale(GemmSpec& spec, bool weight_gradient) const {
    GradientScale* scale = buffers.gradient_scale;
    if (scale == nullptr) return;
    spec.device_alpha = &scale->inverse;
    spec.device_beta = weight_gradient && accumulate ? &scale->one : &scale->zero;
  }
};

// ---- One function per stage of SPEC section 2, in the order they are enqueued
// ---------------------

// FP16 mode, the segments of the lane's conversion: X and, unless the weights are prepared,
// Wq|Wk|Wv and, with `with_output_weight` (the forward, which has no side stream), Wo. Returns
// their count (at most 5).
int HiddenAndWeightSegments(const PipelineCall& call, bool with_output_weight,
                            ConvertSegment* segments) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  const std::size_t activations = static_cast<std::size_t>(plan.tokens) * plan.hidden;
  int count = 0;
  segments[count++] = {call.in.hidden_states, buffers.x_half, activations, 1.f};
  if (buffers.w_qkv_half == nullptr) return count;  // prepared
  for (int i = 0; i < 3; ++i) {
    segments[count++] = {
        call.in.weights[kQkvWeights[i]],
        buffers.w_qkv_half + static_cast<std::size_t>(plan.qkv_first_row[i]) * plan.hidden,
        static_cast<std::size_t>(plan.qkv_rows[i]) * plan.hidden, 1.f};
  }
  if (with_output_weight) {
    segments[count++] = {call.in.weights[Weight::kOProj], buffers.w_o_half,
                         static_cast<std::size_t>(plan.hidden) * plan.q_width, 1.f};
  }
  return count;
}

// FP16 mode: X, dY (with its power of two s), Wq|Wk|Wv and Wo -> fp16 operands. The side stream
// converts dY and Wo for its grad_attn GEMM while the lane converts X and Wq|Wk|Wv for the qkv
// GEMM. (Converting X and Wq|Wk|Wv first, alone, measured 6-14 us slower at small T on the
// H200.) With prepared weights only X and dY (the weights' segments are left
// out; every element is converted alone, so the rest are the same values).
Status ConvertOperands(const PipelineCall& call) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  const std::size_t activations = static_cast<std::size_t>(plan.tokens) * plan.hidden;
  const bool convert_weights = buffers.w_qkv_half != nullptr;
  const ConvertSegment side_segments[] = {
      {call.grad_output, buffers.grad_y_half, activations, 1.f, buffers.gradient_scale},
      {call.in.weights[Weight::kOProj], buffers.w_o_half,
       static_cast<std::size_t>(plan.hidden) * plan.q_width, 1.f},
  };
  ATTNGRAD_RETURN_IF_ERROR(
      StepStatus(ConvertToHalf(side_segments, convert_weights ? 2 : 1, call.side),
                 "conversion of grad_output and o_proj to fp16 failed"));
  ATTNGRAD_RETURN_IF_ERROR(StepStatus(RescaleToHalf(side_segments[0], call.side),
                                      "rescale of grad_output to fp16 failed"));
  call.StageDone("convert_side", call.side);
  ConvertSegment lane_segments[5];
  const int lane_count = HiddenAndWeightSegments(call, /*with_output_weight=*/false, lane_segments);
  ATTNGRAD_RETURN_IF_ERROR(StepStatus(ConvertToHalf(lane_segments, lane_count, call.lane),
                                      "conversion of hidden_states and q/k/v_proj to fp16 failed"));
  call.StageDone("convert", call.lane);
  return {};
}

// FP16 mode of the forward: X and (unless prepared) the four projection weights -> fp16 operands,
// in one launch on the caller's stream (the same values as the backward's conversion).
Status ConvertForwardOperands(const PipelineCall& call) {
  ConvertSegment segments[5];
  const int count = HiddenAndWeightSegments(call, /*with_output_weight=*/true, segments);
  ATTNGRAD_RETURN_IF_ERROR(
      StepStatus(ConvertToHalf(segments, count, call.lane),
                 "conversion of hidden_states and the projection weights to fp16 failed"));
  call.StageDone("convert", call.lane);
  return {};
}

// Step 1: qkv[T, qkv_width] = X W^T. Column-major: qkv^T (qkv_width x T) = W (T-op) * X^T.
// FP16: one product over the contiguous fp16 [Wq;Wk;Wv]; fp32 modes: one per weight, each into
// its columns of qkv.
Status ProjectQkv(const PipelineCall& call) {
  const PipelinePlan& plan = call.plan;
  GemmSpec spec;
  spec.transpose_a = true;
  spec.n = plan.tokens;
  spec.k = plan.hidden;
  spec.lda = plan.hidden;
  spec.b = call.buffers.x;
  spec.ldb = plan.hidden;
  spec.ldd = plan.qkv_width;
  spec.arithmetic = plan.mode.gemm;
  const int products = plan.mode.half() ? 1 : 3;
  for (int i = 0; i < products; ++i) {
    spec.m = plan.mode.half() ? plan.qkv_width : plan.qkv_rows[i];
    spec.a = call.buffers.w_qkv[i];
    spec.d = call.buffers.qkv + plan.qkv_first_row[i];
    ATTNGRAD_RETURN_IF_ERROR(call.LaneGemm(spec, "qkv GEMM (X W^T) failed"));
  }
  call.StageDone("qkv_gemm", call.lane);
  return {};
}

// Steps 2-3: q', k' (and v in fp16) as the attention's operands; 1/rms kept.
Status NormalizeAndRotate(const PipelineCall& call) {
  const PipelineBuffers& buffers = call.buffers;
  ATTNGRAD_RETURN_IF_ERROR(
      StepStatus(RmsNormRopeForward(call.plan.heads, buffers.qkv, call.in.cos, call.in.sin,
                                    call.in.weights[Weight::kQNorm],
                                    call.in.weights[Weight::kKNorm], call.scalars.eps,
                                    call.plan.mode.operand, /*write_v=*/call.plan.mode.half(),
                                    buffers.attention_operands, buffers.inv_rms, call.lane),
                 "rmsnorm_rope (RMSNorm and RoPE forward) failed"));
  call.StageDone("rmsnorm_rope", call.lane);
  return {};
}

// Step 5a, on the side stream: dA[T, q_width] = dY Wo. Column-major: dA^T = Wo^T (as stored) *
// dY^T.
Status GradAttentionGemm(const PipelineCall& call) {
  const PipelinePlan& plan = call.plan;
  GemmSpec spec;
  spec.m = plan.q_width;
  spec.n = plan.tokens;
  spec.k = plan.hidden;
  spec.a = call.buffers.w_o;
  spec.lda = plan.q_width;
  spec.b = call.buffers.grad_y;
  spec.ldb = plan.hidden;
  spec.d = call.buffers.grad_attention;
  spec.ldd = plan.q_width;
  spec.arithmetic = plan.mode.gemm;
  spec.d_is_half = plan.mode.half();
  ATTNGRAD_RETURN_IF_ERROR(call.SideGemm(spec, "grad_attn GEMM (dY Wo) failed"));
  ATTNGRAD_RETURN_IF_ERROR(call.Signal(ForkJoinEvent::kGradAttentionReady, call.side));
  call.StageDone("grad_attn_gemm", call.side);
  return {};
}

// Step 4 on the lane: A and the log-sum-exp; with `fused_delta` (the backward), also Delta. A in
// fp32 only where a GEMM reads it in fp32 (fp32 modes); in FP16 mode the GEMMs read the fp16 copy.
Status AttentionForwardOnLane(const PipelineCall& call, const FusedDelta* fused_delta) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  ATTNGRAD_RETURN_IF_ERROR(
      StepStatus(AttentionForward(plan.attention, buffers.q, plan.qkv_width, buffers.k, buffers.v,
                                  plan.qkv_width, buffers.attention_out, buffers.attention_out_half,
                                  buffers.lse, call.lane, fused_delta),
                 "attention forward failed"));
  call.StageDone("attention_forward", call.lane);
  return {};
}

// Step 4 of the backward: A and the log-sum-exp, and the backward's Delta = rowsum(dA * A) from A
// in registers (so the forward waits for dA; the grad_attn GEMM is the smaller product, done
// first). The FP16 mode's backward takes Delta from the forward.
Status AttentionForwardStage(const PipelineCall& call) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  ATTNGRAD_RETURN_IF_ERROR(call.Wait(ForkJoinEvent::kGradAttentionReady, call.lane));
  FusedDelta fused_delta;
  fused_delta.grad_out = buffers.grad_attention;
  fused_delta.ldo = plan.q_width;
  fused_delta.backward_workspace = buffers.attention_workspace;
  ATTNGRAD_RETURN_IF_ERROR(AttentionForwardOnLane(call, &fused_delta));
  return call.Order(ForkJoinEvent::kAttentionForwardDone, call.lane, call.side);
}

// The forward's layer output Y[T, hidden] = A Wo^T on the lane. Column-major: Y^T = Wo (T-op) *
// A^T; A and Wo in fp16 in FP16 mode (as the grad_o and grad_attn GEMMs read them), else fp32.
Status OutputProjectionGemm(const PipelineCall& call, float* output) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  GemmSpec spec;
  spec.transpose_a = true;
  spec.m = plan.hidden;
  spec.n = plan.tokens;
  spec.k = plan.q_width;
  spec.a = buffers.w_o;
  spec.lda = plan.q_width;
  spec.b = plan.mode.half() ? static_cast<const void*>(buffers.attention_out_half)
                            : buffers.attention_out;
  spec.ldb = plan.q_width;
  spec.d = output;
  spec.ldd = plan.hidden;
  spec.arithmetic = plan.mode.gemm;
  ATTNGRAD_RETURN_IF_ERROR(call.LaneGemm(spec, "o_proj GEMM (A Wo^T) failed"));
  call.StageDone("o_proj_gemm", call.lane);
  return {};
}

// Step 6, one of its two independent halves (AttentionBackwardPart) on `stream`.
attngrad_status AttentionBackwardPartOn(const PipelineCall& call, AttentionBackwardPart part,
                                        cudaStream_t stream) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  return AttentionBackward(
      plan.attention, buffers.q, plan.qkv_width, buffers.k, buffers.v, plan.qkv_width,
      buffers.attention_out, buffers.grad_attention, plan.q_width, buffers.lse, buffers.grad_q_rot,
      buffers.grad_k_rot, buffers.grad_v, buffers.attention_workspace,
      plan.layout.attention_workspace_bytes, stream, /*delta_ready=*/true, part);
}

// Step 6, dq' half: on the side stream, beside the dk'/dv half (independent kernels).
Status AttentionBackwardQuery(const PipelineCall& call) {
  ATTNGRAD_RETURN_IF_ERROR(
      StepStatus(AttentionBackwardPartOn(call, AttentionBackwardPart::kQuery, call.side),
                 "attention backward (dq half) failed"));
  ATTNGRAD_RETURN_IF_ERROR(call.Signal(ForkJoinEvent::kGradQueryReady, call.side));
  call.StageDone("attention_backward_dq", call.side);
  return {};
}

// Step 5b, on the side stream after the dq' half: dWo[hidden, q_width] (+)= dY^T A.
// Column-major: dWo^T = A^T (as stored) * dY (T-op).
Status GradOutputWeightGemm(const PipelineCall& call) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  GemmSpec spec;
  spec.transpose_b = true;
  spec.m = plan.q_width;
  spec.n = plan.hidden;
  spec.k = plan.tokens;
  spec.a = plan.mode.half() ? static_cast<const void*>(buffers.attention_out_half)
                            : buffers.attention_out;
  spec.lda = plan.q_width;
  spec.b = buffers.grad_y;
  spec.ldb = plan.hidden;
  spec.d = call.out.weight_gradients[Weight::kOProj];
  spec.ldd = plan.q_width;
  spec.arithmetic = plan.mode.gemm;
  spec.beta = call.accumulate ? 1.f : 0.f;
  call.Unscale(spec, /*weight_gradient=*/true);
  ATTNGRAD_RETURN_IF_ERROR(call.SideGemm(spec, "grad_o GEMM (dY^T A) failed"));
  call.StageDone("grad_o_gemm", call.side);
  return {};
}

// Step 6, dk'/dv half on the lane (for short sequences the whole backward, dq' included); then the
// lane waits for the dq' half.
Status AttentionBackwardKeyValue(const PipelineCall& call) {
  ATTNGRAD_RETURN_IF_ERROR(
      StepStatus(AttentionBackwardPartOn(call, AttentionBackwardPart::kKeyValue, call.lane),
                 "attention backward (dk/dv half) failed"));
  ATTNGRAD_RETURN_IF_ERROR(call.Wait(ForkJoinEvent::kGradQueryReady, call.lane));
  call.StageDone("attention_backward_dkdv", call.lane);
  return {};
}

// Steps 7-8: dq, dk, dv side by side as [T, qkv_width] and the norm-weight gradients' per-block
// partial sums on the lane; their final sum first on the side stream, beside the grad_x GEMM.
Status RopeRmsNormBackwardStage(const PipelineCall& call) {
  const PipelineBuffers& buffers = call.buffers;
  int partial_rows = 0;
  ATTNGRAD_RETURN_IF_ERROR(
      StepStatus(RopeRmsNormBackward(call.plan.heads, buffers.grad_q_rot, buffers.grad_k_rot,
                                     buffers.grad_v, buffers.qkv, buffers.inv_rms, call.in.cos,
                                     call.in.sin, call.in.weights[Weight::kQNorm],
                                     call.in.weights[Weight::kKNorm], call.plan.mode.operand,
                                     buffers.grad_qkv, buffers.partials, &partial_rows, call.lane),
                 "rope_rmsnorm_backward failed"));
  call.StageDone("rope_rmsnorm_backward", call.lane);
  ATTNGRAD_RETURN_IF_ERROR(call.Order(ForkJoinEvent::kGradQkvReady, call.lane, call.side));
  GradientScale* scale = buffers.gradient_scale;
  ATTNGRAD_RETURN_IF_ERROR(StepStatus(
      NormWeightGradientSum(call.plan.heads.head_dim, buffers.partials, partial_rows,
                            scale != nullptr ? &scale->inverse : nullptr,
                            call.out.weight_gradients[Weight::kQNorm],
                            call.out.weight_gradients[Weight::kKNorm], call.accumulate, call.side),
      "norm-weight gradients' final sum failed"));
  call.StageDone("norm_weight_sum", call.side);
  return {};
}

// Step 9a: dX[T, hidden] = dqkv W. Column-major: dX^T = W^T (as stored) * dqkv^T.
// FP16: one product with K = qkv_width; fp32 modes: three, added in a fixed order (beta = 1).
Status GradHiddenGemm(const PipelineCall& call) {
  const PipelinePlan& plan = call.plan;
  const PipelineBuffers& buffers = call.buffers;
  GemmSpec spec;
  spec.m = plan.hidden;
  spec.n = plan.tokens;
  spec.lda = plan.hidden;
  spec.ldb = plan.qkv_width;
  spec.d = call.out.grad_hidden_states;
  spec.ldd = plan.hidden;
  spec.arithmetic = plan.mode.gemm;
  call.Unscale(spec, /*weight_gradient=*/false);
  const int products = plan.mode.half() ? 1 : 3;
  for (int i = 0; i < products; ++i) {
    spec.k = plan.mode.half() ? plan.qkv_width : plan.qkv_rows[i];
    spec.a = buffers.w_qkv[i];
    spec.b = PipelineBuffers::Offset(plan, buffers.grad_qkv, plan.qkv_first_row[i]);
    spec.beta = i == 0 ? 0.f : 1.f;
    ATTNGRAD_RETURN_IF_ERROR(call.LaneGemm(spec, "grad_x GEMM (dqkv W) failed"));
  }
  call.StageDone("grad_x_gemm", call.lane);
  return {};
}

// Step 9b: dW[rows, hidden] (+)= dqkv[:, rows]^T X. Column-major: dW^T = X^T (as stored) *
// dqkv[:, rows] (T-op); one product per weight (separate outputs). dWq and dWk on the side stream
// next to the grad_x GEMM, dWv after it on the lane: at small T all four are bound by memory
// (grad_x reads the 31.5 MB of fp16 weights, the dW write 63 MB of fp32), and this split gives the
// two streams ~44 and ~50 MB.
Status GradQkvWeightGemms(const PipelineCall& call) {
  const PipelinePlan& plan = call.plan;
  for (int i = 0; i < 3; ++i) {
    GemmSpec spec;
    spec.transpose_b = true;
    spec.m = plan.hidden;
    spec.n = plan.qkv_rows[i];
    spec.k = plan.tokens;
    spec.a = call.buffers.x;
    spec.lda = plan.hidden;
    spec.b = PipelineBuffers::Offset(plan, call.buffers.grad_qkv, plan.qkv_first_row[i]);
    spec.ldb = plan.qkv_width;
    spec.d = call.out.weight_gradients[kQkvWeights[i]];
    spec.ldd = plan.hidden;
    spec.arithmetic = plan.mode.gemm;
    spec.beta = call.accumulate ? 1.f : 0.f;
    call.Unscale(spec, /*weight_gradient=*/true);
    constexpr const char* kWhat = "grad_w_qkv GEMMs (dqkv^T X) failed";
    ATTNGRAD_RETURN_IF_ERROR(i < 2 ? call.SideGemm(spec, kWhat) : call.LaneGemm(spec, kWhat));
    if (i == 1) call.StageDone("grad_w_qk_gemm", call.side);
  }
  call.StageDone("grad_w_v_gemm", call.lane);
  return {};
}

bool Supported(const LayerConfig& config) {
  return config.IsValid() && (config.head_dim == 128 || config.head_dim == 256);
}

bool Aligned16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

// The checks a GPU call makes first: the precision mode, and a configuration the kernels support.
Status CheckPrecisionAndConfig(Precision precision, const LayerConfig& config) {
  if (!IsValidPrecision(static_cast<int>(precision))) {
    return {ATTNGRAD_INVALID_ARGUMENT, "precision is not one of AUTO, FP32, TF32, FP16"};
  }
  if (!Supported(config)) {
    return {ATTNGRAD_UNSUPPORTED,
            config.IsValid() ? "the GPU kernels support head_dim 128 and 256 only"
                             : "LayerConfig is invalid (sizes must be positive, num_heads a "
                               "multiple of num_kv_heads, head_dim even)"};
  }
  return {};
}

// The element-wise kernels read 16 bytes at a time from these (cudaMalloc gives 256).
Status CheckAlignment(const ForwardInputs& in) {
  if (!Aligned16(in.cos)) return {ATTNGRAD_INVALID_ARGUMENT, "cos is not 16-byte aligned"};
  if (!Aligned16(in.sin)) return {ATTNGRAD_INVALID_ARGUMENT, "sin is not 16-byte aligned"};
  if (!Aligned16(in.weights[Weight::kQNorm])) {
    return {ATTNGRAD_INVALID_ARGUMENT, "weights[q_norm] is not 16-byte aligned"};
  }
  if (!Aligned16(in.weights[Weight::kKNorm])) {
    return {ATTNGRAD_INVALID_ARGUMENT, "weights[k_norm] is not 16-byte aligned"};
  }
  return {};
}

// The checks of a backward call's arguments before anything is enqueued (the workspace's:
// CheckWorkspace); the first that fails is named.
Status CheckCall(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                 Precision precision, const BackwardInputs& in, const BackwardOutputs& out) {
  ATTNGRAD_RETURN_IF_ERROR(CheckPrecisionAndConfig(precision, config));
  ATTNGRAD_RETURN_IF_ERROR(CheckBackwardArguments(config, batch, seq_len, scalars, in, out));
  return CheckAlignment(ForwardInputs::Of(in));
}

// The same for a forward call.
Status CheckForwardCall(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                        Precision precision, const ForwardInputs& in, const float* output) {
  ATTNGRAD_RETURN_IF_ERROR(CheckPrecisionAndConfig(precision, config));
  ATTNGRAD_RETURN_IF_ERROR(CheckForwardArguments(config, batch, seq_len, scalars, in, output));
  return CheckAlignment(in);
}

// A call with prepared weights: they are ready, of the call's configuration, and `weights` (the
// call's in.weights) are the weights they were prepared from.
Status CheckPrepared(const PreparedWeights& prepared, const LayerConfig& config,
                     const PerWeight<const float*>& weights) {
  if (!prepared.ready()) {
    return {ATTNGRAD_INVALID_ARGUMENT,
            "the PreparedWeights are empty (not prepared, or moved from)"};
  }
  const LayerConfig& own = prepared.config();
  if (own.hidden_size != config.hidden_size || own.num_heads != config.num_heads ||
      own.num_kv_heads != config.num_kv_heads || own.head_dim != config.head_dim) {
    return {ATTNGRAD_INVALID_ARGUMENT,
            "the LayerConfig is not the one the PreparedWeights were prepared for"};
  }
  for (Weight weight : kAllWeights) {
    if (weights[weight] != prepared.source()[weight]) {
      return {ATTNGRAD_INVALID_ARGUMENT,
              "in.weights are not the weights the PreparedWeights were prepared from"};
    }
  }
  return {};
}

// The workspace must hold `needed` bytes (WorkspaceLayout::total, what DeviceWorkspaceSize or, for
// the forward, ForwardWorkspaceSize says).
Status CheckWorkspace(const void* workspace, std::size_t workspace_size, std::size_t needed,
                      Pass pass) {
  if (workspace == nullptr) return {ATTNGRAD_WORKSPACE_TOO_SMALL, "workspace is null"};
  if (workspace_size < needed) {
    return {ATTNGRAD_WORKSPACE_TOO_SMALL,
            pass == Pass::kBackward
                ? "workspace_size is smaller than DeviceWorkspaceSize for this shape and precision"
                : "workspace_size is smaller than ForwardWorkspaceSize for this shape and "
                  "precision"};
  }
  return {};
}

// The cuBLASLt context of the calling thread's current device.
Status CurrentDeviceContext(DeviceContext** context) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    return {ATTNGRAD_CUDA_ERROR, "cudaGetDevice failed"};
  }
  return StepStatus(DeviceContextRegistry::Instance().Get(device, context),
                    "creating the device's cuBLASLt context failed");
}

}  // namespace

Precision ResolvePrecision(Precision precision, int batch, int seq_len) {
  if (precision != Precision::kAuto) return precision;
  (void)batch;
  (void)seq_len;
  return Precision::kFp16;
}

Status RunBackwardPipeline(const LayerConfig& config, int batch, int seq_len,
                           const Scalars& scalars, Precision precision, bool accumulate,
                           const BackwardInputs& in, const BackwardOutputs& out, void* workspace,
                           std::size_t workspace_size, cudaStream_t caller_stream,
                           StageObserver* observer, SideStream* given_side,
                           const PreparedWeights* prepared) {
  ATTNGRAD_RETURN_IF_ERROR(CheckCall(config, batch, seq_len, scalars, precision, in, out));
  if (prepared != nullptr) ATTNGRAD_RETURN_IF_ERROR(CheckPrepared(*prepared, config, in.weights));
  const PipelinePlan plan(config, batch, seq_len, scalars,
                          ChoiceOf(ResolvePrecision(precision, batch, seq_len)),
                          /*weights_prepared=*/prepared != nullptr, Pass::kBackward);
  ATTNGRAD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_size, plan.layout.total, Pass::kBackward));
  const ForwardInputs forward_in = ForwardInputs::Of(in);
  const PipelineBuffers buffers(plan, forward_in, in.grad_output, workspace, prepared);
  DeviceContext* context = nullptr;
  ATTNGRAD_RETURN_IF_ERROR(CurrentDeviceContext(&context));
  SideStreamLease side_lease(context);
  // Null with a serialising observer: everything on the caller's stream.
  SideStream* streams = nullptr;
  if (observer == nullptr || observer->overlapped()) {
    if (given_side == nullptr) {
      ATTNGRAD_RETURN_IF_ERROR(
          StepStatus(side_lease.Acquire(), "creating the pipeline's side streams failed"));
    }
    streams = given_side != nullptr ? given_side : side_lease.get();
  }
  const PipelineCall call{plan,
                          buffers,
                          scalars,
                          accumulate,
                          forward_in,
                          in.grad_output,
                          out,
                          context,
                          streams,
                          caller_stream,
                          streams != nullptr ? streams->lane() : caller_stream,
                          streams != nullptr ? streams->stream() : caller_stream,
                          observer};

  // Fork: the lane from the caller's stream, the side stream from the lane.
  ATTNGRAD_RETURN_IF_ERROR(call.Order(ForkJoinEvent::kLaneForked, call.caller, call.lane));
  ATTNGRAD_RETURN_IF_ERROR(call.Order(ForkJoinEvent::kSideForked, call.lane, call.side));
  if (plan.mode.half()) ATTNGRAD_RETURN_IF_ERROR(ConvertOperands(call));  // lane and side
  ATTNGRAD_RETURN_IF_ERROR(ProjectQkv(call));                             // lane
  ATTNGRAD_RETURN_IF_ERROR(NormalizeAndRotate(call));                     // lane
  ATTNGRAD_RETURN_IF_ERROR(GradAttentionGemm(call));                      // side
  ATTNGRAD_RETURN_IF_ERROR(AttentionForwardStage(call));                  // lane, after dA
  ATTNGRAD_RETURN_IF_ERROR(AttentionBackwardQuery(call));                 // side, after the forward
  ATTNGRAD_RETURN_IF_ERROR(GradOutputWeightGemm(call));                   // side
  ATTNGRAD_RETURN_IF_ERROR(AttentionBackwardKeyValue(call));  // lane, then waits for dq'
  ATTNGRAD_RETURN_IF_ERROR(RopeRmsNormBackwardStage(call));   // lane, final sum on the side
  ATTNGRAD_RETURN_IF_ERROR(GradHiddenGemm(call));             // lane
  ATTNGRAD_RETURN_IF_ERROR(GradQkvWeightGemms(call));         // side (dWq, dWk) and lane (dWv)
  // Join: the call ends on the caller's stream when both streams are done.
  ATTNGRAD_RETURN_IF_ERROR(call.Order(ForkJoinEvent::kSideDone, call.side, call.lane));
  return call.Order(ForkJoinEvent::kLaneDone, call.lane, call.caller);
}

namespace {

// The forward entry point's pipeline, all on the caller's stream (no side stream, no events): the
// backward's forward stages (conversion, qkv GEMM, rmsnorm_rope, attention forward without the
// fused Delta), then the o_proj GEMM of A into `output`.
Status RunForwardPipeline(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                          Precision precision, const ForwardInputs& in, float* output,
                          void* workspace, std::size_t workspace_size, cudaStream_t stream,
                          const PreparedWeights* prepared) {
  ATTNGRAD_RETURN_IF_ERROR(
      CheckForwardCall(config, batch, seq_len, scalars, precision, in, output));
  if (prepared != nullptr) ATTNGRAD_RETURN_IF_ERROR(CheckPrepared(*prepared, config, in.weights));
  const PipelinePlan plan(config, batch, seq_len, scalars,
                          ChoiceOf(ResolvePrecision(precision, batch, seq_len)),
                          /*weights_prepared=*/prepared != nullptr, Pass::kForward);
  ATTNGRAD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_size, plan.layout.total, Pass::kForward));
  const PipelineBuffers buffers(plan, in, /*grad_output=*/nullptr, workspace, prepared);
  DeviceContext* context = nullptr;
  ATTNGRAD_RETURN_IF_ERROR(CurrentDeviceContext(&context));
  const BackwardOutputs no_gradients;
  const PipelineCall call{plan,
                          buffers,
                          scalars,
                          /*accumulate=*/false,
                          in,
                          /*grad_output=*/nullptr,
                          no_gradients,
                          context,
                          /*streams=*/nullptr,
                          stream,
                          stream,
                          stream,
                          /*observer=*/nullptr};
  if (plan.mode.half()) ATTNGRAD_RETURN_IF_ERROR(ConvertForwardOperands(call));
  ATTNGRAD_RETURN_IF_ERROR(ProjectQkv(call));
  ATTNGRAD_RETURN_IF_ERROR(NormalizeAndRotate(call));
  ATTNGRAD_RETURN_IF_ERROR(AttentionForwardOnLane(call, /*fused_delta=*/nullptr));
  return OutputProjectionGemm(call, output);
}

}  // namespace
}  // namespace cuda

namespace cuda {
namespace {

std::size_t WorkspaceSize(const LayerConfig& config, int batch, int seq_len, Precision precision,
                          bool weights_prepared, Pass pass) {
  if (!IsValidPrecision(static_cast<int>(precision)) || !Supported(config) || batch < 1 ||
      seq_len < 1 || static_cast<long long>(batch) * seq_len > kMaxTokens) {
    return 0;
  }
  const ModeChoice mode = ChoiceOf(ResolvePrecision(precision, batch, seq_len));
  return WorkspaceLayout(config, batch, seq_len, mode, weights_prepared, pass).total;
}

}  // namespace
}  // namespace cuda

std::size_t DeviceWorkspaceSize(const LayerConfig& config, int batch, int seq_len,
                                Precision precision) {
  return cuda::WorkspaceSize(config, batch, seq_len, precision, /*weights_prepared=*/false,
                             cuda::Pass::kBackward);
}

std::size_t DeviceWorkspaceSize(const PreparedWeights& weights, int batch, int seq_len,
                                Precision precision) {
  if (!weights.ready()) return 0;
  return cuda::WorkspaceSize(weights.config(), batch, seq_len, precision,
                             /*weights_prepared=*/true, cuda::Pass::kBackward);
}

std::size_t ForwardWorkspaceSize(const LayerConfig& config, int batch, int seq_len,
                                 Precision precision) {
  return cuda::WorkspaceSize(config, batch, seq_len, precision, /*weights_prepared=*/false,
                             cuda::Pass::kForward);
}

std::size_t ForwardWorkspaceSize(const PreparedWeights& weights, int batch, int seq_len,
                                 Precision precision) {
  if (!weights.ready()) return 0;
  return cuda::WorkspaceSize(weights.config(), batch, seq_len, precision,
                             /*weights_prepared=*/true, cuda::Pass::kForward);
}

namespace cuda {
namespace {

// Every argument of a call, for the graph cache (pipeline_graph.h).
PipelineKey KeyOf(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                  Precision precision, bool accumulate, const BackwardInputs& in,
                  const BackwardOutputs& out, const void* workspace, std::size_t workspace_size,
                  const PreparedWeights* prepared) {
  PipelineKey key{};
  std::size_t next = 0;
  auto add = [&key, &next](std::uint64_t word) { key[next++] = word; };
  auto add_pointer = [&add](const void* pointer) {
    add(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(pointer)));
  };
  auto add_float = [&add](float value) {
    std::uint32_t raw = 0;
    static_assert(sizeof raw == sizeof value);
    std::memcpy(&raw, &value, sizeof raw);
    add(raw);
  };
  for (const float* tensor : {in.grad_output, in.hidden_states, in.cos, in.sin}) {
    add_pointer(tensor);
  }
  for (const float* weight : in.weights) add_pointer(weight);
  add_pointer(prepared != nullptr ? prepared->half_qkv() : nullptr);  // Wo's copy follows it
  add_pointer(out.grad_hidden_states);
  for (const float* gradient : out.weight_gradients) add_pointer(gradient);
  add_pointer(workspace);
  for (const long long value :
       {static_cast<long long>(workspace_size), static_cast<long long>(batch),
        static_cast<long long>(seq_len), static_cast<long long>(precision),
        static_cast<long long>(accumulate), static_cast<long long>(config.hidden_size),
        static_cast<long long>(config.num_heads), static_cast<long long>(config.num_kv_heads),
        static_cast<long long>(config.head_dim), static_cast<long long>(scalars.sliding_window)}) {
    add(static_cast<std::uint64_t>(value));
  }
  for (const float value : {scalars.scaling, scalars.softcap, scalars.eps}) add_float(value);
  return key;  // words past `next` stay 0
}

}  // namespace
}  // namespace cuda

namespace cuda {
namespace {

// Both BackwardDevice entry points (prepared: null, or the weights' fp16 copies to read).
Status Backward(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                Precision precision, bool accumulate, const PreparedWeights* prepared,
                const BackwardInputs& in, const BackwardOutputs& out, void* workspace,
                std::size_t workspace_size, cudaStream_t caller_stream) {
  // Checked before the graph cache sees the call (a bad call is never remembered).
  Status checked = CheckCall(config, batch, seq_len, scalars, precision, in, out);
  if (checked.ok() && prepared != nullptr) {
    checked = CheckPrepared(*prepared, config, in.weights);
  }
  if (checked.ok()) {
    checked =
        CheckWorkspace(workspace, workspace_size,
                       WorkspaceSize(config, batch, seq_len, precision,
                                     /*weights_prepared=*/prepared != nullptr, Pass::kBackward),
                       Pass::kBackward);
  }
  if (!checked.ok()) return checked;
  // The graph cache's enqueue callback returns a code; the message of a failure is kept here.
  Status failed;
  auto enqueue = [&](cudaStream_t on, SideStream* side) {
    const Status status =
        RunBackwardPipeline(config, batch, seq_len, scalars, precision, accumulate, in, out,
                            workspace, workspace_size, on, /*observer=*/nullptr, side, prepared);
    if (!status.ok()) failed = status;
    return status.code;
  };
  auto result = [&failed](attngrad_status code, const char* otherwise) {
    if (code == ATTNGRAD_OK) return Status{};
    return failed.code == code ? failed : Status{code, otherwise};
  };
  // A caller capturing its stream gets the kernels in its own graph.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(caller_stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    return result(enqueue(caller_stream, nullptr), "");
  }
  if (capture != cudaStreamCaptureStatusNone) return result(enqueue(caller_stream, nullptr), "");
  DeviceContext* context = nullptr;
  ATTNGRAD_RETURN_IF_ERROR(CurrentDeviceContext(&context));
  return result(
      context->pipeline_graphs().Run(KeyOf(config, batch, seq_len, scalars, precision, accumulate,
                                           in, out, workspace, workspace_size, prepared),
                                     enqueue, caller_stream, context),
      "launching the pipeline's CUDA graph failed");
}

}  // namespace
}  // namespace cuda

Status BackwardDevice(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                      Precision precision, bool accumulate, const BackwardInputs& in,
                      const BackwardOutputs& out, void* workspace, std::size_t workspace_size,
                      void* stream) {
  return cuda::Backward(config, batch, seq_len, scalars, precision, accumulate,
                        /*prepared=*/nullptr, in, out, workspace, workspace_size,
                        static_cast<cudaStream_t>(stream));
}

Status BackwardDevice(const PreparedWeights& weights, int batch, int seq_len,
                      const Scalars& scalars, Precision precision, bool accumulate,
                      const BackwardInputs& in, const BackwardOutputs& out, void* workspace,
                      std::size_t workspace_size, void* stream) {
  return cuda::Backward(weights.config(), batch, seq_len, scalars, precision, accumulate, &weights,
                        in, out, workspace, workspace_size, static_cast<cudaStream_t>(stream));
}

Status ForwardDevice(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                     Precision precision, const ForwardInputs& in, float* output, void* workspace,
                     std::size_t workspace_size, void* stream) {
  return cuda::RunForwardPipeline(config, batch, seq_len, scalars, precision, in, output, workspace,
                                  workspace_size, static_cast<cudaStream_t>(stream),
                                  /*prepared=*/nullptr);
}

Status ForwardDevice(const PreparedWeights& weights, int batch, int seq_len, const Scalars& scalars,
                     Precision precision, const ForwardInputs& in, float* output, void* workspace,
                     std::size_t workspace_size, void* stream) {
  return cuda::RunForwardPipeline(weights.config(), batch, seq_len, scalars, precision, in, output,
                                  workspace, workspace_size, static_cast<cudaStream_t>(stream),
                                  &weights);
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
