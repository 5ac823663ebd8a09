// Prepared weights: one layer's projection weights converted once, for many GPU backward calls.
//
// A plain BackwardDevice call in FP16 (or AUTO) mode rounds the four fp32 projection weights
// (q/k/v/o_proj: 25.2 M elements for the SPEC layer) to fp16 every time, ~47 µs on an H200 (most
// of a 1×128 call). A caller whose weights change rarely (a server between weight versions, a
// training step's many micro-batches) prepares them once and passes the PreparedWeights instead:
// the calls run the same arithmetic on the same fp16 values, without the conversion, so their
// results are bitwise equal to the plain call's in every precision mode.
//
// What a PreparedWeights holds, per precision mode of the calls that use it:
//   FP16 and AUTO (which resolves to FP16): the fp16 copies it owns, in the layout the projection
//     GEMMs read ([Wq; Wk; Wv] as one row-major [q_out + 2 kv_out, hidden] matrix, then Wo
//     [hidden, q_out]), 2 bytes per projection weight element (half the fp32 weights' memory);
//     plus, read at every call, the fp32 q_norm/k_norm weights of `source()`.
//   FP32 and TF32: nothing of its own; those modes read the fp32 weights of `source()` (the
//     caller's, not copied).
// So the caller's fp32 weights must stay allocated, at the same addresses, for as long as the
// PreparedWeights is used; when their contents change, Prepare again (the same object reuses its
// memory), else FP16 calls keep using the old values. Nothing can tell that the fp32 contents
// changed (it would cost a read of the weights per call, the very cost prepared weights remove).
//
//   attngrad::PreparedWeights prepared;
//   Status status = prepared.Prepare(config, fp32_weights, stream);   // enqueued on `stream`
//   ... attngrad::BackwardDevice(prepared, batch, seq_len, scalars, precision, accumulate, in,
//                                 out, workspace, workspace_size, stream);
//
// Ordering: Prepare enqueues the conversion on `stream` and returns; calls on other streams must
// be ordered after it (an event, or a stream synchronisation), and a Prepare that rewrites an
// object's copies must be ordered after the calls still reading them.
#ifndef ATTNGRAD_PREPARED_WEIGHTS_H_
#define ATTNGRAD_PREPARED_WEIGHTS_H_

#include <cstddef>
#include <memory>

#include "attngrad/backward.h"
#include "attngrad/layer_config.h"
#include "attngrad/layer_weights.h"

namespace attngrad {

// Owns the device memory of the fp16 copies (cudaMalloc'd on the device current at Prepare,
// cudaFree'd in the destructor, when a Prepare for another configuration replaces it, or when a
// move assignment gives the object other copies). Move-only; an empty (default or moved-from)
// object is not ready() and is refused by the calls.
class ATTNGRAD_API PreparedWeights {
 public:
  PreparedWeights() = default;
  PreparedWeights(const PreparedWeights&) = delete;
  PreparedWeights& operator=(const PreparedWeights&) = delete;
  PreparedWeights(PreparedWeights&&) noexcept = default;
  PreparedWeights& operator=(PreparedWeights&&) noexcept = default;
  ~PreparedWeights() = default;

  // Converts the four projection weights of `weights` (device pointers, WeightShape(config, w)
  // each; all six must be set, q_norm/k_norm 16-byte aligned) to fp16 on `stream` (a
  // cudaStream_t) and remembers the six pointers as source(). Allocates on the first call and when
  // the configuration changes, else rewrites the same memory (so the pointers the calls' CUDA
  // graphs were captured with stay valid). ATTNGRAD_UNSUPPORTED for a configuration the GPU
  // kernels do not support or a build without CUDA; ATTNGRAD_CUDA_ERROR when the allocation or the
  // launch fails (the object is then empty).
  Status Prepare(const LayerConfig& config, const PerWeight<const float*>& weights, void* stream);

  bool ready() const { return half_ != nullptr; }
  const LayerConfig& config() const { return config_; }
  // The fp32 weights it was prepared from (what FP32/TF32 calls and the norm weights read).
  const PerWeight<const float*>& source() const { return source_; }
  // Device memory it owns, in bytes (0 when empty).
  std::size_t device_bytes() const { return half_ == nullptr ? 0 : CopiesBytes(config_); }
  // The fp16 copies (device memory; null when empty): [Wq; Wk; Wv] row-major
  // [q_out + 2 kv_out, hidden], and Wo [hidden, q_out] right after it.
  const void* half_qkv() const { return half_.get(); }
  const void* half_o() const {
    return half_ == nullptr ? nullptr
                            : static_cast<const unsigned char*>(half_.get()) + OffsetOfO(config_);
  }
  // Bytes from the start of the copies to Wo's: [Wq; Wk; Wv] in fp16, rounded up to 256 bytes (the
  // alignment the workspace gives it in a plain call, which cuBLASLt's choice of algorithm sees).
  static std::size_t OffsetOfO(const LayerConfig& config) {
    const std::size_t qkv_bytes = static_cast<std::size_t>(config.q_out() + 2 * config.kv_out()) *
                                  static_cast<std::size_t>(config.hidden_size) * 2;
    return (qkv_bytes + 255) / 256 * 256;
  }

 private:
  // Bytes of the copies: [Wq; Wk; Wv], then Wo at OffsetOfO.
  static std::size_t CopiesBytes(const LayerConfig& config) {
    return OffsetOfO(config) + static_cast<std::size_t>(config.hidden_size) *
                                   static_cast<std::size_t>(config.q_out()) * 2;
  }

  // Frees device memory (cudaFree); defined in the library, so that this header needs none of the
  // CUDA runtime's headers (a build without CUDA includes it too).
  struct ATTNGRAD_API DeviceMemoryRelease {
    void operator()(void* pointer) const noexcept;
  };
  // The device buffer that owns the fp16 copies: freed when it is reset, replaced or destroyed.
  // (cuda_resources.h's DeviceBuffer does the same, but needs the CUDA runtime's headers.)
  using DeviceMemory = std::unique_ptr<void, DeviceMemoryRelease>;

  LayerConfig config_{};
  PerWeight<const float*> source_{};
  DeviceMemory half_;
};

// The workspace a call with prepared weights needs (less than DeviceWorkspaceSize's: no room for
// the fp16 weights); 0 for invalid arguments or an empty `weights`.
ATTNGRAD_API std::size_t DeviceWorkspaceSize(const PreparedWeights& weights, int batch, int seq_len,
                                             Precision precision);

// BackwardDevice (backward.h) with prepared weights: the configuration is weights.config();
// in.weights must be weights.source() (else ATTNGRAD_INVALID_ARGUMENT, "in.weights are not the
// weights the PreparedWeights were prepared from"); the workspace must hold
// DeviceWorkspaceSize(weights, batch, seq_len, precision). Same results, bit for bit, as
// BackwardDevice(weights.config(), ..., in, ...) on the weights as they were at Prepare; the same
// asynchrony, determinism, graph replay and capturability.
ATTNGRAD_API Status BackwardDevice(const PreparedWeights& weights, int batch, int seq_len,
                                   const Scalars& scalars, Precision precision, bool accumulate,
                                   const BackwardInputs& in, const BackwardOutputs& out,
                                   void* workspace, std::size_t workspace_size, void* stream);

}  // namespace attngrad

#endif  // ATTNGRAD_PREPARED_WEIGHTS_H_
