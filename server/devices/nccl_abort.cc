// WaitForCollective and the NCCL adapter; see nccl_abort.h.
#include "devices/nccl_abort.h"

#include <thread>

#include "absl/strings/str_cat.h"

namespace attngrad::server {

void CollectiveAbort::Request(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (requested_.load(std::memory_order_relaxed)) return;
  reason_ = reason;
  requested_.store(true, std::memory_order_release);
}

std::string CollectiveAbort::reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reason_;
}

absl::Status WaitForCollective(RunningCollective& collective, CollectiveAbort& abort,
                               const std::string& device, const std::string& what,
                               const CollectiveWaitOptions& options) {
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  while (true) {
    const absl::StatusOr<bool> done = collective.Poll();
    if (!done.ok()) {
      const std::string reason =
          absl::StrCat(device, " failed in ", what, ": ", done.status().message());
      abort.Request(reason);
      collective.Abort();
      return absl::InternalError(absl::StrCat(
          reason, "; the NCCL communicators were aborted, later fetches sum on the host"));
    }
    if (*done) return absl::OkStatus();
    if (abort.requested()) {
      collective.Abort();
      return absl::AbortedError(absl::StrCat(what, " on ", device, " aborted: ", abort.reason()));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      const std::string reason =
          absl::StrCat(device, " did not finish ", what, " within ",
                       std::chrono::duration<double>(options.timeout).count(), " s");
      abort.Request(reason);
      collective.Abort();
      return absl::DeadlineExceededError(absl::StrCat(
          reason, "; the NCCL communicators were aborted, later fetches sum on the host"));
    }
    std::this_thread::sleep_for(options.poll_interval);
  }
}

#ifdef ATTNGRAD_HAVE_NCCL_HEADER

absl::StatusOr<bool> NcclReductionOnStream::Poll() {
  const cudaError_t queried = cudaStreamQuery(stream_);
  if (queried == cudaSuccess) return true;
  if (queried != cudaErrorNotReady) {
    return absl::InternalError(absl::StrCat("cudaStreamQuery: ", cudaGetErrorName(queried), " (",
                                            cudaGetErrorString(queried), ")"));
  }
  const NcclLibrary& library = communicators_.library();
  ncclResult_t asynchronous = ncclSuccess;
  const ncclComm_t comm = communicators_.comm(rank_);
  if (comm == nullptr) return absl::InternalError("the communicator was aborted");
  absl::Status status =
      library.Check(library.comm_get_async_error(comm, &asynchronous), "ncclCommGetAsyncError");
  if (status.ok() && asynchronous != ncclSuccess
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
      && asynchronous != ncclInProgress
#endif
  ) {
    status = library.Check(asynchronous, "NCCL asynchronous error");
  }
  if (!status.ok()) return status;
  return false;
}

void NcclReductionOnStream::Abort() { communicators_.Abort(rank_); }

#endif  // ATTNGRAD_HAVE_NCCL_HEADER

}  // namespace attngrad::server
