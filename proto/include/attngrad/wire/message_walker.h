// The protobuf wire format of attngrad messages, read and written with the big bytes fields
// (Tensor.raw_data) kept where they lie: a serialized message walked field by field on any number
// of pieces (e.g. gRPC's receive slices), and a message serialized around raw_data payloads that
// are sent as their own slices. One implementation for the server (Backward requests in,
// answers out) and the client (requests out, answers in). Free of gRPC (the fuzz build uses it;
// attngrad/wire/byte_buffer.h adapts grpc::ByteBuffer).
#ifndef ATTNGRAD_WIRE_MESSAGE_WALKER_H_
#define ATTNGRAD_WIRE_MESSAGE_WALKER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attngrad::wire {

// Protobuf base-128 varints: appended to `out`, and their encoded size.
void AppendVarint(std::uint64_t value, std::string* out);
std::size_t VarintSize(std::uint64_t value);

// An attngrad.v1.Tensor field of a message, named by field numbers from the outer message inwards:
// {5} is BackwardRequest.hidden_states, {5, 1} BackwardResponse.weight_gradients.q_proj.
using FieldPath = std::vector<int>;

// A message walked with the raw_data of some of its Tensor fields left in place.
struct WalkedMessage {
  // Every byte of the message but those raw_data fields (lengths of the enclosing fields adjusted):
  // parse it with protobuf for the rest of the message.
  std::string rest;
  // For each requested path, in order: the pieces of its raw_data's bytes (empty when it is absent
  // or empty). As protobuf merges repeated occurrences, the last raw_data of a tensor wins.
  std::vector<std::vector<absl::string_view>> payloads;
};

// Walks the message of `type` (a full protobuf name, for error messages) held by `pieces` in order.
// INVALID_ARGUMENT (NotAMessage) for bytes that are not a protobuf message: truncated or malformed
// fields, field number 0, groups (deprecated wire types 3 and 4, which no attngrad message has).
// The pieces are referred to, not copied: they must outlive the payloads' use.
absl::StatusOr<WalkedMessage> WalkMessage(const std::vector<absl::string_view>& pieces,
                                          absl::Span<const FieldPath> tensors, const char* type);

// INVALID_ARGUMENT: "the message does not parse as an <type> (<why>); the stream was ended: ...".
absl::Status NotAMessage(const char* type, const std::string& why);

// A piece of a message's serialization: bytes of its own, or (payload >= 0) the bytes of that
// payload, which go out as they are (e.g. their own gRPC slice).
struct MessageSegment {
  std::string bytes;
  int payload = -1;
};

// `serialized` (a message serialized by protobuf, the Tensors at `tensors` present and without
// raw_data) with payload i spliced in as the raw_data of the Tensor at tensors[i], which holds
// payload_sizes[i] bytes: the segments of exactly protobuf's serialization of the message with
// those raw_data set (the lengths of the enclosing fields adjusted; raw_data is a Tensor's last
// field). INTERNAL when a path has no Tensor in the message.
absl::StatusOr<std::vector<MessageSegment>> SpliceTensorPayloads(
    absl::string_view serialized, absl::Span<const FieldPath> tensors,
    absl::Span<const std::size_t> payload_sizes);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_MESSAGE_WALKER_H_
