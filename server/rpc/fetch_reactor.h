// FetchGradients: the summed accumulators, each weight in chunks of at most chunk_bytes.
#ifndef ATTNGRAD_SERVER_RPC_FETCH_REACTOR_H_
#define ATTNGRAD_SERVER_RPC_FETCH_REACTOR_H_

#include <string>

#include "attngrad/v1/attngrad.grpc.pb.h"

namespace attngrad::server {

class GradientService;

// The reactor of one FetchGradients call on the accumulation window of `window_owner`
// (authenticated, authorized and resolved already); it deletes itself when gRPC is done with it.
// `caller` owns the regions that request.destinations name.
grpc::ServerWriteReactor<v1::GradientChunk>* NewFetchReactor(
    GradientService* service, const v1::FetchGradientsRequest& request,
    const std::string& window_owner, const std::string& caller);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_FETCH_REACTOR_H_
