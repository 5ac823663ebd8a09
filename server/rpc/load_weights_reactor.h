// LoadWeights: chunks of each weight in order (offset = elements received so far); committed when
// the client half-closes with every weight complete. A chunk that does not parse ends the upload
// (INVALID_ARGUMENT, nothing committed). The staging grows with the data received (each chunk's
// fp32 values reserved from the in-flight memory budget as it arrives), never ahead of it.
#ifndef ATTNGRAD_SERVER_RPC_LOAD_WEIGHTS_REACTOR_H_
#define ATTNGRAD_SERVER_RPC_LOAD_WEIGHTS_REACTOR_H_

#include <string>

#include "attngrad/v1/attngrad.grpc.pb.h"

namespace attngrad::server {

class GradientService;

// The reactor of one LoadWeights upload of `client_id` (authenticated and authorized already),
// which writes the serialized LoadWeightsResponse into `response`; it deletes itself when gRPC is
// done with it.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewLoadWeightsReactor(
    GradientService* service, grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
    std::string client_id);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_LOAD_WEIGHTS_REACTOR_H_
