// A serialized BackwardRequest read where its bytes lie (any number of pieces, e.g. gRPC's receive
// slices) without copying the activations: the message walked by the wire library's walker
// (attngrad/wire/message_walker.h), the raw_data of hidden_states and grad_output referred to,
// everything else parsed by protobuf. Free of gRPC (rpc/raw_request.h adapts grpc::ByteBuffer; the
// fuzz build uses this).
#ifndef ATTNGRAD_SERVER_REQUEST_WALKER_H_
#define ATTNGRAD_SERVER_REQUEST_WALKER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rpc/backward_request.h"

namespace attngrad::server {

// The request in `pieces` (in order), its activations' WireTensors referring to them (kept alive by
// `owner`). The last raw_data of a tensor wins, as when protobuf merges repeated occurrences.
// INVALID_ARGUMENT (wire::NotAMessage) for bytes that are not a BackwardRequest, including groups
// (deprecated wire types 3 and 4, which no attngrad message has).
absl::StatusOr<ReceivedBackwardRequest> WalkBackwardRequest(
    const std::vector<absl::string_view>& pieces, std::shared_ptr<const void> owner);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_REQUEST_WALKER_H_
