// The end marker of a Backward stream (see stream_end.h).
#include "rpc/stream_end.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/backward_messages.h"
#include "rpc/auth.h"

namespace attngrad::server {
namespace {

// What a client that lost requests does about it: the same words in every DATA_LOSS message.
constexpr char kResendAdvice[] =
    "the requests that arrived whole are answered and what they accumulated stays; send the "
    "unanswered batches again on a new stream (the same batch ids: ACCUMULATE counts each once)";

}  // namespace

absl::StatusOr<bool> EndMarkerDeclared(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  ATTNGRAD_ASSIGN_OR_RETURN(const std::string value,
                            SingleMetadataValue(metadata, wire::kEndMarkerMetadata));
  if (value.empty()) return false;
  if (value == wire::kEndMarkerDeclared) return true;
  return absl::InvalidArgumentError(
      absl::StrCat("Backward: metadata '", wire::kEndMarkerMetadata, "' is '", value, "'; send '",
                   wire::kEndMarkerDeclared,
                   "' to declare the end marker (BackwardRequest.end), or leave it out"));
}

absl::Status StreamEndCheck::Request() {
  if (marker_seen_) {
    return absl::InvalidArgumentError(
        "Backward: a request arrived after the end marker (BackwardRequest.end must be the "
        "stream's last message); it and anything after it was not computed");
  }
  ++requests_;
  return absl::OkStatus();
}

absl::Status StreamEndCheck::Marker(const ReceivedBackwardRequest& marker) {
  if (marker_seen_) {
    return absl::InvalidArgumentError(
        "Backward: a second end marker arrived (BackwardRequest.end must be the stream's last "
        "message)");
  }
  marker_seen_ = true;
  v1::BackwardRequest others = marker.message;
  others.clear_end();
  if (others.ByteSizeLong() != 0 || marker.hidden_states.size_bytes() != 0 ||
      marker.grad_output.size_bytes() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Backward: a request with `end` set carries other fields too (batch_id ",
        marker.message.batch_id(),
        "); the end marker must carry only `end`, and a batch must not set it. Neither was "
        "computed"));
  }
  const std::uint64_t sent = marker.message.end().requests();
  if (sent == requests_) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "Backward: the end marker says ", sent, " request(s) were sent before it, but ", requests_,
      " arrived whole: the stream ended inside or before a message, or lost one on the way "
      "(expected end.requests = ",
      requests_, "); ", kResendAdvice));
}

absl::Status StreamEndCheck::HalfClosed() const {
  if (!declared_ || marker_seen_) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "Backward: the stream ended without its end marker, so it ended inside or before a message "
      "(a message cut short by the end of the stream is dropped): the client declared '",
      wire::kEndMarkerMetadata, ": ", wire::kEndMarkerDeclared, "', and after the ", requests_,
      " request(s) that arrived whole the server expected the end marker, a last BackwardRequest "
      "with only `end` set (end.requests = the requests sent before it); ",
      kResendAdvice));
}

}  // namespace attngrad::server
