// The local CPU reference (attngrad::BackwardHost) of one batch and the correctness rule of SPEC
// section 4: per output, at least 99% of the elements within atol + 1e-3*|ref| (atol by workload),
// no NaN/Inf, and at most one miss in each 128-element norm-weight gradient.
#ifndef ATTNGRAD_CLIENT_SRC_REFERENCE_CHECK_H_
#define ATTNGRAD_CLIENT_SRC_REFERENCE_CHECK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attngrad/backward.h"
#include "attngrad/client.h"
#include "random_tensors.h"

namespace attngrad {

struct ReferenceOutputs {
  std::vector<float> grad_hidden_states;  // [B,S,hidden]
  WeightSet gradients;
};

// BackwardHost on `inputs` with `weights` (fp32, the scalars given).
absl::StatusOr<ReferenceOutputs> ComputeReference(const LayerConfig& config,
                                                  const BatchInputs& inputs,
                                                  const WeightSet& weights,
                                                  const Scalars& scalars = Scalars());

// SPEC section 4 atol for a workload (the table; .0067 for other shapes).
double SpecAtol(int64_t batch, int64_t seq_len);

struct OutputComparison {
  std::string name;
  int64_t elements = 0;
  int64_t misses = 0;
  int64_t non_finite = 0;
  double max_abs_error = 0;
  double max_abs_reference = 0;
  bool passed = false;
};

// One output against its reference. Norm-weight gradients (`allow_one_miss`) may miss one element;
// the others need >= 99% matching.
OutputComparison CompareOutput(const std::string& name, absl::Span<const float> got,
                               absl::Span<const float> reference, double atol, bool allow_one_miss);

struct CheckReport {
  std::vector<OutputComparison> outputs;
  bool passed() const;
  std::string ToString() const;  // one line per output
};

// Checks grad_hidden_states and, when `gradients` is given, the six weight gradients.
CheckReport CheckAgainstReference(absl::Span<const float> grad_hidden_states,
                                  const WeightSet* gradients, const ReferenceOutputs& reference,
                                  double atol);

// Elementwise a += b over the six tensors (shapes must match).
void AddInto(const WeightSet& b, WeightSet* a);

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_SRC_REFERENCE_CHECK_H_
