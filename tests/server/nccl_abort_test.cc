// WaitForCollective (server/devices/nccl_abort.h) without a GPU: scripted collectives stand for the
// ranks of an NCCL reduction. A rank whose part completes returns OK and aborts nothing; one whose
// part fails names its device, requests the abort and aborts; one that never finishes is aborted
// after the timeout; and a rank still waiting for a peer that failed is aborted within a few polls
// instead of waiting for ever (before, the ranks blocked in cudaStreamSynchronize with nothing to
// end the wait).
#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "devices/nccl_abort.h"

namespace attngrad::server {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// A rank's part that finishes after `polls_until_done` polls (never when negative), or fails at
// poll `polls_until_error` (never when negative).
class ScriptedCollective final : public RunningCollective {
 public:
  ScriptedCollective(int polls_until_done, int polls_until_error)
      : polls_until_done_(polls_until_done), polls_until_error_(polls_until_error) {}

  absl::StatusOr<bool> Poll() override {
    ++polls_;
    if (polls_until_error_ >= 0 && polls_ >= polls_until_error_) {
      return absl::InternalError("cudaStreamQuery: cudaErrorLaunchFailure (unspecified launch)");
    }
    return polls_until_done_ >= 0 && polls_ >= polls_until_done_;
  }
  void Abort() override { ++aborts_; }

  int aborts() const { return aborts_.load(); }

 private:
  const int polls_until_done_, polls_until_error_;
  int polls_ = 0;
  std::atomic<int> aborts_{0};
};

const CollectiveWaitOptions kQuick = {milliseconds(500), milliseconds(1)};

TEST(NcclAbortTest, CompletedPartIsOkAndAbortsNothing) {
  ScriptedCollective collective(/*polls_until_done=*/3, /*polls_until_error=*/-1);
  CollectiveAbort abort;
  EXPECT_TRUE(WaitForCollective(collective, abort, "cuda:0", "ncclReduce", kQuick).ok());
  EXPECT_EQ(collective.aborts(), 0);
  EXPECT_FALSE(abort.requested());
}

TEST(NcclAbortTest, FailingPartNamesItsDeviceAndAborts) {
  ScriptedCollective collective(-1, /*polls_until_error=*/2);
  CollectiveAbort abort;
  const absl::Status status = WaitForCollective(collective, abort, "cuda:1", "ncclReduce", kQuick);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_NE(status.message().find("cuda:1"), std::string::npos) << status;
  EXPECT_NE(status.message().find("cudaErrorLaunchFailure"), std::string::npos) << status;
  EXPECT_EQ(collective.aborts(), 1);
  ASSERT_TRUE(abort.requested());
  EXPECT_NE(abort.reason().find("cuda:1"), std::string::npos) << abort.reason();
}

TEST(NcclAbortTest, PartThatNeverFinishesIsAbortedAfterTheTimeout) {
  ScriptedCollective collective(-1, -1);
  CollectiveAbort abort;
  const auto start = Clock::now();
  const absl::Status status = WaitForCollective(collective, abort, "cuda:0", "ncclReduce", kQuick);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("cuda:0"), std::string::npos) << status;
  EXPECT_GE(seconds, 0.5);
  EXPECT_LT(seconds, 2.0);
  EXPECT_EQ(collective.aborts(), 1);
  EXPECT_TRUE(abort.requested());
}

TEST(NcclAbortTest, RankWaitingForAFailedPeerIsAbortedPromptly) {
  // Rank 0 waits for its peer (never finishes by itself); rank 1's device fails after ~50 ms.
  // With a 60 s timeout, rank 0 must still return within a second, aborted, naming cuda:1.
  const CollectiveWaitOptions patient = {std::chrono::seconds(60), milliseconds(1)};
  ScriptedCollective waiting(-1, -1);
  ScriptedCollective failing(-1, /*polls_until_error=*/50);
  CollectiveAbort abort;
  absl::Status waiting_status, failing_status;
  const auto start = Clock::now();
  std::thread rank0(
      [&] { waiting_status = WaitForCollective(waiting, abort, "cuda:0", "ncclReduce", patient); });
  std::thread rank1(
      [&] { failing_status = WaitForCollective(failing, abort, "cuda:1", "ncclReduce", patient); });
  rank0.join();
  rank1.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, 1.0);
  EXPECT_EQ(failing_status.code(), absl::StatusCode::kInternal) << failing_status;
  EXPECT_EQ(waiting_status.code(), absl::StatusCode::kAborted) << waiting_status;
  EXPECT_NE(waiting_status.message().find("cuda:1"), std::string::npos) << waiting_status;
  EXPECT_EQ(waiting.aborts(), 1);
  EXPECT_EQ(failing.aborts(), 1);
}

TEST(NcclAbortTest, AnAbortRequestedEarlierStopsTheNextWaitAtOnce) {
  CollectiveAbort abort;
  abort.Request("cuda:1 failed in ncclReduce: first");
  abort.Request("second");  // the first reason is kept
  EXPECT_EQ(abort.reason(), "cuda:1 failed in ncclReduce: first");
  ScriptedCollective collective(-1, -1);
  const absl::Status status = WaitForCollective(collective, abort, "cuda:0", "ncclReduce", kQuick);
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_EQ(collective.aborts(), 1);
}

}  // namespace
}  // namespace attngrad::server
