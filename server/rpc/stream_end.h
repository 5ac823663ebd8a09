// The end marker of a Backward stream (BackwardRequest.end). gRPC's HTTP/2 transport reports a
// stream that ends inside a message (a length prefix that promises more bytes than follow, then
// END_STREAM) exactly as a clean half-close: the partial message is dropped and nothing the server
// can read tells the two apart. A client that declares the marker at the stream's start (request
// metadata attngrad-end-marker: 1) ends the stream with a last request that carries only the count
// of requests it sent before it; a declared stream that half-closes without it, or whose count
// differs from the requests that arrived whole, ended inside or before a message, and the server
// says so instead of ending it OK.
#ifndef ATTNGRAD_SERVER_RPC_STREAM_END_H_
#define ATTNGRAD_SERVER_RPC_STREAM_END_H_

#include <cstdint>
#include <map>

#include <grpcpp/support/string_ref.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rpc/backward_request.h"

namespace attngrad::server {

// Whether a call's metadata declares the end marker: false without the metadata, true with its
// one value "1"; INVALID_ARGUMENT naming the metadata for another value or more than one.
absl::StatusOr<bool> EndMarkerDeclared(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata);

// One stream's requests checked against its end marker, in the order they were read (not
// thread-safe: the reactor calls it under its mutex). Each call returns the status the stream must
// end with, once the batches already handed in are answered (OK: the stream goes on).
class StreamEndCheck {
 public:
  explicit StreamEndCheck(bool declared = false) : declared_(declared) {}

  bool declared() const { return declared_; }
  // A whole request that is no end marker arrived: INVALID_ARGUMENT after the marker.
  absl::Status Request();
  // The end marker arrived: INVALID_ARGUMENT when it carries any other field or comes twice,
  // DATA_LOSS when its count differs from the requests that arrived.
  absl::Status Marker(const ReceivedBackwardRequest& marker);
  // The client half-closed: DATA_LOSS for a declared stream whose marker did not arrive.
  absl::Status HalfClosed() const;

 private:
  bool declared_;
  std::uint64_t requests_ = 0;  // whole requests read before the marker
  bool marker_seen_ = false;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_STREAM_END_H_
