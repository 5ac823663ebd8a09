// Backward requests and answers as ByteBuffers (attngrad/wire/byte_buffer.h underneath).
#include "attngrad/wire/backward_messages.h"

#include <utility>

#include "attngrad/wire/byte_buffer.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/status_macros.h"
#include "attngrad/wire/tensor.h"

namespace attngrad::wire {

absl::StatusOr<grpc::ByteBuffer> EncodeBackwardRequest(const v1::BackwardRequest& request,
                                                       absl::Span<const float> hidden_states,
                                                       absl::Span<const float> grad_output,
                                                       int dtype, BufferPool& pool,
                                                       std::shared_ptr<const void> borrow_owner) {
  const std::size_t element_size = DTypeSize(dtype) == 2 ? 2 : sizeof(float);
  const std::size_t hidden_bytes = hidden_states.size() * element_size;
  const std::size_t grad_bytes = grad_output.size() * element_size;
  if (borrow_owner != nullptr && element_size == sizeof(float)) {
    auto bytes_of = [](absl::Span<const float> values) {
      return absl::string_view(reinterpret_cast<const char*>(values.data()),
                               values.size() * sizeof(float));
    };
    const grpc::Slice payloads[2] = {BorrowedSlice(bytes_of(hidden_states), borrow_owner),
                                     BorrowedSlice(bytes_of(grad_output), borrow_owner)};
    borrow_owner.reset();
    return SerializeWithPayloads(request, BackwardRequestActivationPaths(), payloads);
  }
  borrow_owner.reset();
  BufferPool::Buffer buffer = pool.Acquire(hidden_bytes + grad_bytes);
  EncodeFromFloat(hidden_states, dtype, buffer.data());
  EncodeFromFloat(grad_output, dtype, buffer.data() + hidden_bytes);
  const grpc::Slice payload = SliceOf(std::move(buffer));
  const grpc::Slice payloads[2] = {payload.sub(0, hidden_bytes),
                                   payload.sub(hidden_bytes, hidden_bytes + grad_bytes)};
  return SerializeWithPayloads(request, BackwardRequestActivationPaths(), payloads);
}

absl::StatusOr<ReceivedBackwardResponse> ReadBackwardResponse(const grpc::ByteBuffer& bytes) {
  constexpr const char* kType = "attngrad.v1.BackwardResponse";
  ATTNGRAD_ASSIGN_OR_RETURN(ReceivedPieces pieces, PiecesOf(bytes, kType));
  ATTNGRAD_ASSIGN_OR_RETURN(WalkedMessage walked,
                            WalkMessage(pieces.pieces, BackwardResponseTensorPaths(), kType));
  ReceivedBackwardResponse answer;
  if (!answer.response.ParseFromString(walked.rest)) {
    return NotAMessage(kType, "a field does not parse");
  }
  answer.payloads = std::move(walked.payloads);
  answer.owner = std::move(pieces.owner);
  answer.bytes = static_cast<std::int64_t>(bytes.Length());
  return answer;
}

}  // namespace attngrad::wire
