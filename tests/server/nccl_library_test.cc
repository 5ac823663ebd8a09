// NcclLibrary, the dlopen() wrapper around libnccl.so.2 (server/nccl_library.h), without a GPU:
// a library that is not there gives a clear UNAVAILABLE status, version codes read right, and when
// this machine has NCCL (and the build nccl.h) it loads and reports a 2.x version.
#include <gtest/gtest.h>

#include "devices/nccl_library.h"

namespace attngrad::server::testing {
namespace {

TEST(NcclLibraryTest, MissingLibraryIsAClearError) {
  const std::string name = "libattngrad-no-such-nccl.so.2";
  absl::StatusOr<std::unique_ptr<NcclLibrary>> library = NcclLibrary::Load(name);
  ASSERT_FALSE(library.ok());
  EXPECT_EQ(library.status().code(), absl::StatusCode::kUnavailable) << library.status();
  EXPECT_NE(library.status().message().find(name), std::string::npos) << library.status();
#ifdef ATTNGRAD_HAVE_NCCL_HEADER
  EXPECT_NE(library.status().message().find("dlopen"), std::string::npos) << library.status();
#else
  EXPECT_NE(library.status().message().find("nccl.h"), std::string::npos) << library.status();
#endif
}

TEST(NcclLibraryTest, LibraryWithoutTheSymbolsIsRefused) {
#ifndef ATTNGRAD_HAVE_NCCL_HEADER
  GTEST_SKIP() << "built without nccl.h";
#else
  // libm opens fine but has no ncclGetVersion.
  absl::StatusOr<std::unique_ptr<NcclLibrary>> library = NcclLibrary::Load("libm.so.6");
  ASSERT_FALSE(library.ok());
  EXPECT_EQ(library.status().code(), absl::StatusCode::kUnavailable) << library.status();
  EXPECT_NE(library.status().message().find("not found"), std::string::npos) << library.status();
#endif
}

TEST(NcclLibraryTest, VersionStrings) {
  EXPECT_EQ(NcclVersionString(2804), "2.8.4");    // before 2.9: X*1000 + Y*100 + Z
  EXPECT_EQ(NcclVersionString(21805), "2.18.5");  // from 2.9 on: X*10000 + Y*100 + Z
  EXPECT_EQ(NcclVersionString(22809), "2.28.9");
  EXPECT_EQ(NcclVersionString(0), "unknown");
}

TEST(NcclLibraryTest, LoadsTheInstalledLibrary) {
  absl::StatusOr<std::unique_ptr<NcclLibrary>> library = NcclLibrary::Load();
  if (!library.ok()) GTEST_SKIP() << "NCCL not loadable here: " << library.status();
  EXPECT_EQ((*library)->name(), kNcclLibraryName);
  EXPECT_GE((*library)->version_code(), 2000);
  EXPECT_EQ((*library)->version().rfind("2.", 0), 0u) << (*library)->version();
#ifdef ATTNGRAD_HAVE_NCCL_HEADER
  EXPECT_NE((*library)->reduce, nullptr);
  EXPECT_NE((*library)->comm_init_all, nullptr);
  EXPECT_NE((*library)->comm_destroy, nullptr);
  EXPECT_TRUE((*library)->Check(ncclSuccess, "nothing").ok());
  const absl::Status failed = (*library)->Check(ncclInvalidArgument, "ncclReduce of the test");
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_NE(failed.message().find("ncclReduce of the test: NCCL error 4"), std::string::npos)
      << failed;
  EXPECT_NE(failed.message().find("invalid argument"), std::string::npos) << failed;
#endif
}

}  // namespace
}  // namespace attngrad::server::testing
