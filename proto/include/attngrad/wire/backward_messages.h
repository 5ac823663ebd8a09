// attngrad.v1 Backward requests and answers as the grpc::ByteBuffers client and server exchange,
// with their big bytes fields kept out of protobuf messages: which tensors those are, a request
// encoded with its activations as slices of their own, and an answer read on its received slices.
#ifndef ATTNGRAD_WIRE_BACKWARD_MESSAGES_H_
#define ATTNGRAD_WIRE_BACKWARD_MESSAGES_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attngrad/common/buffer_pool.h"
#include "attngrad/v1/attngrad.pb.h"
#include "attngrad/wire/backward_paths.h"
#include "attngrad/wire/message_walker.h"

namespace attngrad::wire {

// The request metadata with which a client declares, at a Backward stream's start, that it ends the
// stream with an end marker (BackwardRequest.end), and its one value.
inline constexpr char kEndMarkerMetadata[] = "attngrad-end-marker";
inline constexpr char kEndMarkerDeclared[] = "1";

// `request` (hidden_states and grad_output with their dtype `dtype` and shape, no raw_data) with
// `hidden_states` and `grad_output` encoded to `dtype` (one pass each, into one buffer of `pool`,
// sent as its own slices): byte for byte protobuf's serialization of the request with those
// tensors set by EncodeTensor.
//
// `borrow_owner` non-null and `dtype` float32 (whose encoding is the floats' own little-endian
// bytes): nothing is copied, the two spans' memory goes out as slices of its own, and
// `borrow_owner` is kept until gRPC lets go of them (BorrowedSlice): the spans must stay valid and
// unchanged until then. Otherwise (any other dtype) `borrow_owner` is dropped at once.
absl::StatusOr<grpc::ByteBuffer> EncodeBackwardRequest(
    const v1::BackwardRequest& request, absl::Span<const float> hidden_states,
    absl::Span<const float> grad_output, int dtype, common::BufferPool& pool,
    std::shared_ptr<const void> borrow_owner = nullptr);

// The same with hidden_states and grad_output already encoded in the request's dtype (their raw
// little-endian bytes, e.g. a bf16 tensor's memory): nothing converted; with `borrow_owner`
// non-null nothing copied either (the bytes go out as slices of their own, `borrow_owner` kept
// until gRPC lets go of them), else copied once into one buffer of `pool`.
absl::StatusOr<grpc::ByteBuffer> EncodeBackwardRequestBytes(
    const v1::BackwardRequest& request, absl::string_view hidden_states,
    absl::string_view grad_output, common::BufferPool& pool,
    std::shared_ptr<const void> borrow_owner = nullptr);

// An answer: its fields but the tensors' raw_data, which are `payloads` (in
// BackwardResponseTensorPaths' order) in the received slices that `owner` keeps alive.
struct ReceivedBackwardResponse {
  v1::BackwardResponse response;
  std::vector<std::vector<absl::string_view>> payloads;
  std::shared_ptr<const void> owner;
  std::int64_t bytes = 0;  // the serialized size
};
// INVALID_ARGUMENT (NotAMessage) for bytes that are not a BackwardResponse.
absl::StatusOr<ReceivedBackwardResponse> ReadBackwardResponse(const grpc::ByteBuffer& bytes);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_BACKWARD_MESSAGES_H_
