// grpc::ByteBuffer <-> pieces and payload slices.
#include "attngrad/wire/byte_buffer.h"

#include <utility>

#include "attngrad/common/status_macros.h"

namespace attngrad::wire {

absl::StatusOr<ReceivedPieces> PiecesOf(const grpc::ByteBuffer& bytes, const char* type) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!bytes.Dump(slices.get()).ok()) return NotAMessage(type, "unreadable bytes");
  ReceivedPieces received;
  received.pieces.reserve(slices->size());
  for (const grpc::Slice& slice : *slices) {
    received.pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  received.owner = std::move(slices);
  return received;
}

absl::StatusOr<grpc::ByteBuffer> SerializeWithPayloads(const google::protobuf::MessageLite& message,
                                                       absl::Span<const FieldPath> tensors,
                                                       absl::Span<const grpc::Slice> payloads) {
  std::vector<std::size_t> sizes;
  sizes.reserve(payloads.size());
  for (const grpc::Slice& payload : payloads) sizes.push_back(payload.size());
  const std::string serialized = message.SerializeAsString();
  ATTNGRAD_ASSIGN_OR_RETURN(std::vector<MessageSegment> segments,
                            SpliceTensorPayloads(serialized, tensors, sizes));
  std::vector<grpc::Slice> slices;
  slices.reserve(segments.size());
  for (MessageSegment& segment : segments) {
    if (segment.payload >= 0) {
      slices.push_back(payloads[static_cast<std::size_t>(segment.payload)]);
    } else {
      slices.emplace_back(std::move(segment.bytes));
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

namespace {
void DeleteBuffer(void* buffer) { delete static_cast<common::BufferPool::Buffer*>(buffer); }
void DeleteOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }
}  // namespace

grpc::Slice BorrowedSlice(absl::string_view bytes, std::shared_ptr<const void> owner) {
  auto* kept = new std::shared_ptr<const void>(std::move(owner));
  return grpc::Slice(const_cast<char*>(bytes.data()), bytes.size(), DeleteOwner, kept);
}

grpc::Slice SliceOf(common::BufferPool::Buffer buffer) {
  auto* owned = new common::BufferPool::Buffer(std::move(buffer));
  return grpc::Slice(owned->data(), owned->size(), DeleteBuffer, owned);
}

}  // namespace attngrad::wire
