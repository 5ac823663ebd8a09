// The layer's forward output beside the backward: Y = A Woᵀ [B,S,hidden] from the same inputs the
// backward takes (SPEC section 2 steps 1-4, then the o_proj product), so that a trainer's forward
// runs the same kernels as the service's backward instead of PyTorch's fp32 attention. The CPU
// backend computes it with the very forward recomputation its backward uses; the GPU backend with
// the backward's forward stages (QKV projection, RMSNorm + RoPE, attention forward), in the same
// arithmetic per precision mode, then the o_proj GEMM of A.
#ifndef ATTNGRAD_FORWARD_H_
#define ATTNGRAD_FORWARD_H_

#include <cstddef>

#include "attngrad/backward.h"
#include "attngrad/layer_config.h"
#include "attngrad/layer_weights.h"
#include "attngrad/prepared_weights.h"

namespace attngrad {

// The inputs of the forward (never written): the backward's, less grad_output. Host or device
// pointers depending on the entry point.
struct ATTNGRAD_API ForwardInputs {
  const float* hidden_states = nullptr;  // [B,S,hidden]
  const float* cos = nullptr;            // [B,S,head_dim]
  const float* sin = nullptr;            // [B,S,head_dim]
  PerWeight<const float*> weights;       // WeightShape(config, w) each
  bool AnyNull() const;
  // The forward's part of a backward call's inputs.
  static ForwardInputs Of(const BackwardInputs& in);
};

// The checks every forward entry point makes before any work (configuration, shape, scalars, the
// 10 pointers non-null), with the backward's messages; the first that fails is named.
ATTNGRAD_API Status CheckForwardArguments(const LayerConfig& config, int batch, int seq_len,
                                          const Scalars& scalars, const ForwardInputs& in,
                                          const float* output);

// CPU reference backend (host pointers; synchronous): output [B,S,hidden] = A Woᵀ, overwritten.
// Any valid configuration, any B, S >= 1. num_threads as BackwardHost's; the result does not
// depend on it, and A is bit for bit the A that BackwardHost computes for the same inputs.
ATTNGRAD_API Status ForwardHost(const LayerConfig& config, int batch, int seq_len,
                                const Scalars& scalars, const ForwardInputs& in, float* output,
                                int num_threads = 0);

// GPU backend (device pointers; asynchronous on `stream`, a cudaStream_t; no device memory
// allocation, no host synchronisation, so it can be captured in a CUDA graph): output [B,S,hidden]
// = A Woᵀ, overwritten. Precision as BackwardDevice's (AUTO is FP16): the projections, q'/k' and
// the attention run in the arithmetic the backward's forward recomputation uses for that mode, and
// the o_proj product in the mode's GEMM arithmetic (FP16: fp16 A and Wo, fp32 accumulation).
// The same checks and messages as BackwardDevice (cos, sin and the norm weights 16-byte aligned;
// ATTNGRAD_UNSUPPORTED for a configuration the GPU kernels do not support or a build without
// CUDA); the workspace must hold ForwardWorkspaceSize bytes (0 for invalid arguments).
ATTNGRAD_API std::size_t ForwardWorkspaceSize(const LayerConfig& config, int batch, int seq_len,
                                              Precision precision);
ATTNGRAD_API Status ForwardDevice(const LayerConfig& config, int batch, int seq_len,
                                  const Scalars& scalars, Precision precision,
                                  const ForwardInputs& in, float* output, void* workspace,
                                  std::size_t workspace_size, void* stream);

// The same with prepared weights (prepared_weights.h): the configuration is weights.config();
// in.weights must be weights.source(); the FP16 mode reads the prepared fp16 copies, so the result
// is bit for bit the plain call's on the weights as they were at Prepare.
ATTNGRAD_API std::size_t ForwardWorkspaceSize(const PreparedWeights& weights, int batch,
                                              int seq_len, Precision precision);
ATTNGRAD_API Status ForwardDevice(const PreparedWeights& weights, int batch, int seq_len,
                                  const Scalars& scalars, Precision precision,
                                  const ForwardInputs& in, float* output, void* workspace,
                                  std::size_t workspace_size, void* stream);

}  // namespace attngrad

#endif  // ATTNGRAD_FORWARD_H_
