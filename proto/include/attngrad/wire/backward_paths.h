// The Tensor fields of Backward requests and answers whose raw_data travel as slices of their own
// (attngrad/wire/message_walker.h paths), for the server and the client. Free of gRPC.
#ifndef ATTNGRAD_WIRE_BACKWARD_PATHS_H_
#define ATTNGRAD_WIRE_BACKWARD_PATHS_H_

#include <vector>

#include "attngrad/wire/message_walker.h"

namespace attngrad::wire {

// BackwardRequest.hidden_states and .grad_output.
const std::vector<FieldPath>& BackwardRequestActivationPaths();
// BackwardResponse.grad_hidden_states, then weight_gradients' tensors in kAllWeights order.
const std::vector<FieldPath>& BackwardResponseTensorPaths();

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_BACKWARD_PATHS_H_
