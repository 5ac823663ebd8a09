// cos/sin tables of rotate-half RoPE built from position ids (SPEC section 3): for i < head_dim/2,
// inv_freq_i = theta^(-2i/head_dim), f_i = position * inv_freq_i, the embedding is [f, f] and the
// tables are cos/sin of it, computed in double and rounded to fp32. CheckRotaryInputs says whether
// given ids and theta make finite tables; BuildRotaryTables expects inputs that passed it.
#ifndef ATTNGRAD_SERVER_ROTARY_H_
#define ATTNGRAD_SERVER_ROTARY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace attngrad::server {

// The largest |position id| accepted.
inline constexpr std::int64_t kMaxRotaryPosition = std::int64_t{1} << 40;

// INVALID_ARGUMENT, naming positions.position_ids or positions.rope_theta, when a position id is
// outside [-2^40, 2^40] (INT64_MIN included), when theta is not finite and > 0, or when theta is so
// small that theta^(-2i/head_dim) or some position * theta^(-2i/head_dim) overflows (a subnormal
// theta such as 5e-324), which would make the tables NaN. head_dim must be even and > 0;
// linear_scaling_factor (> 0) as in BuildRotaryTables.
absl::Status CheckRotaryInputs(absl::Span<const std::int64_t> positions, int head_dim, double theta,
                               double linear_scaling_factor = 1.0);

// Fills cos and sin [batch, seq_len, head_dim]. `positions` holds batch*seq_len ids, or seq_len ids
// shared by every sequence; the ids and theta have passed CheckRotaryInputs. linear_scaling_factor
// (> 0): Hugging Face's "linear" rope_scaling, every inverse frequency divided by it (1 = none).
void BuildRotaryTables(absl::Span<const std::int64_t> positions, int batch, int seq_len,
                       int head_dim, double theta, absl::Span<float> cos, absl::Span<float> sin,
                       double linear_scaling_factor = 1.0);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_ROTARY_H_
