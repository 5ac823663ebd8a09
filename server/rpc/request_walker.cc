// WalkBackwardRequest: the wire library's walker with the activations' paths.
#include "rpc/request_walker.h"

#include <utility>

#include "attngrad/common/status_macros.h"
#include "attngrad/wire/backward_paths.h"
#include "attngrad/wire/message_walker.h"

namespace attngrad::server {

absl::StatusOr<ReceivedBackwardRequest> WalkBackwardRequest(
    const std::vector<absl::string_view>& pieces, std::shared_ptr<const void> owner) {
  constexpr const char* kType = "attngrad.v1.BackwardRequest";
  ATTNGRAD_ASSIGN_OR_RETURN(
      wire::WalkedMessage walked,
      wire::WalkMessage(pieces, wire::BackwardRequestActivationPaths(), kType));
  ReceivedBackwardRequest received;
  if (!received.message.ParseFromString(walked.rest)) {
    return wire::NotAMessage(kType, "a field does not parse");
  }
  WireTensor* tensors[2] = {&received.hidden_states, &received.grad_output};
  const v1::Tensor* described[2] = {&received.message.hidden_states(),
                                    &received.message.grad_output()};
  for (int i = 0; i < 2; ++i) {
    *tensors[i] = WireTensor(described[i]->dtype(), std::move(walked.payloads[i]), owner);
  }
  return received;
}

}  // namespace attngrad::server
