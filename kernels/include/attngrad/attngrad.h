/* attngrad C ABI: the backward pass of a Gemma-3 (4B) attention layer, exactly as kernels/SPEC.md
 * section 2 defines it (Q/K RMSNorm, rotate-half RoPE, soft-capped causal grouped-query attention
 * and the Q/K/V/O projections), on the GPU (attngrad_backward) or the CPU (attngrad_backward_host).
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
                                   int precision, int accumulate, const float* grad_output,
                                   const float* hidden_states, const float* cos, const float* sin,
                                   const float* q_weight, const float* k_weight,
                                   const float* v_weight, const float* o_weight,
                                   const float* q_norm_weight, const float* k_norm_weight,
                                   float* grad_hidden_states, float* grad_q_weight,
                                   float* grad_k_weight, float* grad_v_weight, float* grad_o_weight,
                                   float* grad_q_norm_weight, float* grad_k_norm_weight,
                                   void* workspace, size_t workspace_size, void* stream);

/* The same on the CPU with host pointers (the reference backend; precision is ignored: fp32).
   Synchronous; uses OpenBLAS for the projections and a few threads for the attention. */
ATTNGRAD_API int attngrad_backward_host(
    int batch, int seq_len, float scaling, float softcap, float eps, int accumulate,
    const float* grad_output, const float* hidden_states, const float* cos, const float* sin,
    const float* q_weight, const float* k_weight, const float* v_weight, const float* o_weight,
    const float* q_norm_weight, const float* k_norm_weight, float* grad_hidden_states,
    float* grad_q_weight, float* grad_k_weight, float* grad_v_weight, float* grad_o_weight,
    float* grad_q_norm_weight, float* grad_k_norm_weight);

/* ---- Any Gemma-3 layer ------------------------------------------------------------------------
 * The entry points above compute SPEC.md's layer (hidden 3072, 24/8 heads, head_dim 128, soft-cap
 * > 0, full causal attention). These take the layer as a struct, so every attention layer of the
 * published Gemma-3 models can be computed: any head counts and head_dim (the CPU any; the GPU
 * kernels the ones attngrad_workspace_size_ex does not answer 0 for: head_dim 128 and 256, any
 * head counts, any sliding window, every precision mode), no soft-capping
 * (softcap <= 0: the score is s itself, as Gemma-3's attn_logit_softcapping null), and a sliding
 * window (a query at position i of its sequence sees the keys j with i - sliding_window < j <= i;
 * 0 = full causal attention, Gemma-3's global layers). The tensors' shapes follow the layer: hidden
 * = hidden_size, q_out = num_heads * head_dim, kv_out = num_kv_heads * head_dim, D = head_dim. */
typedef struct {
  int hidden_size;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  float scaling;      /* e.g. query_pre_attn_scalar^-0.5 */
  float softcap;      /* attn_logit_softcapping; <= 0: none */
  float eps;          /* rms_norm_eps */
  int sliding_window; /* 0: full causal attention */
} attngrad_layer;

typedef struct {
  const float* grad_output;   /* [B,S,hidden] */
  const float* hidden_states; /* [B,S,hidden] */
  const float* cos;           /* [B,S,D] */
  const float* sin;           /* [B,S,D] */
  const float* q_weight;      /* [q_out,hidden] */
  const float* k_weight;      /* [kv_out,hidden] */
  const float* v_weight;      /* [kv_out,hidden] */
  const float* o_weight;      /* [hidden,q_out] */
  const float* q_norm_weight; /* [D] */
  const float* k_norm_weight; /* [D] */
} attngrad_inputs;

typedef struct {
  float* grad_hidden_states; /* [B,S,hidden], always overwritten */
  float* grad_q_weight;      /* the weight gradients: the weights' shapes */
  float* grad_k_weight;
  float* grad_v_weight;
  float* grad_o_weight;
  float* grad_q_norm_weight;
  float* grad_k_norm_weight;
} attngrad_outputs;

/* Bytes of device workspace attngrad_backward_ex needs; 0 for invalid arguments or a layer the GPU
 * kernels do not compute. */
ATTNGRAD_API size_t attngrad_workspace_size_ex(const attngrad_layer* layer, int batch, int seq_len,
                                               int precision);
/* attngrad_backward for `layer` (ATTNGRAD_UNSUPPORTED for a layer the GPU kernels do not compute).
 */
ATTNGRAD_API int attngrad_backward_ex(const attngrad_layer* layer, int batch, int seq_len,
                                      int precision, int accumulate, const attngrad_inputs* inputs,
                                      const attngrad_outputs* outputs, void* workspace,
                                      size_t workspace_size, void* stream);
/* attngrad_backward_host for `layer` (any valid layer). */
ATTNGRAD_API int attngrad_backward_host_ex(const attngrad_layer* layer, int batch, int seq_len,
                                           int accumulate, const attngrad_inputs* inputs,
                                           const attngrad_outputs* outputs);

/* A static, human-readable name for a status code ("ATTNGRAD_OK", ...; "unknown status" otherwise).
 */
ATTNGRAD_API const char* attngrad_status_string(int status);

/* Number of CUDA devices this library can use (0 when built without CUDA or when none is present).
 */
ATTNGRAD_API int attngrad_device_count(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNGRAD_ATTNGRAD_H_ */
