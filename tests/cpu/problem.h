// Test support for the CPU suite (and the GPU forward's test): random inputs of SPEC.md section 3
// for any LayerConfig, calls of the CPU backend into owned buffers, and the comparison of fp32
// results with float64 references.
#ifndef ATTNGRAD_TESTS_CPU_PROBLEM_H_
#define ATTNGRAD_TESTS_CPU_PROBLEM_H_

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/backward.h"
#include "attngrad/forward.h"
#include "reference.h"

namespace attngrad_test {

struct ProblemOptions {
  double norm_weight_std = 0.02;  // SPEC: randn * 0.02
  // true: each sequence its own random positions (random start, random gaps), so cos/sin differ
  // across the batch in a way RoPE's shift invariance does not hide; false: 0..S-1 for all.
  bool distinct_positions = true;
  double rope_theta = 10000.0;
  // >= 0: this token's hidden_states row (token = b*S + s) is all zeros, like a padding token:
  // q = k = v = 0 there, so RMSNorm runs on eps alone (r = 1/sqrt(eps)).
  int zero_token = -1;
};

// One backward call's fp32 inputs, shape and scalars.
struct Problem {
  attngrad::LayerConfig config;
  int batch = 1;
  int seq_len = 1;
  attngrad::Scalars scalars;
  std::vector<float> grad_output, hidden_states, cos, sin;
  attngrad::PerWeight<std::vector<float>> weights;

  attngrad::BackwardInputs Inputs() const;
  // The same values widened to float64 (scalars too) for the reference.
  Inputs64 Widened() const;
};

// SPEC section 3's distribution with `hidden_size` in place of 3072: hidden_states randn/sqrt(H),
// grad_output randn, projection weights randn*sqrt(2/H), norm weights randn*norm_weight_std,
// cos/sin of rotate-half RoPE at each sequence's positions (see ProblemOptions).
Problem MakeProblem(const attngrad::LayerConfig& config, int batch, int seq_len,
                    const attngrad::Scalars& scalars, std::uint64_t seed,
                    const ProblemOptions& options = ProblemOptions());

// Output buffers of the right sizes, every element set to `fill`.
Gradients<float> MakeOutputBuffers(const attngrad::LayerConfig& config, int batch, int seq_len,
                                   float fill);
attngrad::BackwardOutputs OutputsOf(Gradients<float>& buffers);

// attngrad::BackwardHost on `problem` into `out` (which must already have the right sizes).
attngrad_status RunHost(const Problem& problem, bool accumulate, Gradients<float>& out,
                        int num_threads = 0);

// attngrad::ForwardHost on `problem`: the layer output A Woᵀ [B,S,hidden] into `output` (which must
// already have that size).
attngrad::Status RunForwardHost(const Problem& problem, std::vector<float>& output,
                                int num_threads = 0);

// A seed from a case name (FNV-1a), the same on every platform.
std::uint64_t SeedOf(const std::string& name);

// SPEC's scalars (soft-cap 50, eps 1e-6) with scaling 1/sqrt(head_dim).
attngrad::Scalars DefaultScalarsFor(int head_dim);

// fp32 against float64. All three must hold, and every element must be finite:
//   ||got - ref|| <= rel_norm * ||ref||                      (the tensor as a whole)
//   |got_i - ref_i| <= atol_rms * rms(ref) + rtol * |ref_i|   (every element)
// For a reference that is identically zero, every |got_i| <= zero_atol instead.
struct Tolerance {
  double rel_norm = 1e-5;
  double rtol = 1e-4;
  double atol_rms = 1e-4;
  double zero_atol =
      1e-6;  // absolute, for a reference that is identically zero (then it is the bar)
};

// The tolerance of an fp32 result (the CPU backend's) for a case whose largest score (step 4,
// before the cap) is MAX_ABS_SCORE. The scores are fp32 numbers: one rounding of a score of
// magnitude m moves it by up to m·2^-24, and softmax turns that absolute error into the same
// relative error of P, and so of every output that P feeds (A, the layer output, every gradient).
// Large scores (scaling 60, up to several hundred) therefore amplify fp32 rounding beyond the
// default bar, and by how much depends on the order in which the BLAS kernel the CPU selects sums
// the dot products. The bar is the default one plus two such roundings of the largest score, which
// no kernel choice exceeds, whatever the CPU.
Tolerance ConditionedTolerance(double max_abs_score);

// Largest errors seen, for messages and for the suite's log.
struct MatchStats {
  double rel_norm_error = 0.0;
  double max_abs_error = 0.0;
  double max_abs_error_over_rms = 0.0;
  double rms_ref = 0.0;
};

template <typename T>
::testing::AssertionResult Matches(const std::string& what, const std::vector<T>& got,
                                   const std::vector<double>& ref, const Tolerance& tolerance,
                                   MatchStats* stats = nullptr);

// All seven outputs; `context` names the case in messages. Logs the worst errors when the
// environment variable ATTNGRAD_TEST_VERBOSE is set.
template <typename T>
::testing::AssertionResult AllMatch(const std::string& context, const Gradients<T>& got,
                                    const Gradients<double>& ref, const Tolerance& tolerance);

// SPEC section 4's rule for one output: every element finite, and at least 99% of them with
// |got - ref| <= atol + 1e-3·|ref| (atol .0067 for the shapes outside SPEC's list of workloads).
::testing::AssertionResult MeetsSpecBar(const std::string& what, const std::vector<float>& got,
                                        const std::vector<double>& ref, double atol = 0.0067);

std::string Describe(const attngrad::LayerConfig& config, int batch, int seq_len,
                     const attngrad::Scalars& scalars);

}  // namespace attngrad_test

#endif  // ATTNGRAD_TESTS_CPU_PROBLEM_H_
