// Checks one BackwardRequest field by field against the addressed layer (its shape, and its
// defaults for the scalars, the sliding window and the RoPE base and scaling, which the request's
// fields override) and turns it into a BatchJob: the activations stay in their wire dtype where
// they arrived (ReceivedBackwardRequest, e.g. pieces of gRPC's receive slices), the rotary cos/sin
// come from the request or are built from its positions. Also the byte counts of a request's and
// an answer's tensors. The answer itself is serialized by rpc/raw_request.h.
#ifndef ATTNGRAD_SERVER_BACKWARD_REQUEST_H_
#define ATTNGRAD_SERVER_BACKWARD_REQUEST_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "attngrad/v1/attngrad.pb.h"
#include "scheduling/device_worker.h"
#include "scheduling/wire_tensor.h"
#include "weights/model.h"

namespace attngrad::server {

struct BatchLimits {
  std::int64_t max_batch_tokens = 65536;
  std::int64_t max_message_bytes = 1 << 30;
};

// A BackwardRequest whose activations were left where they arrived: `message` has every field but
// hidden_states.raw_data and grad_output.raw_data, which are `hidden_states` and `grad_output`
// (e.g. pieces of gRPC's receive slices: rpc/raw_request.h).
struct ReceivedBackwardRequest {
  v1::BackwardRequest message;
  WireTensor hidden_states;
  WireTensor grad_output;
  // The rotary tables when they are in a client's GPU memory (cos_region / sin_region); empty
  // otherwise (they are in the message).
  WireTensor cos, sin;
};

// The same request from a parsed message (its raw data moved into owned WireTensors).
ReceivedBackwardRequest ReceivedFromMessage(v1::BackwardRequest message);

// The validated request: the job plus what the response needs.
struct ParsedBackward {
  std::unique_ptr<BatchJob> job;
  bool accumulate = false;
  int response_dtype = v1::DTYPE_FLOAT32;
};

// INVALID_ARGUMENT (naming the field and what was expected) for a malformed request (the
// activations' values are checked to be finite where the worker copies them: see BatchJob);
// `settings` are the addressed layer's defaults (scalars, sliding window, RoPE base and linear
// scaling of position-built tables), which the request's fields override. RESOURCE_EXHAUSTED
// when B*S exceeds max_batch_tokens or the response would exceed
// max_message_bytes (the message says how to split the batch along B).
absl::StatusOr<ParsedBackward> ParseBackwardRequest(ReceivedBackwardRequest request,
                                                    const LayerConfig& config,
                                                    const LayerSettings& settings,
                                                    const BatchLimits& limits);

// The same for the seed's single layer (SPEC defaults: scaling 1/sqrt(head_dim), soft-cap 50, full
// causal attention, RoPE base 10000).
absl::StatusOr<ParsedBackward> ParseBackwardRequest(const v1::BackwardRequest& request,
                                                    const LayerConfig& config,
                                                    const BatchLimits& limits);

// The bytes of the tensors' raw data in a request or a job's answer, for the byte counters.
std::int64_t PayloadBytes(const ReceivedBackwardRequest& request);
std::int64_t PayloadBytes(const BatchJob& job);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_BACKWARD_REQUEST_H_
