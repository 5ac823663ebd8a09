// cos/sin tables of rotate-half RoPE built from position ids (SPEC section 3): for i < head_dim/2,
// inv_freq_i = theta^(-2i/head_dim), f_i = position * inv_freq_i, the embedding is [f, f] and the
// tables are cos/sin of it, computed in double and rounded to fp32.
#ifndef ATTNGRAD_SERVER_ROTARY_H_
#define ATTNGRAD_SERVER_ROTARY_H_

#include <cstdint>

#include "absl/types/span.h"

namespace attngrad::server {

// Fills cos and sin [batch, seq_len, head_dim]. `positions` holds batch*seq_len ids, or seq_len ids
// shared by every sequence. theta > 0.
void BuildRotaryTables(absl::Span<const std::int64_t> positions, int batch, int seq_len,
                       int head_dim, double theta, absl::Span<float> cos, absl::Span<float> sin);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_ROTARY_H_
