// Requests read from the bytes gRPC received (the service takes Backward and LoadWeights as raw
// grpc::ByteBuffers, so that a message that does not parse is its own error to answer, and so that
// a batch's activations are never copied out of gRPC's receive buffers on the gRPC thread).
#ifndef ATTNGRAD_SERVER_RAW_REQUEST_H_
#define ATTNGRAD_SERVER_RAW_REQUEST_H_

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "attngrad/v1/attngrad.pb.h"
#include "scheduling/wire_tensor.h"

namespace attngrad::server {

// A BackwardRequest whose activations were left where they arrived: `message` has every field but
// hidden_states.raw_data and grad_output.raw_data, which are `hidden_states` and `grad_output`
// (pieces of the received slices; dtype set from the message).
struct ReceivedBackwardRequest {
  v1::BackwardRequest message;
  WireTensor hidden_states;
  WireTensor grad_output;
};

// Walks the message's fields on the received slices (protobuf's wire format: the last raw_data of
// a tensor wins, as when protobuf merges repeated occurrences) and parses everything else with
// protobuf. INVALID_ARGUMENT ("the message does not parse as an attngrad.v1.BackwardRequest")
// for bytes that are not one: the stream must end then.
absl::StatusOr<ReceivedBackwardRequest> ParseReceivedBackwardRequest(const grpc::ByteBuffer& bytes);

// The same request from a parsed message (its raw data moved into owned WireTensors).
ReceivedBackwardRequest ReceivedFromMessage(v1::BackwardRequest message);

// A whole message parsed from received bytes; INVALID_ARGUMENT naming the type when they do not
// parse as one.
absl::Status ParseReceivedMessage(grpc::ByteBuffer* bytes, google::protobuf::Message* message);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RAW_REQUEST_H_
