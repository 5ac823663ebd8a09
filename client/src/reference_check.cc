// CPU reference of one batch and SPEC section 4's comparison rule.
#include "reference_check.h"

#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attngrad {

absl::StatusOr<ReferenceOutputs> ComputeReference(const LayerConfig& config,
                                                  const BatchInputs& inputs,
                                                  const WeightSet& weights,
                                                  const Scalars& scalars) {
  const TensorSizes sizes =
      SizesOf(config, static_cast<int>(inputs.batch), static_cast<int>(inputs.seq_len));
  if (inputs.hidden_states.size() != sizes.activations ||
      inputs.grad_output.size() != sizes.activations || inputs.cos.size() != sizes.rotary ||
      inputs.sin.size() != sizes.rotary) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: inputs do not match [", inputs.batch, ",", inputs.seq_len,
                     "] for hidden=", config.hidden_size, " head_dim=", config.head_dim));
  }
  ReferenceOutputs out;
  out.grad_hidden_states.resize(sizes.activations);
  BackwardInputs in;
  BackwardOutputs o;
  for (Weight weight : kAllWeights) {
    HostTensor& gradient = out.gradients[weight];
    gradient.shape = weights[weight].shape;
    gradient.data.assign(weights[weight].data.size(), 0.0f);
    in.weights[weight] = weights[weight].data.data();
    o.weight_gradients[weight] = gradient.data.data();
  }
  in.grad_output = inputs.grad_output.data();
  in.hidden_states = inputs.hidden_states.data();
  in.cos = inputs.cos.data();
  in.sin = inputs.sin.data();
  o.grad_hidden_states = out.grad_hidden_states.data();
  const Status status =
      BackwardHost(config, static_cast<int>(inputs.batch), static_cast<int>(inputs.seq_len),
                   scalars, /*accumulate=*/false, in, o);
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("reference: BackwardHost failed: ", status.message,
                                            " (", attngrad_status_string(status.code), ")"));
  }
  return out;
}

double SpecAtol(int64_t batch, int64_t seq_len) {
  static const auto* const table = new std::map<std::pair<int64_t, int64_t>, double>{
      {{1, 128}, .0067}, {{1, 256}, .0070},  {{1, 512}, .0086},  {{1, 2048}, .0071},
      {{2, 512}, .0084}, {{2, 541}, .0079},  {{2, 1024}, .0069}, {{2, 2048}, .0073},
      {{4, 128}, .0081}, {{4, 256}, .0077},  {{4, 1024}, .0083}, {{8, 128}, .0091},
      {{8, 512}, .0089}, {{16, 256}, .0092}, {{32, 128}, .0091}, {{64, 256}, .0099}};
  auto it = table->find({batch, seq_len});
  return it == table->end() ? .0067 : it->second;
}

OutputComparison CompareOutput(const std::string& name, absl::Span<const float> got,
                               absl::Span<const float> reference, double atol,
                               bool allow_one_miss) {
  OutputComparison c;
  c.name = name;
  c.elements = static_cast<int64_t>(reference.size());
  if (got.size() != reference.size()) {
    c.misses = c.elements;
    return c;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = reference[i];
    if (!std::isfinite(g)) {
      ++c.non_finite;
      ++c.misses;
      continue;
    }
    const double error = std::fabs(g - r);
    c.max_abs_error = std::max(c.max_abs_error, error);
    c.max_abs_reference = std::max(c.max_abs_reference, std::fabs(r));
    if (!(error <= atol + 1e-3 * std::fabs(r))) ++c.misses;
  }
  c.passed = c.non_finite == 0 &&
             (allow_one_miss ? c.misses <= 1 : c.misses * 100 <= c.elements);  // >= 99% match
  return c;
}

bool CheckReport::passed() const {
  if (outputs.empty()) return false;
  for (const OutputComparison& c : outputs) {
    if (!c.passed) return false;
  }
  return true;
}

std::string CheckReport::ToString() const {
  std::string text;
  for (const OutputComparison& c : outputs) {
    absl::StrAppendFormat(
        &text,
        "  %-20s %s  %10d elements, %d outside tolerance (%.4f%%), %d non-finite, "
        "max |err| %.3g (max |ref| %.3g)\n",
        c.name, c.passed ? "PASS" : "FAIL", c.elements, c.misses,
        c.elements ? 100.0 * c.misses / c.elements : 0.0, c.non_finite, c.max_abs_error,
        c.max_abs_reference);
  }
  return text;
}

CheckReport CheckAgainstReference(absl::Span<const float> grad_hidden_states,
                                  const WeightSet* gradients, const ReferenceOutputs& reference,
                                  double atol) {
  CheckReport report;
  report.outputs.push_back(CompareOutput("grad_hidden_states", grad_hidden_states,
                                         reference.grad_hidden_states, atol, false));
  if (gradients != nullptr) {
    for (Weight weight : kAllWeights) {
      const bool norm = weight == Weight::kQNorm || weight == Weight::kKNorm;
      report.outputs.push_back(CompareOutput(absl::StrCat("grad_", WeightModuleName(weight)),
                                             (*gradients)[weight].data,
                                             reference.gradients[weight].data, atol, norm));
    }
  }
  return report;
}

void AddInto(const WeightSet& b, WeightSet* a) {
  for (Weight weight : kAllWeights) {
    HostTensor& target = (*a)[weight];
    const HostTensor& source = b[weight];
    if (target.data.empty()) {
      target = source;
      continue;
    }
    for (size_t i = 0; i < target.data.size() && i < source.data.size(); ++i) {
      target.data[i] += source.data[i];
    }
  }
}

}  // namespace attngrad
