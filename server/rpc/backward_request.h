// Checks one BackwardRequest field by field and turns it into a BatchJob (fp32 host tensors,
// cos/sin built from positions when asked), and turns a finished BatchJob into a BackwardResponse.
#ifndef ATTNGRAD_SERVER_BACKWARD_REQUEST_H_
#define ATTNGRAD_SERVER_BACKWARD_REQUEST_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include <grpcpp/support/byte_buffer.h>

#include "attngrad/v1/attngrad.pb.h"
#include "rpc/raw_request.h"
#include "scheduling/device_worker.h"
#include "weights/model.h"

namespace attngrad::server {

struct BatchLimits {
  std::int64_t max_batch_tokens = 65536;
  std::int64_t max_message_bytes = 1 << 30;
};

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

// The response of a finished job: `response`'s fields (batch id, versions, ...) plus the job's
// outputs (grad_hidden_states, RETURN weight gradients, in the job's response dtype, and its
// timings), serialized without copying the outputs: their bytes go out as slices of the job's
// answer buffer (BatchJob::answer), which the returned buffer keeps alive until gRPC has sent it.
// The tensors' dtype and shape are encoded in `response`'s fields and their raw_data in a second
// occurrence of each (protobuf parsers merge the two).
grpc::ByteBuffer SerializeBackwardResponse(v1::BackwardResponse response, BatchJob& job);
// A response without tensors (an error).
grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message);

// The bytes of the tensors' raw data in a request or a job's answer, for the byte counters.
std::int64_t PayloadBytes(const ReceivedBackwardRequest& request);
std::int64_t PayloadBytes(const BatchJob& job);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_BACKWARD_REQUEST_H_
