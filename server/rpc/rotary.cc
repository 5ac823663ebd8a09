// Rotary tables from positions.
#include "rpc/rotary.h"

#include <cmath>
#include <cstddef>
#include <vector>

namespace attngrad::server {

void BuildRotaryTables(absl::Span<const std::int64_t> positions, int batch, int seq_len,
                       int head_dim, double theta, absl::Span<float> cos, absl::Span<float> sin) {
  const int half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * i / head_dim);
  const bool shared = positions.size() == static_cast<std::size_t>(seq_len);
  for (int b = 0; b < batch; ++b) {
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
