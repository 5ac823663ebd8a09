// Rotary tables from positions.
#include "rpc/rotary.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attngrad::server {
namespace {

// theta^(-2i/head_dim) for i < head_dim/2, in double.
std::vector<double> InverseFrequencies(int head_dim, double theta) {
  const int half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * i / head_dim);
  return inv_freq;
}

// InverseFrequencies divided by a linear scaling factor (> 0; 1 = none).
std::vector<double> ScaledInverseFrequencies(int head_dim, double theta,
                                             double linear_scaling_factor) {
  std::vector<double> inv_freq = InverseFrequencies(head_dim, theta);
  if (linear_scaling_factor > 0 && linear_scaling_factor != 1.0) {
    for (double& frequency : inv_freq) frequency /= linear_scaling_factor;
  }
  return inv_freq;
}

}  // namespace

absl::Status CheckRotaryInputs(absl::Span<const std::int64_t> positions, int head_dim, double theta,
                               double linear_scaling_factor) {
  if (!std::isfinite(theta) || !(theta > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("positions.rope_theta: ", theta, " must be finite and > 0"));
  }
  std::int64_t largest = 0;  // the largest |id|, found without negating (-INT64_MIN overflows)
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const std::int64_t id = positions[i];
    if (id > kMaxRotaryPosition || id < -kMaxRotaryPosition) {
      return absl::InvalidArgumentError(absl::StrCat("positions.position_ids: element ", i, " = ",
                                                     id, " is out of range (|id| <= 2^40)"));
    }
    largest = std::max(largest, id < 0 ? -id : id);
  }
  // The largest angle of each frequency must be finite (cos and sin of a finite double are).
  const std::vector<double> inv_freq =
      ScaledInverseFrequencies(head_dim, theta, linear_scaling_factor);
  for (std::size_t i = 0; i < inv_freq.size(); ++i) {
    if (!std::isfinite(inv_freq[i]) || !std::isfinite(static_cast<double>(largest) * inv_freq[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions.rope_theta: ", theta, " is too small: theta^(-", 2 * i, "/",
                       head_dim, ") (divided by the RoPE scaling factor ", linear_scaling_factor,
                       ") times the largest |position id| (", largest,
                       ") overflows a double, so the rotary tables would not be finite"));
    }
  }
  return absl::OkStatus();
}

void BuildRotaryTables(absl::Span<const std::int64_t> positions, int batch, int seq_len,
                       int head_dim, double theta, absl::Span<float> cos, absl::Span<float> sin,
                       double linear_scaling_factor) {
  const int half = head_dim / 2;
  const std::vector<double> inv_freq =
      ScaledInverseFrequencies(head_dim, theta, linear_scaling_factor);
  const bool shared = positions.size() == static_cast<std::size_t>(seq_len);
  const std::size_t sequence_elements = static_cast<std::size_t>(seq_len) * head_dim;
  for (int b = 0; b < batch; ++b) {
    if (shared && b > 0) {  // every sequence has the first one's positions: the same tables
      std::copy(cos.begin(), cos.begin() + sequence_elements, cos.begin() + b * sequence_elements);
      std::copy(sin.begin(), sin.begin() + sequence_elements, sin.begin() + b * sequence_elements);
      continue;
    }
    for (int s = 0; s < seq_len; ++s) {
      const std::size_t token = static_cast<std::size_t>(b) * seq_len + s;
      const double position = static_cast<double>(positions[shared ? s : token]);
      float* cos_row = cos.data() + token * head_dim;
      float* sin_row = sin.data() + token * head_dim;
      for (int i = 0; i < half; ++i) {
        const double angle = position * inv_freq[i];
        cos_row[i] = cos_row[i + half] = static_cast<float>(std::cos(angle));
        sin_row[i] = sin_row[i + half] = static_cast<float>(std::sin(angle));
      }
    }
  }
}

}  // namespace attngrad::server
