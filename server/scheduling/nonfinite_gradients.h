// The finite check of a batch's gradients before they count (one non-finite batch would turn a sum
// into Inf/NaN for good): the host-side count (the CPU worker's; the GPU worker counts on the
// device, attngrad/finite_check.h) and the in-band error both workers answer when any gradient
// holds NaN or Inf. Such a batch is not added to its window's sums, so finite inputs that overflow
// in the backward pass cannot poison them.
#ifndef ATTNGRAD_SERVER_SCHEDULING_NONFINITE_GRADIENTS_H_
#define ATTNGRAD_SERVER_SCHEDULING_NONFINITE_GRADIENTS_H_

#include <vector>

#include "absl/status/status.h"
#include "attngrad/finite_check.h"
#include "weights/served_weights.h"

namespace attngrad::server {

// NaN and infinite values of grad_hidden_states and of each weight gradient (CountIndexOf order).
NonFiniteCounts CountNonFiniteHost(const std::vector<float>& grad_hidden_states,
                                   const LayerTensors& weight_gradients);

// Adds to counts[OverflowIndexOf(w)] the elements where sums[w] + gradients[w] is not finite: the
// add that would turn a finite sum into Inf.
void CountOverflowingSumsHost(const LayerTensors& sums, const LayerTensors& gradients,
                              NonFiniteCounts* counts);

// OK when every count is 0; else INVALID_ARGUMENT naming each non-finite gradient and how many of
// its values are NaN or infinite, or each window sum the batch would overflow, and saying that
// nothing of the batch was accumulated.
absl::Status NonFiniteGradientsStatus(const NonFiniteCounts& counts);

// OK when a FORWARD batch's output has no NaN or infinite value (`non_finite` of them); else
// INVALID_ARGUMENT naming `output`, how many, and why (finite inputs that overflow fp32).
absl::Status NonFiniteOutputStatus(unsigned long long non_finite);
// The NaN and infinite values of `values` (a FORWARD batch's output, on the host).
unsigned long long CountNonFiniteValues(const std::vector<float>& values);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_SCHEDULING_NONFINITE_GRADIENTS_H_
