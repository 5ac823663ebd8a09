// Test support for the CPU suite: random inputs of SPEC.md section 3 for any LayerConfig, calls of
// the CPU backend into owned buffers, and the comparison of fp32 results with float64 references.
#ifndef ATTNGRAD_TESTS_CPU_PROBLEM_H_
#define ATTNGRAD_TESTS_CPU_PROBLEM_H_

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/backward.h"
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

std::string Describe(const attngrad::LayerConfig& config, int batch, int seq_len,
                     const attngrad::Scalars& scalars);

}  // namespace attngrad_test

#endif  // ATTNGRAD_TESTS_CPU_PROBLEM_H_
