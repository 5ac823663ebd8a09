// The C++ API behind the C ABI: the layer configuration, the tensors of one backward call, and the
// CPU and GPU entry points. Everything returns an attngrad_status; kernels/ knows nothing of Abseil,
// gRPC or protobuf (the server maps these statuses to absl::Status).
#ifndef ATTNGRAD_BACKWARD_H_
#define ATTNGRAD_BACKWARD_H_

#include <cstddef>
#include <cstdint>

#include "attngrad/attngrad.h"

namespace attngrad {

// Shape of one attention layer. Gemma3_4B() is the configuration of SPEC.md; other Gemma-3 sizes
// differ in these four numbers. The CPU backend serves any configuration; the GPU kernels support
// head_dim == 128 only and return ATTNGRAD_UNSUPPORTED otherwise.
struct ATTNGRAD_API LayerConfig {
  int hidden_size = 3072;
  int num_heads = 24;
  int num_kv_heads = 8;
  int head_dim = 128;

  static constexpr LayerConfig Gemma3_4B() { return LayerConfig{}; }
  constexpr int q_out() const { return num_heads * head_dim; }
  constexpr int kv_out() const { return num_kv_heads * head_dim; }
  constexpr int group_size() const { return num_heads / num_kv_heads; }
  // True when the numbers are positive, num_heads is a multiple of num_kv_heads and head_dim is even.
  bool IsValid() const;
};

// Scalars of SPEC section 2, with the benchmark values as defaults.
struct ATTNGRAD_API Scalars {
  float scaling = 0.08838834764831845f;  // 1/sqrt(128)
  float softcap = 50.0f;                 // attn_logit_softcapping
  float eps = 1e-6f;                     // rms_norm_eps
  bool IsValid() const;                  // finite; softcap > 0 and eps > 0
};

// The ten input tensors (never written). Host or device pointers depending on the entry point.
struct ATTNGRAD_API BackwardInputs {
  const float* grad_output = nullptr;    // [B,S,hidden]
  const float* hidden_states = nullptr;  // [B,S,hidden]
  const float* cos = nullptr;            // [B,S,head_dim]
  const float* sin = nullptr;            // [B,S,head_dim]
  const float* q_weight = nullptr;       // [q_out,hidden]
  const float* k_weight = nullptr;       // [kv_out,hidden]
  const float* v_weight = nullptr;       // [kv_out,hidden]
  const float* o_weight = nullptr;       // [hidden,q_out]
  const float* q_norm_weight = nullptr;  // [head_dim]
  const float* k_norm_weight = nullptr;  // [head_dim]
  bool AnyNull() const;
};

// The seven outputs. grad_hidden_states is always overwritten; the six weight gradients are
// overwritten, or added to when `accumulate` is set.
struct ATTNGRAD_API BackwardOutputs {
  float* grad_hidden_states = nullptr;  // [B,S,hidden]
  float* grad_q_weight = nullptr;
  float* grad_k_weight = nullptr;
  float* grad_v_weight = nullptr;
  float* grad_o_weight = nullptr;
  float* grad_q_norm_weight = nullptr;
  float* grad_k_norm_weight = nullptr;
  bool AnyNull() const;
};

enum class Precision : int {
  kAuto = ATTNGRAD_PRECISION_AUTO,
  kFp32 = ATTNGRAD_PRECISION_FP32,
  kTf32 = ATTNGRAD_PRECISION_TF32,
  kFp16 = ATTNGRAD_PRECISION_FP16,
};
ATTNGRAD_API bool IsValidPrecision(int precision);

// Element counts of the tensors for a configuration and shape.
struct TensorSizes {
  std::size_t activations;  // B*S*hidden
  std::size_t rotary;       // B*S*head_dim
  std::size_t q_weight;     // q_out*hidden (also o_weight)
  std::size_t kv_weight;    // kv_out*hidden
  std::size_t norm_weight;  // head_dim
};
ATTNGRAD_API TensorSizes SizesOf(const LayerConfig& config, int batch, int seq_len);

// CPU reference backend (host pointers; synchronous). Any valid configuration, any B, S >= 1.
// num_threads: threads for the attention and the element-wise stages (0 = all hardware threads);
// the projections run in OpenBLAS with its own thread setting. The result does not depend on it.
ATTNGRAD_API attngrad_status BackwardHost(const LayerConfig& config, int batch, int seq_len,
                                          const Scalars& scalars, bool accumulate,
                                          const BackwardInputs& in, const BackwardOutputs& out,
                                          int num_threads = 0);

// GPU backend (device pointers; asynchronous on `stream`, a cudaStream_t; no device memory
// allocation, no host synchronisation, so it can be captured in a CUDA graph; repeated calls are
// replayed from a graph the library keeps, as attngrad_backward says). Returns
// ATTNGRAD_UNSUPPORTED when the library was built without CUDA or the configuration is not one the
// kernels support.
ATTNGRAD_API std::size_t DeviceWorkspaceSize(const LayerConfig& config, int batch, int seq_len,
                                Precision precision);
ATTNGRAD_API attngrad_status BackwardDevice(const LayerConfig& config, int batch, int seq_len,
                               const Scalars& scalars, Precision precision, bool accumulate,
                               const BackwardInputs& in, const BackwardOutputs& out,
                               void* workspace, std::size_t workspace_size, void* stream);

// Number of CUDA devices usable by this build (0 without CUDA or without a device).
ATTNGRAD_API int DeviceCount();

}  // namespace attngrad

#endif  // ATTNGRAD_BACKWARD_H_
