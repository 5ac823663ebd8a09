// The NCCL abort path on real GPUs (label gpu): an ncclReduce whose peer never joins (a GPU lost
// mid-way) is aborted by WaitForCollective after its timeout instead of spinning for ever, naming
// the device; the other rank, entering a reduction with the aborted one afterwards, is not left
// waiting either. Skips without two GPUs, without libnccl.so.2, or without nccl.h.
#include <chrono>
#include <cstdlib>

#include <gtest/gtest.h>

#include "attngrad/backward.h"
#include "devices/nccl_abort.h"
#include "devices/nccl_library.h"

#ifdef ATTNGRAD_HAVE_NCCL_HEADER
#include "attngrad/cuda_resources.h"
#endif

namespace attngrad::server {
namespace {

TEST(NcclAbortGpuTest, ReductionWithoutItsPeerIsAborted) {
#ifndef ATTNGRAD_HAVE_NCCL_HEADER
  GTEST_SKIP() << "built without nccl.h";
#else
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 GPUs";
  absl::StatusOr<std::unique_ptr<NcclLibrary> > loaded = NcclLibrary::Load();
  if (!loaded.ok()) GTEST_SKIP() << "NCCL is not usable here: " << loaded.status();
  std::shared_ptr<const NcclLibrary> library(*std::move(loaded));
  absl::StatusOr<std::unique_ptr<NcclCommunicators> > communicators =
      NcclCommunicators::Create(library, {0, 1});
  ASSERT_TRUE(communicators.ok()) << communicators.status();
  // 64 MiB: more than NCCL's buffers between the ranks, so no part completes without its peer.
  constexpr std::size_t kElements = std::size_t{1} << 24;
  cuda::DeviceBuffer<float> send[2], receive;
  cuda::Stream streams[2];
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
    ASSERT_EQ(cuda::DeviceBuffer<float>::Create(kElements, &send[rank]), cudaSuccess);
    ASSERT_EQ(cuda::Stream::Create(&streams[rank]), cudaSuccess);
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cuda::DeviceBuffer<float>::Create(kElements, &receive), cudaSuccess);

  // Rank 0 (the root) reduces; rank 1 does not join yet: rank 0 waits for a lost peer.
  ASSERT_EQ(library->reduce(send[0].get(), receive.get(), kElements, ncclFloat32, ncclSum, 0,
                            (*communicators)->comm(0), streams[0].get()),
            ncclSuccess);
  CollectiveAbort abort;
  NcclReductionOnStream root(**communicators, 0, streams[0].get());
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status =
      WaitForCollective(root, abort, "cuda:0", "the test's ncclReduce",
                        {std::chrono::seconds(2), std::chrono::milliseconds(1)});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("cuda:0"), std::string::npos) << status;
  EXPECT_GE(seconds, 2.0);
  EXPECT_LT(seconds, 20.0) << "ncclCommAbort did not return";
  EXPECT_EQ((*communicators)->comm(0), nullptr);
  EXPECT_TRUE(abort.requested());

  // Rank 1 now enters its part with a root that is gone: NCCL may refuse the enqueue, or report an
  // asynchronous error, or leave it waiting; in no case may the wait outlast the first polls (the
  // abort was requested already).
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  const auto peer_start = std::chrono::steady_clock::now();
  const ncclResult_t enqueued =
      library->reduce(send[1].get(), nullptr, kElements, ncclFloat32, ncclSum, 0,
                      (*communicators)->comm(1), streams[1].get());
  if (enqueued == ncclSuccess) {
    NcclReductionOnStream peer(**communicators, 1, streams[1].get());
    const absl::Status peer_status =
        WaitForCollective(peer, abort, "cuda:1", "the test's ncclReduce",
                          {std::chrono::seconds(60), std::chrono::milliseconds(1)});
    EXPECT_FALSE(peer_status.ok());
    if (peer_status.code() == absl::StatusCode::kAborted) {
      EXPECT_NE(peer_status.message().find("cuda:0"), std::string::npos) << peer_status;
    }
  } else {
    (*communicators)->Abort(1);
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - peer_start).count(),
            20.0);
  EXPECT_EQ((*communicators)->comm(1), nullptr);
  for (int rank = 0; rank < 2; ++rank) {
    cudaSetDevice(rank);
    cudaDeviceSynchronize();  // the aborted kernels have ended
  }
#endif
}

}  // namespace
}  // namespace attngrad::server
