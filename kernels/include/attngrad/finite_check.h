// The finite check of one backward call's gradients, before they are added to a sum: finite inputs
// can still give non-finite gradients (grad_output near FLT_MAX overflows the GEMMs), and one such
// batch added to an accumulator turns it into Inf/NaN for good. The check counts the NaN and
// infinite values of grad_hidden_states and of each weight gradient; the add happens only when
// every count is 0. GPU entry points: device pointers, asynchronous on a stream; the counts stay on
// the device between the two calls, so nothing waits for the host in between. The CPU backend's
// caller counts on the host (server/scheduling/finite_check.h).
#ifndef ATTNGRAD_FINITE_CHECK_H_
#define ATTNGRAD_FINITE_CHECK_H_

#include <array>
#include <cstddef>

#include "attngrad/backward.h"
#include "attngrad/layer_weights.h"

namespace attngrad {

// The counts of one batch's check: non-finite values per gradient, [0] grad_hidden_states and
// [CountIndexOf(w)] weight gradient w; then [OverflowIndexOf(w)], the values of accumulator w that
// adding weight gradient w would turn non-finite (finite gradients whose sum overflows fp32).
inline constexpr int kCheckedGradients = 1 + kNumWeights;
inline constexpr int kCheckedCounts = kCheckedGradients + kNumWeights;
using NonFiniteCounts = std::array<unsigned long long, kCheckedCounts>;
constexpr int CountIndexOf(Weight weight) { return 1 + IndexOf(weight); }
constexpr int OverflowIndexOf(Weight weight) { return kCheckedGradients + IndexOf(weight); }

// Adds to counts[i] (kCheckedCounts device values, zeroed by the caller) the number of NaN and
// infinite values of grad_hidden_states ([activations] floats) and of the six weight gradients
// (WeightElements(config, w) floats each). Without CUDA: ATTNGRAD_UNSUPPORTED.
ATTNGRAD_API Status CountNonFiniteDevice(const LayerConfig& config, const float* grad_hidden_states,
                                         std::size_t activations,
                                         const PerWeight<const float*>& weight_gradients,
                                         unsigned long long* counts, void* stream);

// Adds to counts[OverflowIndexOf(w)] the number of elements i where accumulators[w][i] +
// gradients[w][i] is not finite, for the six weights (device pointers, on `stream`). Without
// CUDA: ATTNGRAD_UNSUPPORTED.
ATTNGRAD_API Status CountOverflowingSumsDevice(const LayerConfig& config,
                                               const PerWeight<const float*>& gradients,
                                               const PerWeight<const float*>& accumulators,
                                               unsigned long long* counts, void* stream);

// accumulators[w] += gradients[w] element-wise for the six weights, on the device, when every one
// of the kCheckedCounts device counts is 0 (as CountNonFiniteDevice and CountOverflowingSumsDevice
// left them, earlier on the same stream); otherwise the accumulators are left as they were, so a
// sum stays finite and exact. Without CUDA: ATTNGRAD_UNSUPPORTED.
ATTNGRAD_API Status AccumulateIfFiniteDevice(const LayerConfig& config,
                                             const PerWeight<const float*>& gradients,
                                             const PerWeight<float*>& accumulators,
                                             const unsigned long long* counts, void* stream);

}  // namespace attngrad

#endif  // ATTNGRAD_FINITE_CHECK_H_
