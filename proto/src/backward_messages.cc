// Backward requests and answers as ByteBuffers (attngrad/wire/byte_buffer.h underneath).
#include "attngrad/wire/backward_messages.h"

#include <cstring>
#include <utility>

#include "attngrad/common/status_macros.h"
#include "attngrad/wire/byte_buffer.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"

namespace attngrad::wire {

namespace {

// The request with `hidden_states` and `grad_output` as the raw_data of its two activations.
absl::StatusOr<grpc::ByteBuffer> SerializeWithActivations(const v1::BackwardRequest& request,
                                                          grpc::Slice hidden_states,
                                                          grpc::Slice grad_output) {
  const grpc::Slice payloads[2] = {std::move(hidden_states), std::move(grad_output)};
  return SerializeWithPayloads(request, BackwardRequestActivationPaths(), payloads);
}

}  // namespace

absl::StatusOr<grpc::ByteBuffer> EncodeBackwardRequest(const v1::BackwardRequest& request,
                                                       absl::Span<const float> hidden_states,
                                                       absl::Span<const float> grad_output,
                                                       int dtype, common::BufferPool& pool,
                                                       std::shared_ptr<const void> borrow_owner) {
  const std::size_t element_size = DTypeSize(dtype) == 2 ? 2 : sizeof(float);
  if (element_size == sizeof(float)) {  // the floats' own bytes are the encoding
    auto bytes_of = [](absl::Span<const float> values) {
      return absl::string_view(reinterpret_cast<const char*>(values.data()),
                               values.size() * sizeof(float));
    };
    return EncodeBackwardRequestBytes(request, bytes_of(hidden_states), bytes_of(grad_output), pool,
                                      std::move(borrow_owner));
  }
  borrow_owner.reset();
  const std::size_t hidden_bytes = hidden_states.size() * element_size;
  const std::size_t grad_bytes = grad_output.size() * element_size;
  common::BufferPool::Buffer buffer = pool.Acquire(hidden_bytes + grad_bytes);
  EncodeFromFloat(hidden_states, dtype, buffer.data());
  EncodeFromFloat(grad_output, dtype, buffer.data() + hidden_bytes);
  const grpc::Slice payload = SliceOf(std::move(buffer));
  return SerializeWithActivations(request, payload.sub(0, hidden_bytes),
                                  payload.sub(hidden_bytes, hidden_bytes + grad_bytes));
}

absl::StatusOr<grpc::ByteBuffer> EncodeBackwardRequestBytes(
    const v1::BackwardRequest& request, absl::string_view hidden_states,
    absl::string_view grad_output, common::BufferPool& pool,
    std::shared_ptr<const void> borrow_owner) {
  if (borrow_owner != nullptr) {
    grpc::Slice hidden = BorrowedSlice(hidden_states, borrow_owner);
    grpc::Slice grad = BorrowedSlice(grad_output, borrow_owner);
    borrow_owner.reset();
    return SerializeWithActivations(request, std::move(hidden), std::move(grad));
  }
  common::BufferPool::Buffer buffer = pool.Acquire(hidden_states.size() + grad_output.size());
  if (!hidden_states.empty()) {
    std::memcpy(buffer.data(), hidden_states.data(), hidden_states.size());
  }
  if (!grad_output.empty()) {
    std::memcpy(buffer.data() + hidden_states.size(), grad_output.data(), grad_output.size());
  }
  const grpc::Slice payload = SliceOf(std::move(buffer));
  return SerializeWithActivations(
      request, payload.sub(0, hidden_states.size()),
      payload.sub(hidden_states.size(), hidden_states.size() + grad_output.size()));
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
