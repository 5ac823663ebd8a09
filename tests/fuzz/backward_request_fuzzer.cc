// libFuzzer target: request validation of a Backward batch (server/rpc/backward_request.h,
// ParseBackwardRequest). The input is a serialized attngrad.v1.BackwardRequest; it is validated
// against a small layer (hidden 8, 2 heads, 1 KV head; head_dim 128 as the real one, so that the
// rotary tables' exponents are the real ones) and a 64-token limit, so that valid requests are
// small. An accepted request must have made correctly sized tensors, and finite rotary tables (the
// activations' values are checked where the device worker copies them).
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attngrad/v1/attngrad.pb.h"
#include "rpc/backward_request.h"

namespace {

bool AllFinite(const std::vector<float>& values) {
  for (float value : values) {
    if (!std::isfinite(value)) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  attngrad::v1::BackwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  attngrad::LayerConfig config;
  config.hidden_size = 8;
  config.num_heads = 2;
  config.num_kv_heads = 1;
  config.head_dim = 128;
  attngrad::server::BatchLimits limits;
  limits.max_batch_tokens = 64;
  limits.max_message_bytes = 1 << 20;
  absl::StatusOr<attngrad::server::ParsedBackward> parsed =
      attngrad::server::ParseBackwardRequest(request, config, limits);
  if (!parsed.ok()) return 0;
  const attngrad::server::BatchJob& job = *parsed->job;
  const std::size_t tokens = static_cast<std::size_t>(job.request.batch) * job.request.seq_len;
  if (job.request.batch < 1 || job.request.seq_len < 1 || tokens > 64) __builtin_trap();
  if (job.request.hidden_states.elements() != tokens * 8 ||
      job.request.grad_output.elements() != tokens * 8 || job.request.cos.size() != tokens * 128 ||
      job.request.sin.size() != tokens * 128) {
    __builtin_trap();
  }
  // Finite inputs that built NaN rotary tables were once accepted: the tables must be finite.
  if (!AllFinite(job.request.cos) || !AllFinite(job.request.sin)) {
    __builtin_trap();
  }
  return 0;
}
