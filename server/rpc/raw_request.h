// Requests read from, and answers written as, the bytes gRPC moves (the service takes every method
// as raw grpc::ByteBuffers, so that a message that does not parse is its own error to answer, and
// for Backward so that a batch's activations are never copied out of gRPC's receive buffers on the
// gRPC thread, nor its answer into a serialized message).
#ifndef ATTNGRAD_SERVER_RAW_REQUEST_H_
#define ATTNGRAD_SERVER_RAW_REQUEST_H_

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "attngrad/v1/attngrad.pb.h"
#include "rpc/backward_request.h"

namespace attngrad::server {

// Walks the message's fields on the received slices (protobuf's wire format: the last raw_data of
// a tensor wins, as when protobuf merges repeated occurrences) and parses everything else with
// protobuf. INVALID_ARGUMENT ("the message does not parse as an attngrad.v1.BackwardRequest")
// for bytes that are not one: the stream must end then.
absl::StatusOr<ReceivedBackwardRequest> ParseReceivedBackwardRequest(const grpc::ByteBuffer& bytes);

// A whole message parsed from received bytes; INVALID_ARGUMENT naming the type when they do not
// parse as one.
absl::Status ParseReceivedMessage(grpc::ByteBuffer* bytes, google::protobuf::Message* message);

// The request of a call of `method` (a unary or server-streaming method, taken as raw bytes so
// that this, not gRPC's UNIMPLEMENTED without a message, answers a bad request): INVALID_ARGUMENT
// naming the method and the request type when the bytes do not parse as one, or when no whole
// request arrived (the call ended inside or before its message).
absl::Status ParseCallRequest(const grpc::ByteBuffer& bytes, const char* method,
                              google::protobuf::Message* request);

// The response of a finished job: `response`'s fields (batch id, versions, ...) plus the job's
// outputs (grad_hidden_states, RETURN weight gradients, or a FORWARD batch's output, in the job's
// response dtype, and its timings), serialized without copying the outputs: their bytes go out as
// slices of the job's answer buffer (BatchJob::Result::answer), which the returned buffer keeps
// alive until gRPC has sent it. Byte for byte protobuf's serialization of the whole response
// (wire::SerializeWithPayloads). With `grad_hidden_states_in_region` (grad_hidden_states or,
// FORWARD, the output) / `weight_gradients_in_region` (those outputs were written into a region:
// rpc/regions.h) those tensors have their dtype and shape only.
grpc::ByteBuffer SerializeBackwardResponse(v1::BackwardResponse response, BatchJob& job,
                                           bool grad_hidden_states_in_region = false,
                                           bool weight_gradients_in_region = false);
// A message as bytes to send (an error answer, a LoadWeightsResponse).
grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RAW_REQUEST_H_
