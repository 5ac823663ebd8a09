// Client::Impl: the state one Client and all its BackwardStreams share (channel, stubs, the cached
// model info, the adopted server instance id), plus the retry, deadline and split-planning helpers.
#ifndef ATTNGRAD_CLIENT_SRC_CLIENT_IMPL_H_
#define ATTNGRAD_CLIENT_SRC_CLIENT_IMPL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attngrad/client.h"
#include "attngrad/common/buffer_pool.h"
#include "attngrad/common/parallel_tasks.h"
#include "attngrad/v1/attngrad.grpc.pb.h"

namespace attngrad {

// grpc::Status -> absl::Status, the message prefixed with the call's name (the server's message is
// kept verbatim after it).
absl::Status FromGrpc(const grpc::Status& status, absl::string_view what);

// Sets `context`'s deadline `timeout` from now (nothing for an infinite timeout).
void SetDeadline(grpc::ClientContext* context, absl::Duration timeout);
// SetDeadline plus the per-call metadata of `options`: the bearer token and the client id.
void PrepareContext(grpc::ClientContext* context, const ClientOptions& options,
                    absl::Duration timeout);

// How a batch of B sequences is cut into parts: (first sequence, number of sequences) pairs.
using SplitPlan = std::vector<std::pair<int64_t, int64_t>>;

// The request and response sizes of one part, as functions of its number of sequences b:
// request = fixed + b * per_sequence (and likewise for the response).
struct MessageSizes {
  int64_t request_fixed = 0;
  int64_t request_per_sequence = 0;
  int64_t response_fixed = 0;
  int64_t response_per_sequence = 0;
};

// Parts of at most as many sequences as fit max_batch_tokens (b*S) and both message limits, as even
// as possible. INVALID_ARGUMENT when a single sequence does not fit (splitting along S is not
// exact).
absl::StatusOr<SplitPlan> PlanSplit(int64_t batch, int64_t seq_len, const MessageSizes& sizes,
                                    int64_t max_request_bytes, int64_t max_response_bytes,
                                    int64_t max_batch_tokens);

class Client::Impl {
 public:
  // channels[0] carries the unary calls; Backward streams take the channels in turn.
  Impl(std::string target, ClientOptions options,
       std::vector<std::shared_ptr<grpc::Channel>> channels);

  const std::string& target() const { return target_; }
  const ClientOptions& options() const { return options_; }
  v1::AttentionGradient::Stub& stub() { return *stubs_.front(); }
  grpc::GenericStub& generic_stub() { return *generic_stub_; }
  // The next channel in turn (for a new Backward stream).
  const std::shared_ptr<grpc::Channel>& NextStreamChannel();
  // Host buffers for the requests' tensor bytes, reused once gRPC has sent them (shared by the
  // client's streams; keeps up to kRequestPoolBytes of free buffers).
  common::BufferPool& request_pool() { return *request_pool_; }
  static constexpr std::size_t kRequestPoolBytes = std::size_t{1} << 30;
  // The threads that decode large answers in parts (shared by the client's streams; each stream's
  // reader thread takes part in its own answers' decodes).
  common::ParallelTasks& decode_threads() { return *decode_threads_; }
  int channel_count() const { return static_cast<int>(stubs_.size()); }

  // Runs `attempt` up to options.max_attempts times while it fails with a retryable code
  // (UNAVAILABLE, DEADLINE_EXCEEDED), sleeping with exponential backoff and jitter in between.
  absl::Status Retry(const std::function<absl::Status()>& attempt);

  // GetModelInfo with retries; updates the cached info and checks the instance id (recording a
  // restart, but returning the info).
  absl::StatusOr<v1::GetModelInfoResponse> FetchInfo();
  v1::GetModelInfoResponse cached_info() const;

  // Compares an instance id the server reported with the adopted one. On a difference, records the
  // restart and returns ABORTED; "" (not reported) is accepted.
  absl::Status CheckInstance(absl::string_view seen);
  // ABORTED while a detected restart has not been accepted.
  absl::Status RestartStatus() const;
  absl::Status AcceptRestart();
  std::string instance_id() const;

  // A fresh batch id below 2^63, unique for this client.
  uint64_t NewBatchId();

 private:
  absl::Status RestartStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string target_;
  const ClientOptions options_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::AttentionGradient::Stub>> stubs_;  // one per channel
  std::unique_ptr<grpc::GenericStub> generic_stub_;
  std::shared_ptr<common::BufferPool> request_pool_;
  std::unique_ptr<common::ParallelTasks> decode_threads_;
  std::atomic<uint64_t> next_batch_id_;
  std::atomic<uint64_t> next_stream_channel_{0};

  mutable absl::Mutex mu_;
  v1::GetModelInfoResponse info_ ABSL_GUARDED_BY(mu_);
  std::string instance_id_ ABSL_GUARDED_BY(mu_);   // adopted (first seen, or accepted)
  std::string restarted_to_ ABSL_GUARDED_BY(mu_);  // a different id seen since; "" = none
};

// Creates a BackwardStream on `client` (on its next channel) with `deadline` for the whole stream.
// `on_result`, when set, is called (with no lock held) each time a batch completes, for a caller
// that waits on several streams at once.
absl::StatusOr<std::unique_ptr<BackwardStream>> OpenBackwardStream(
    std::shared_ptr<Client::Impl> client, absl::Duration deadline,
    std::function<void()> on_result = nullptr);

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_SRC_CLIENT_IMPL_H_
