// grpc::ByteBuffer adapters of the wire walker (attngrad/wire/message_walker.h), for calls that
// take their messages as raw bytes: a received buffer's slices as pieces (nothing copied), and a
// message sent with its tensors' raw_data as slices of their own (nothing copied into a
// serialized message).
#ifndef ATTNGRAD_WIRE_BYTE_BUFFER_H_
#define ATTNGRAD_WIRE_BYTE_BUFFER_H_

#include <memory>
#include <vector>

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attngrad/common/buffer_pool.h"
#include "attngrad/wire/message_walker.h"

namespace attngrad::wire {

// The slices of a received message as pieces, and what keeps them alive.
struct ReceivedPieces {
  std::vector<absl::string_view> pieces;
  std::shared_ptr<const void> owner;
};
// INVALID_ARGUMENT (NotAMessage of `type`) when the buffer cannot be read.
absl::StatusOr<ReceivedPieces> PiecesOf(const grpc::ByteBuffer& bytes, const char* type);

// `message` (the Tensors at `tensors` present, their raw_data empty) with payloads[i] as the
// raw_data of tensors[i]: byte for byte protobuf's serialization of that message, the payloads'
// slices sent as they are. INTERNAL when a path has no Tensor in the message.
absl::StatusOr<grpc::ByteBuffer> SerializeWithPayloads(const google::protobuf::MessageLite& message,
                                                       absl::Span<const FieldPath> tensors,
                                                       absl::Span<const grpc::Slice> payloads);

// A slice of the pool buffer's bytes that owns it (given back once gRPC has sent the bytes).
grpc::Slice SliceOf(common::BufferPool::Buffer buffer);

// A slice of `bytes`, which someone else's memory holds (not copied): `owner` is kept until gRPC
// lets go of the slice (every copy of it), so its destruction says that the bytes are no longer
// read.
grpc::Slice BorrowedSlice(absl::string_view bytes, std::shared_ptr<const void> owner);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_BYTE_BUFFER_H_
