// FetchGradients: the summed accumulators, each weight in chunks of at most chunk_bytes.
#ifndef ATTNGRAD_SERVER_RPC_FETCH_REACTOR_H_
#define ATTNGRAD_SERVER_RPC_FETCH_REACTOR_H_

#include <string>

#include "attngrad/v1/attngrad.grpc.pb.h"

namespace attngrad::server {

class GradientService;

// The reactor of one FetchGradients call on the accumulation window of `window_owner`
// (authenticated, authorized and resolved already); it deletes itself when gRPC is done with it.
// `caller` owns the regions that request.destinations name and is charged for the memory of the
// sums while they are sent. The chunks are written as serialized GradientChunks. A chunk the
// client does not take within the stream idle timeout ends the call (DEADLINE_EXCEEDED).
grpc::ServerWriteReactor<grpc::ByteBuffer>* NewFetchReactor(
    GradientService* service, grpc::CallbackServerContext* context,
    const v1::FetchGradientsRequest& request, const std::string& window_owner,
    const std::string& caller);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_FETCH_REACTOR_H_
