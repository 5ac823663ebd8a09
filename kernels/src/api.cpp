// The C ABI of attngrad.h over the C++ API of backward.h, the small value types' methods and the
// argument checks every backend shares (backward.h, forward.h).
#include <cmath>

#include "attngrad/attngrad.h"
#include "attngrad/backward.h"
#include "attngrad/forward.h"
#include "validate.h"

namespace attngrad {

bool LayerConfig::IsValid() const {
  return hidden_size > 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0 &&
         head_dim % 2 == 0 && num_heads % num_kv_heads == 0;
}

bool Scalars::IsValid() const {
  return std::isfinite(scaling) && std::isfinite(softcap) && std::isfinite(eps) && eps > 0.f &&
         sliding_window >= 0;
}

bool BackwardInputs::AnyNull() const {
  for (const float* weight : weights) {
    if (weight == nullptr) return true;
  }
  return !grad_output || !hidden_states || !cos || !sin;
}

bool ForwardInputs::AnyNull() const {
  for (const float* weight : weights) {
    if (weight == nullptr) return true;
  }
  return !hidden_states || !cos || !sin;
}

ForwardInputs ForwardInputs::Of(const BackwardInputs& in) {
  ForwardInputs forward;
  forward.hidden_states = in.hidden_states;
  forward.cos = in.cos;
  forward.sin = in.sin;
  forward.weights = in.weights;
  return forward;
}

bool BackwardOutputs::AnyNull() const {
  for (const float* gradient : weight_gradients) {
    if (gradient == nullptr) return true;
  }
  return !grad_hidden_states;
}

bool IsValidPrecision(int precision) {
  return precision >= ATTNGRAD_PRECISION_AUTO && precision <= ATTNGRAD_PRECISION_FP16;
}

TensorSizes SizesOf(const LayerConfig& config, int batch, int seq_len) {
  const std::size_t tokens = static_cast<std::size_t>(batch) * static_cast<std::size_t>(seq_len);
  const std::size_t hidden = static_cast<std::size_t>(config.hidden_size);
  return TensorSizes{tokens * hidden, tokens * static_cast<std::size_t>(config.head_dim)};
}

namespace {

// The checks of the configuration, the shape and the scalars, which every entry point makes
// first.
Status CheckShape(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars) {
  constexpr attngrad_status kInvalid = ATTNGRAD_INVALID_ARGUMENT;
  if (!config.IsValid()) {
    return {kInvalid,
            "LayerConfig is invalid (sizes must be positive, num_heads a multiple of num_kv_heads, "
            "head_dim even)"};
  }
  if (batch < 1) return {kInvalid, "batch must be at least 1"};
  if (seq_len < 1) return {kInvalid, "seq_len must be at least 1"};
  if (static_cast<long long>(batch) * seq_len > kMaxTokens) {
    return {kInvalid, "batch * seq_len exceeds the 2^26 tokens one call may carry"};
  }
  if (!scalars.IsValid()) {
    return {kInvalid, "scalars must be finite, with eps > 0 and sliding_window >= 0"};
  }
  return {};
}

// The inputs the forward reads (the backward's, less grad_output) are set.
Status CheckForwardInputs(const ForwardInputs& in) {
  constexpr attngrad_status kInvalid = ATTNGRAD_INVALID_ARGUMENT;
  // One static message per weight, in Weight's order.
  constexpr const char* kNullWeight[kNumWeights] = {
      "weights[q_proj] is null", "weights[k_proj] is null", "weights[v_proj] is null",
      "weights[o_proj] is null", "weights[q_norm] is null", "weights[k_norm] is null"};
  if (in.hidden_states == nullptr) return {kInvalid, "hidden_states is null"};
  if (in.cos == nullptr) return {kInvalid, "cos is null"};
  if (in.sin == nullptr) return {kInvalid, "sin is null"};
  for (Weight weight : kAllWeights) {
    if (in.weights[weight] == nullptr) return {kInvalid, kNullWeight[IndexOf(weight)]};
  }
  return {};
}

}  // namespace

Status CheckBackwardArguments(const LayerConfig& config, int batch, int seq_len,
                              const Scalars& scalars, const BackwardInputs& in,
                              const BackwardOutputs& out) {
  constexpr attngrad_status kInvalid = ATTNGRAD_INVALID_ARGUMENT;
  constexpr const char* kNullGradient[kNumWeights] = {
      "weight_gradients[q_proj] is null", "weight_gradients[k_proj] is null",
      "weight_gradients[v_proj] is null", "weight_gradients[o_proj] is null",
      "weight_gradients[q_norm] is null", "weight_gradients[k_norm] is null"};
  Status status = CheckShape(config, batch, seq_len, scalars);
  if (!status.ok()) return status;
  if (in.grad_output == nullptr) return {kInvalid, "grad_output is null"};
  status = CheckForwardInputs(ForwardInputs::Of(in));
  if (!status.ok()) return status;
  if (out.grad_hidden_states == nullptr) return {kInvalid, "grad_hidden_states is null"};
  for (Weight weight : kAllWeights) {
    if (out.weight_gradients[weight] == nullptr) {
      return {kInvalid, kNullGradient[IndexOf(weight)]};
    }
  }
  return {};
}

Status CheckForwardArguments(const LayerConfig& config, int batch, int seq_len,
                             const Scalars& scalars, const ForwardInputs& in, const float* output) {
  Status status = CheckShape(config, batch, seq_len, scalars);
  if (!status.ok()) return status;
  status = CheckForwardInputs(in);
  if (!status.ok()) return status;
  if (output == nullptr) return {ATTNGRAD_INVALID_ARGUMENT, "output is null"};
  return {};
}

namespace {

BackwardInputs MakeInputs(const float* grad_output, const float* hidden_states, const float* cos,
                          const float* sin, const float* q_weight, const float* k_weight,
                          const float* v_weight, const float* o_weight, const float* q_norm_weight,
                          const float* k_norm_weight) {
  BackwardInputs in;
  in.grad_output = grad_output;
  in.hidden_states = hidden_states;
  in.cos = cos;
  in.sin = sin;
  in.weights = {{q_weight, k_weight, v_weight, o_weight, q_norm_weight, k_norm_weight}};
  return in;
}

BackwardOutputs MakeOutputs(float* grad_hidden_states, float* grad_q_weight, float* grad_k_weight,
                            float* grad_v_weight, float* grad_o_weight, float* grad_q_norm_weight,
                            float* grad_k_norm_weight) {
  BackwardOutputs out;
  out.grad_hidden_states = grad_hidden_states;
  out.weight_gradients = {{grad_q_weight, grad_k_weight, grad_v_weight, grad_o_weight,
                           grad_q_norm_weight, grad_k_norm_weight}};
  return out;
}

LayerConfig ConfigOf(const attngrad_layer& layer) {
  LayerConfig config;
  config.hidden_size = layer.hidden_size;
  config.num_heads = layer.num_heads;
  config.num_kv_heads = layer.num_kv_heads;
  config.head_dim = layer.head_dim;
  return config;
}

Scalars ScalarsOf(const attngrad_layer& layer) {
  Scalars scalars;
  scalars.scaling = layer.scaling;
  scalars.softcap = layer.softcap;
  scalars.eps = layer.eps;
  scalars.sliding_window = layer.sliding_window;
  return scalars;
}

BackwardInputs InputsOf(const attngrad_inputs& in) {
  return MakeInputs(in.grad_output, in.hidden_states, in.cos, in.sin, in.q_weight, in.k_weight,
                    in.v_weight, in.o_weight, in.q_norm_weight, in.k_norm_weight);
}

BackwardOutputs OutputsOf(const attngrad_outputs& out) {
  return MakeOutputs(out.grad_hidden_states, out.grad_q_weight, out.grad_k_weight,
                     out.grad_v_weight, out.grad_o_weight, out.grad_q_norm_weight,
                     out.grad_k_norm_weight);
}

}  // namespace
}  // namespace attngrad

extern "C" {

size_t attngrad_workspace_size_ex(const attngrad_layer* layer, int batch, int seq_len,
                                  int precision) {
  if (layer == nullptr || batch < 1 || seq_len < 1 || !attngrad::IsValidPrecision(precision)) {
    return 0;
  }
  if (static_cast<long long>(batch) * seq_len > attngrad::kMaxTokens) return 0;
  const attngrad::LayerConfig config = attngrad::ConfigOf(*layer);
  if (!config.IsValid() || !attngrad::ScalarsOf(*layer).IsValid()) return 0;
  return attngrad::DeviceWorkspaceSize(config, batch, seq_len,
                                       static_cast<attngrad::Precision>(precision));
}

int attngrad_backward_ex(const attngrad_layer* layer, int batch, int seq_len, int precision,
                         int accumulate, const attngrad_inputs* inputs,
                         const attngrad_outputs* outputs, void* workspace, size_t workspace_size,
                         void* stream) {
  if (layer == nullptr || inputs == nullptr || outputs == nullptr) return ATTNGRAD_INVALID_ARGUMENT;
  if (!attngrad::IsValidPrecision(precision)) return ATTNGRAD_INVALID_ARGUMENT;
  return attngrad::BackwardDevice(attngrad::ConfigOf(*layer), batch, seq_len,
                                  attngrad::ScalarsOf(*layer),
                                  static_cast<attngrad::Precision>(precision), accumulate != 0,
                                  attngrad::InputsOf(*inputs), attngrad::OutputsOf(*outputs),
                                  workspace, workspace_size, stream)
      .code;
}

int attngrad_backward_host_ex(const attngrad_layer* layer, int batch, int seq_len, int accumulate,
                              const attngrad_inputs* inputs, const attngrad_outputs* outputs) {
  if (layer == nullptr || inputs == nullptr || outputs == nullptr) return ATTNGRAD_INVALID_ARGUMENT;
  return attngrad::BackwardHost(attngrad::ConfigOf(*layer), batch, seq_len,
                                attngrad::ScalarsOf(*layer), accumulate != 0,
                                attngrad::InputsOf(*inputs), attngrad::OutputsOf(*outputs))
      .code;
}

size_t attngrad_workspace_size(int batch, int seq_len, int precision) {
  if (batch < 1 || seq_len < 1 || !attngrad::IsValidPrecision(precision)) return 0;
  if (static_cast<long long>(batch) * seq_len > attngrad::kMaxTokens) return 0;
  return attngrad::DeviceWorkspaceSize(attngrad::LayerConfig::Gemma3_4B(), batch, seq_len,
                                       static_cast<attngrad::Precision>(precision));
}

int attngrad_backward(int batch, int seq_len, float scaling, float softcap, float eps,
                      int precision, int accumulate, const float* grad_output,
                      const float* hidden_states, const float* cos, const float* sin,
                      const float* q_weight, const float* k_weight, const float* v_weight,
                      const float* o_weight, const float* q_norm_weight, const float* k_norm_weight,
                      float* grad_hidden_states, float* grad_q_weight, float* grad_k_weight,
                      float* grad_v_weight, float* grad_o_weight, float* grad_q_norm_weight,
                      float* grad_k_norm_weight, void* workspace, size_t workspace_size,
                      void* stream) {
  const attngrad::LayerConfig config = attngrad::LayerConfig::Gemma3_4B();
  const attngrad::Scalars scalars{scaling, softcap, eps};
  const attngrad::BackwardInputs in =
      attngrad::MakeInputs(grad_output, hidden_states, cos, sin, q_weight, k_weight, v_weight,
                           o_weight, q_norm_weight, k_norm_weight);
  const attngrad::BackwardOutputs out =
      attngrad::MakeOutputs(grad_hidden_states, grad_q_weight, grad_k_weight, grad_v_weight,
                            grad_o_weight, grad_q_norm_weight, grad_k_norm_weight);
  if (!attngrad::IsValidPrecision(precision)) return ATTNGRAD_INVALID_ARGUMENT;
  return attngrad::BackwardDevice(config, batch, seq_len, scalars,
                                  static_cast<attngrad::Precision>(precision), accumulate != 0, in,
                                  out, workspace, workspace_size, stream)
      .code;
}

int attngrad_backward_host(int batch, int seq_len, float scaling, float softcap, float eps,
                           int accumulate, const float* grad_output, const float* hidden_states,
                           const float* cos, const float* sin, const float* q_weight,
                           const float* k_weight, const float* v_weight, const float* o_weight,
                           const float* q_norm_weight, const float* k_norm_weight,
                           float* grad_hidden_states, float* grad_q_weight, float* grad_k_weight,
                           float* grad_v_weight, float* grad_o_weight, float* grad_q_norm_weight,
                           float* grad_k_norm_weight) {
  return attngrad::BackwardHost(
             attngrad::LayerConfig::Gemma3_4B(), batch, seq_len,
             attngrad::Scalars{scaling, softcap, eps}, accumulate != 0,
             attngrad::MakeInputs(grad_output, hidden_states, cos, sin, q_weight, k_weight,
                                  v_weight, o_weight, q_norm_weight, k_norm_weight),
             attngrad::MakeOutputs(grad_hidden_states, grad_q_weight, grad_k_weight, grad_v_weight,
                                   grad_o_weight, grad_q_norm_weight, grad_k_norm_weight))
      .code;
}

const char* attngrad_status_string(int status) {
  switch (status) {
    case ATTNGRAD_OK: return "ATTNGRAD_OK";
    case ATTNGRAD_INVALID_ARGUMENT: return "ATTNGRAD_INVALID_ARGUMENT";
    case ATTNGRAD_WORKSPACE_TOO_SMALL: return "ATTNGRAD_WORKSPACE_TOO_SMALL";
    case ATTNGRAD_CUDA_ERROR: return "ATTNGRAD_CUDA_ERROR";
    case ATTNGRAD_UNSUPPORTED: return "ATTNGRAD_UNSUPPORTED";
    case ATTNGRAD_INTERNAL: return "ATTNGRAD_INTERNAL";
    default: return "unknown status";
  }
}

int attngrad_device_count(void) { return attngrad::DeviceCount(); }

}  // extern "C"
