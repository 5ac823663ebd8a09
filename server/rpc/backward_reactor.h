// Backward: one batch per request; answers in order of completion. At most `stream_window`
// batches of a stream are queued or waiting to be written; beyond that the stream stops reading
// (gRPC flow control then pushes back on the client). The stream is counted in the service's
// StreamRegistry (server-wide and per-client limits) and ended by it when idle, or drained at
// shutdown: batches that arrive then are answered UNAVAILABLE, and the stream ends UNAVAILABLE
// (OK when the client has half-closed) as soon as the batches it has are answered. ACCUMULATE
// batches go to the window of the stream's client.
#ifndef ATTNGRAD_SERVER_RPC_BACKWARD_REACTOR_H_
#define ATTNGRAD_SERVER_RPC_BACKWARD_REACTOR_H_

#include <string>

#include "attngrad/v1/attngrad.grpc.pb.h"

namespace attngrad::server {

class GradientService;

// The reactor of one Backward stream of `client_id` (authenticated and authorized already); it
// deletes itself when gRPC is done with it.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewBackwardReactor(
    GradientService* service, grpc::CallbackServerContext* context, std::string client_id);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_BACKWARD_REACTOR_H_
