// The C++ API behind the C ABI: the layer configuration, the tensors of one backward call, and the
// CPU and GPU entry points. Everything returns an attngrad_status, or a Status that also says which
// check failed; kernels/ knows nothing of Abseil, gRPC or protobuf (the server maps these to
// absl::Status).
#ifndef ATTNGRAD_BACKWARD_H_
#define ATTNGRAD_BACKWARD_H_

#include <cstddef>
#include <cstdint>

#include "attngrad/attngrad.h"
#include "attngrad/layer_config.h"
#include "attngrad/layer_weights.h"

namespace attngrad {

// The outcome of a call: the C ABI's code and, when it is not ATTNGRAD_OK, which check failed or
// which step went wrong ("hidden_states is null", "cos is not 16-byte aligned", "workspace is
// smaller than DeviceWorkspaceSize", ...). `message` is a static string: never null, never freed.
struct ATTNGRAD_API Status {
  attngrad_status code = ATTNGRAD_OK;
  const char* message = "";
  bool ok() const { return code == ATTNGRAD_OK; }
};

// Scalars of SPEC section 2, with the benchmark values as defaults.
// softcap <= 0 means no soft-capping (Gemma-3's published configs: attn_logit_softcapping null):
// the score is s itself. sliding_window > 0 restricts a query at position i (its index in the
// sequence) to the keys j with i - sliding_window < j <= i (Gemma-3's local layers); 0 means full
// causal attention.
struct ATTNGRAD_API Scalars {
  float scaling = 0.08838834764831845f;  // 1/sqrt(128)
  float softcap = 50.0f;                 // attn_logit_softcapping; <= 0: none
  float eps = 1e-6f;                     // rms_norm_eps
  int sliding_window = 0;                // sliding_window of a local layer; 0: none
  bool IsValid() const;                  // finite; eps > 0; sliding_window >= 0
  bool capped() const { return softcap > 0.f; }
};

// The input tensors (never written). Host or device pointers depending on the entry point.
struct ATTNGRAD_API BackwardInputs {
  const float* grad_output = nullptr;    // [B,S,hidden]
  const float* hidden_states = nullptr;  // [B,S,hidden]
  const float* cos = nullptr;            // [B,S,head_dim]
  const float* sin = nullptr;            // [B,S,head_dim]
  PerWeight<const float*> weights;       // WeightShape(config, w) each
  bool AnyNull() const;
};

// The outputs. grad_hidden_states is always overwritten; the six weight gradients are overwritten,
// or added to when `accumulate` is set.
struct ATTNGRAD_API BackwardOutputs {
  float* grad_hidden_states = nullptr;  // [B,S,hidden]
  PerWeight<float*> weight_gradients;   // WeightShape(config, w) each
  bool AnyNull() const;
};

enum class Precision : int {
  kAuto = ATTNGRAD_PRECISION_AUTO,
  kFp32 = ATTNGRAD_PRECISION_FP32,
  kTf32 = ATTNGRAD_PRECISION_TF32,
  kFp16 = ATTNGRAD_PRECISION_FP16,
};
ATTNGRAD_API bool IsValidPrecision(int precision);

// Element counts of the activation tensors for a configuration and shape (the weights':
// WeightElements in layer_weights.h).
struct TensorSizes {
  std::size_t activations;  // B*S*hidden
  std::size_t rotary;       // B*S*head_dim
};
ATTNGRAD_API TensorSizes SizesOf(const LayerConfig& config, int batch, int seq_len);

// The checks every entry point makes before any work (configuration, shape, scalars, the 17
// pointers non-null); the first that fails is named in the message.
ATTNGRAD_API Status CheckBackwardArguments(const LayerConfig& config, int batch, int seq_len,
                                           const Scalars& scalars, const BackwardInputs& in,
                                           const BackwardOutputs& out);

// CPU reference backend (host pointers; synchronous). Any valid configuration, any B, S >= 1.
// num_threads: threads for the attention and the element-wise stages (0 = all hardware threads);
// the projections run in OpenBLAS with its own thread setting. The result does not depend on it.
ATTNGRAD_API Status BackwardHost(const LayerConfig& config, int batch, int seq_len,
                                 const Scalars& scalars, bool accumulate, const BackwardInputs& in,
                                 const BackwardOutputs& out, int num_threads = 0);

// GPU backend (device pointers; asynchronous on `stream`, a cudaStream_t; no device memory
// allocation, no host synchronisation, so it can be captured in a CUDA graph; repeated calls are
// replayed from a graph the library keeps, as attngrad_backward says). Returns
// ATTNGRAD_UNSUPPORTED when the library was built without CUDA or the configuration is not one the
// kernels support. The Status names the check or the step that failed.
ATTNGRAD_API std::size_t DeviceWorkspaceSize(const LayerConfig& config, int batch, int seq_len,
                                             Precision precision);
ATTNGRAD_API Status BackwardDevice(const LayerConfig& config, int batch, int seq_len,
                                   const Scalars& scalars, Precision precision, bool accumulate,
                                   const BackwardInputs& in, const BackwardOutputs& out,
                                   void* workspace, std::size_t workspace_size, void* stream);

// Number of CUDA devices usable by this build (0 without CUDA or without a device).
ATTNGRAD_API int DeviceCount();

}  // namespace attngrad

#endif  // ATTNGRAD_BACKWARD_H_
