// An independent float64 evaluation of SPEC.md section 2 for the CPU tests: the forward (steps 1-4
// and the layer output A Woᵀ) and the backward (steps 5-9), in plain loops, for any LayerConfig.
// It shares no code with kernels/src/: it is what the CPU backend is checked against.
#ifndef ATTNGRAD_TESTS_CPU_REFERENCE_H_
#define ATTNGRAD_TESTS_CPU_REFERENCE_H_

#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "attngrad/backward.h"

namespace attngrad_test {

// The ten inputs of SPEC section 1 in float64 (row-major, SPEC's shapes), with the shape and
// scalars.
struct Inputs64 {
  attngrad::LayerConfig config;
  int batch = 1;
  int seq_len = 1;
  double scaling = 0.0;
  double softcap = 0.0;    // <= 0: no soft-capping
  int sliding_window = 0;  // > 0: keys j with i - window < j <= i only
  double eps = 0.0;
  std::vector<double> grad_output, hidden_states, cos, sin;
  attngrad::PerWeight<std::vector<double>> weights;
};

// The seven outputs, in SPEC order. Element type float (backend) or double (reference).
inline constexpr int kNumGradients = 7;
inline const std::array<const char*, kNumGradients> kGradientNames = {
    "grad_hidden_states", "grad_q_weight",      "grad_k_weight",     "grad_v_weight",
    "grad_o_weight",      "grad_q_norm_weight", "grad_k_norm_weight"};

// Index in Gradients of the first weight gradient; the six follow in attngrad::Weight order.
inline constexpr int kFirstWeightGradient = 1;

template <typename T>
struct Gradients {
  std::array<std::vector<T>, kNumGradients> tensors;
  std::vector<T>& operator[](int i) { return tensors[static_cast<std::size_t>(i)]; }
  const std::vector<T>& operator[](int i) const { return tensors[static_cast<std::size_t>(i)]; }
};

// Element counts of the seven outputs for a shape, in SPEC order.
std::array<std::size_t, kNumGradients> GradientSizes(const attngrad::LayerConfig& config, int batch,
                                                     int seq_len);

// layer_output = A Woᵀ [B,S,hidden] (steps 1-4 and the output projection).
std::vector<double> ReferenceLayerOutput(const Inputs64& in);

// L = sum(grad_output ⊙ layer_output): the scalar whose gradients the backward computes.
double ReferenceLoss(const Inputs64& in);

// max over batch, query head and causal (i, j) of |s| = |q'·k'| · scaling (step 4, before the cap):
// tells a test whether its soft-cap bites (|s| / cap ≳ 1).
double ReferenceMaxAbsScore(const Inputs64& in);

// Steps 1-9: the seven gradients.
Gradients<double> ReferenceBackward(const Inputs64& in);

}  // namespace attngrad_test

#endif  // ATTNGRAD_TESTS_CPU_REFERENCE_H_
