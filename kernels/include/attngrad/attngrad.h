/* attngrad C ABI: the backward pass of a Gemma-3 (4B) attention layer, exactly as kernels/SPEC.md
 * section 2 defines it (Q/K RMSNorm, rotate-half RoPE, soft-capped causal grouped-query attention and
 * the Q/K/V/O projections), on the GPU (attngrad_backward) or the CPU (attngrad_backward_host).
 *
 * Shapes (fp32, row-major, contiguous): grad_output, hidden_states, grad_hidden_states [B,S,3072];
 * cos, sin [B,S,128]; q_weight [3072,3072]; k_weight, v_weight [1024,3072]; o_weight [3072,3072];
 * q_norm_weight, k_norm_weight [128]; the weight gradients have the weights' shapes.
 * Inputs are never written; outputs must not alias inputs. */
#ifndef ATTNGRAD_ATTNGRAD_H_
#define ATTNGRAD_ATTNGRAD_H_

#include <stddef.h>

#if defined(_WIN32)
#define ATTNGRAD_API __declspec(dllexport)
#else
#define ATTNGRAD_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  ATTNGRAD_OK = 0,
  ATTNGRAD_INVALID_ARGUMENT = 1,
  ATTNGRAD_WORKSPACE_TOO_SMALL = 2,
  ATTNGRAD_CUDA_ERROR = 3,
  ATTNGRAD_UNSUPPORTED = 4,
  ATTNGRAD_INTERNAL = 5
} attngrad_status;

typedef enum {
  ATTNGRAD_PRECISION_AUTO = 0,
  ATTNGRAD_PRECISION_FP32 = 1,
  ATTNGRAD_PRECISION_TF32 = 2,
  ATTNGRAD_PRECISION_FP16 = 3
} attngrad_precision;

/* Bytes of device workspace attngrad_backward needs for this shape and precision
 * (0 for invalid arguments). */
ATTNGRAD_API size_t attngrad_workspace_size(int batch, int seq_len, int precision);

/* Gemma-3-4B attention backward of SPEC.md on the GPU. All pointers are device pointers, fp32,
   row-major, contiguous, in SPEC.md's shapes. stream is a cudaStream_t (NULL = default stream).
   accumulate != 0: the six weight gradients are ADDED to what the output buffers hold;
   grad_hidden_states is always overwritten. Asynchronous with respect to the host.
   cos, sin, q_norm_weight and k_norm_weight must be 16-byte aligned (cudaMalloc gives 256), else
   ATTNGRAD_INVALID_ARGUMENT. Uses the calling thread's current CUDA device.
   FP16 (and AUTO, which is FP16): grad_output may have any magnitude (a trainer's gradients are
   often ~1e-7, inside fp16's subnormals, or beyond its 65504): it is multiplied by a power of two
   found on the device (max |grad_output| into [4, 8)) before it becomes an fp16 operand, and the
   outputs are divided by it exactly; inputs already in that range (SPEC's benchmark) are converted
   once, others a second time. hidden_states and the weights are converted as they are: their
   magnitudes must suit fp16 (|x| < 65504), as a model's activations and weights do.
   Repeated calls with the same arguments (every pointer, the shape, mode and scalars) are replayed
   from a CUDA graph that the library captures and instantiates on the second such call and keeps
   (16 per device, least recently used dropped), cutting the host's work per call from ~100 us to
   ~5 us; inputs are read when the graph runs, so new contents in the same buffers are used. A
   stream that the caller is capturing gets the kernels themselves (never a nested graph). */
ATTNGRAD_API int attngrad_backward(int batch, int seq_len, float scaling, float softcap, float eps,
                                   int precision, int accumulate,
                                   const float* grad_output, const float* hidden_states,
                                   const float* cos, const float* sin,
                                   const float* q_weight, const float* k_weight,
                                   const float* v_weight, const float* o_weight,
                                   const float* q_norm_weight, const float* k_norm_weight,
                                   float* grad_hidden_states, float* grad_q_weight,
                                   float* grad_k_weight, float* grad_v_weight,
                                   float* grad_o_weight, float* grad_q_norm_weight,
                                   float* grad_k_norm_weight, void* workspace,
                                   size_t workspace_size, void* stream);

/* The same on the CPU with host pointers (the reference backend; precision is ignored: fp32).
   Synchronous; uses OpenBLAS for the projections and a few threads for the attention. */
ATTNGRAD_API int attngrad_backward_host(int batch, int seq_len, float scaling, float softcap,
                                        float eps, int accumulate,
                                        const float* grad_output, const float* hidden_states,
                                        const float* cos, const float* sin,
                                        const float* q_weight, const float* k_weight,
                                        const float* v_weight, const float* o_weight,
                                        const float* q_norm_weight, const float* k_norm_weight,
                                        float* grad_hidden_states, float* grad_q_weight,
                                        float* grad_k_weight, float* grad_v_weight,
                                        float* grad_o_weight, float* grad_q_norm_weight,
                                        float* grad_k_norm_weight);

/* A static, human-readable name for a status code ("ATTNGRAD_OK", ...; "unknown status" otherwise). */
ATTNGRAD_API const char* attngrad_status_string(int status);

/* Number of CUDA devices this library can use (0 when built without CUDA or when none is present). */
ATTNGRAD_API int attngrad_device_count(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNGRAD_ATTNGRAD_H_ */
