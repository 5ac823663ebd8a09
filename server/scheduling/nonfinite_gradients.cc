// The host-side count of non-finite gradients and the in-band error of a non-finite batch.
#include "scheduling/nonfinite_gradients.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attngrad::server {
namespace {

unsigned long long CountNonFinite(const std::vector<float>& values) {
  unsigned long long count = 0;
  for (float value : values) count += std::isfinite(value) ? 0 : 1;
  return count;
}

}  // namespace

unsigned long long CountNonFiniteValues(const std::vector<float>& values) {
  return CountNonFinite(values);
}

absl::Status NonFiniteOutputStatus(unsigned long long non_finite) {
  if (non_finite == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "output: ", non_finite,
      " values of the layer's output are not finite (NaN or infinite): its inputs are finite but "
      "overflow fp32 in the forward pass (scale hidden_states down)"));
}

NonFiniteCounts CountNonFiniteHost(const std::vector<float>& grad_hidden_states,
                                   const LayerTensors& weight_gradients) {
  NonFiniteCounts counts{};
  counts[0] = CountNonFinite(grad_hidden_states);
  for (Weight weight : kAllWeights) {
    counts[CountIndexOf(weight)] = CountNonFinite(weight_gradients[weight]);
  }
  return counts;
}

void CountOverflowingSumsHost(const LayerTensors& sums, const LayerTensors& gradients,
                              NonFiniteCounts* counts) {
  for (Weight weight : kAllWeights) {
    const std::vector<float>& sum = sums[weight];
    const std::vector<float>& gradient = gradients[weight];
    unsigned long long count = 0;
    for (std::size_t i = 0; i < sum.size() && i < gradient.size(); ++i) {
      count += std::isfinite(sum[i] + gradient[i]) ? 0 : 1;
    }
    (*counts)[OverflowIndexOf(weight)] += count;
  }
}

absl::Status NonFiniteGradientsStatus(const NonFiniteCounts& counts) {
  std::vector<std::string> parts;
  if (counts[0] != 0) parts.push_back(absl::StrCat("grad_hidden_states ", counts[0]));
  for (Weight weight : kAllWeights) {
    const unsigned long long count = counts[CountIndexOf(weight)];
    if (count != 0) parts.push_back(absl::StrCat(WeightModuleName(weight), " ", count));
  }
  if (!parts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the batch's gradients are not finite (NaN or infinite values: ",
        absl::StrJoin(parts, ", "),
        "): its inputs are finite but overflow fp32 in the backward pass (scale grad_output or "
        "hidden_states down); nothing of this batch was accumulated (an ACCUMULATE batch_id stays "
        "free for a retry)"));
  }
  // Finite gradients whose add would overflow the window's sums.
  std::vector<std::string> overflows;
  for (Weight weight : kAllWeights) {
    const unsigned long long count = counts[OverflowIndexOf(weight)];
    if (count != 0) overflows.push_back(absl::StrCat(WeightModuleName(weight), " ", count));
  }
  if (overflows.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "adding this batch's weight gradients would overflow the window's fp32 sums (values that "
      "would become infinite: ",
      absl::StrJoin(overflows, ", "),
      "); nothing of this batch was accumulated and the sums stay as they were (fetch and zero "
      "the window, or scale grad_output down)"));
}

}  // namespace attngrad::server
