// Waiting for a running NCCL collective without hanging when one GPU fails inside it. Each rank
// waits for its own part by polling (its CUDA stream, NCCL's asynchronous error) instead of
// blocking in cudaStreamSynchronize; the ranks of one communicator set share a CollectiveAbort. A
// rank whose part fails (a CUDA error on its device, an NCCL async error) or does not finish within
// the timeout requests the abort, naming its device, and aborts its communicator (ncclCommAbort:
// NCCL's kernels on that GPU stop); every other rank still waiting sees the request at its next
// poll and aborts its own, so no GPU is left spinning for a peer that will never come. After an
// abort the communicators are gone: the server sums on the host.
// The waiting logic knows nothing of CUDA or NCCL (RunningCollective), so it is tested without a
// GPU (tests/server/nccl_abort_test.cc); NcclReductionOnStream is the real one.
#ifndef ATTNGRAD_SERVER_NCCL_ABORT_H_
#define ATTNGRAD_SERVER_NCCL_ABORT_H_

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#ifdef ATTNGRAD_HAVE_NCCL_HEADER
#include <cuda_runtime_api.h>

#include "devices/nccl_library.h"
#endif

namespace attngrad::server {

// One rank's part of a collective already queued.
class RunningCollective {
 public:
  virtual ~RunningCollective() = default;
  // true: this rank's part is done; false: still running; an error: it failed (the message says
  // how; the caller adds the device).
  virtual absl::StatusOr<bool> Poll() = 0;
  // Stops this rank's part for good (ncclCommAbort). Called at most once.
  virtual void Abort() = 0;
};

// The abort shared by the ranks of one communicator set: once requested it stays requested (the
// communicators are aborted, or being aborted, and are not used again).
class CollectiveAbort {
 public:
  // The first request's reason is kept.
  void Request(const std::string& reason);
  bool requested() const { return requested_.load(std::memory_order_acquire); }
  std::string reason() const;

 private:
  std::atomic<bool> requested_{false};
  mutable std::mutex mutex_;
  std::string reason_;
};

struct CollectiveWaitOptions {
  std::chrono::steady_clock::duration timeout = std::chrono::seconds(60);
  std::chrono::steady_clock::duration poll_interval = std::chrono::microseconds(200);
};

// Waits for `collective` (on `device`, e.g. "cuda:1"). OK when its part completed. Otherwise it
// has been aborted and the status says why: INTERNAL naming `device` and the error when it failed
// here; DEADLINE_EXCEEDED naming `device` after `timeout`; ABORTED naming the reason another rank
// gave when that rank requested the abort first. `what` names the collective in messages.
absl::Status WaitForCollective(RunningCollective& collective, CollectiveAbort& abort,
                               const std::string& device, const std::string& what,
                               const CollectiveWaitOptions& options = {});

#ifdef ATTNGRAD_HAVE_NCCL_HEADER
// The real one: an NCCL collective queued on `stream` through rank `rank` of `communicators`. Poll
// looks at the stream (cudaStreamQuery: done, still running, or the device's error) and at
// ncclCommGetAsyncError; Abort aborts that rank's communicator (NcclCommunicators::Abort).
class NcclReductionOnStream final : public RunningCollective {
 public:
  NcclReductionOnStream(NcclCommunicators& communicators, int rank, cudaStream_t stream)
      : communicators_(communicators), rank_(rank), stream_(stream) {}
  absl::StatusOr<bool> Poll() override;
  void Abort() override;

 private:
  NcclCommunicators& communicators_;
  const int rank_;
  const cudaStream_t stream_;
};
#endif

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_NCCL_ABORT_H_
