// The staging of a batch's inputs (scheduling/staging.h), which GPU servers do on arrival into
// page-locked memory: here with an ordinary common::BufferPool, since the copy does not depend on
// where the pool's memory comes from. The layout is the one the GPU worker copies in
// (hidden_states | grad_output, each in a float-sized slot per element, | cos | sin), values as
// received (16-bit ones too), a value that is not finite is INVALID_ARGUMENT naming the element,
// and a staged job keeps its dtypes but lets the received bytes go.
#include "scheduling/staging.h"

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/v1/tensor.pb.h"
#include "attngrad/wire/tensor.h"
#include "gtest/gtest.h"

namespace attngrad::server {
namespace {

// A job of B=1, S=3 on a layer of hidden size 4 whose activations arrive as `dtype`, each in
// several pieces (as gRPC's slices), with rotary tables of head_dim 2.
struct SmallJob {
  explicit SmallJob(int dtype) {
    job.request.batch = 1;
    job.request.seq_len = 3;
    job.request.config.hidden_size = 4;
    job.request.config.num_heads = 2;
    job.request.config.num_kv_heads = 1;
    job.request.config.head_dim = 2;
    for (int i = 0; i < 12; ++i) {
      hidden.push_back(0.5f * static_cast<float>(i) - 1.f);
      grad.push_back(2.f - 0.25f * static_cast<float>(i));
    }
    job.request.hidden_states = InPieces(hidden, dtype, &hidden_bytes);
    job.request.grad_output = InPieces(grad, dtype, &grad_bytes);
    job.request.cos = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
    job.request.sin = {-1.f, -2.f, -3.f, -4.f, -5.f, -6.f};
  }

  // `values` encoded as `dtype` into *bytes and cut into pieces of 5 bytes (not whole elements).
  static WireTensor InPieces(const std::vector<float>& values, int dtype, std::string* bytes) {
    bytes->clear();
    wire::EncodeFromFloat(values, dtype, bytes);
    std::vector<absl::string_view> pieces;
    for (std::size_t at = 0; at < bytes->size(); at += 5) {
      pieces.push_back(absl::string_view(*bytes).substr(at, 5));
    }
    return WireTensor(dtype, std::move(pieces), nullptr);
  }

  std::vector<float> hidden, grad;
  std::string hidden_bytes, grad_bytes;
  BatchJob job;
};

TEST(StagingTest, StagedInputsAreTheReceivedBytesInTheWorkersLayout) {
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16}) {
    SmallJob small(dtype);
    ASSERT_EQ(StagingElements(small.job), 2u * 12 + 6 + 6);
    auto pool = common::BufferPool::Create(1 << 20);
    common::ParallelTasks threads(3);
    ASSERT_TRUE(StageOnArrival(*pool, threads, small.job).ok());
    ASSERT_NE(small.job.arrival.staged_inputs.data(), nullptr);
    const char* staged = small.job.arrival.staged_inputs.data();
    // hidden_states at float 0, grad_output at float 12, as received; cos and sin after them.
    EXPECT_EQ(std::memcmp(staged, small.hidden_bytes.data(), small.hidden_bytes.size()), 0)
        << "dtype " << dtype;
    EXPECT_EQ(
        std::memcmp(staged + 12 * sizeof(float), small.grad_bytes.data(), small.grad_bytes.size()),
        0)
        << "dtype " << dtype;
    const float* tables = reinterpret_cast<const float*>(staged) + 24;
    EXPECT_EQ(std::vector<float>(tables, tables + 6), small.job.request.cos);
    EXPECT_EQ(std::vector<float>(tables + 6, tables + 12), small.job.request.sin);
    // The dtypes stay; the received bytes are let go.
    EXPECT_EQ(small.job.request.hidden_states.dtype(), dtype);
    EXPECT_EQ(small.job.request.grad_output.dtype(), dtype);
    EXPECT_EQ(small.job.request.hidden_states.size_bytes(), 0u);
    EXPECT_EQ(small.job.request.grad_output.size_bytes(), 0u);
    EXPECT_GT(small.job.result.stages.copy_in, 0.0);
  }
}

TEST(StagingTest, ANonFiniteValueIsInvalidArgumentNamingTheElement) {
  SmallJob small(v1::DTYPE_FLOAT32);
  small.grad[7] = std::numeric_limits<float>::quiet_NaN();
  small.job.request.grad_output =
      SmallJob::InPieces(small.grad, v1::DTYPE_FLOAT32, &small.grad_bytes);
  auto pool = common::BufferPool::Create(1 << 20);
  common::ParallelTasks threads(2);
  const absl::Status status = StageOnArrival(*pool, threads, small.job);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("grad_output.raw_data"), std::string::npos) << status;
  EXPECT_NE(status.message().find("7"), std::string::npos) << status;
  EXPECT_EQ(small.job.arrival.staged_inputs.data(), nullptr);
}

// Every element position, in every wire dtype, in pieces of 5 bytes (elements split between two
// pieces included) and in one piece: a NaN or Inf is found and named, in either tensor.
TEST(StagingTest, EveryNonFiniteElementIsFoundWhereverThePiecesSplitIt) {
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16}) {
    for (int at = 0; at < 12; ++at) {
      for (bool in_grad : {false, true}) {
        SmallJob small(dtype);
        std::vector<float>& values = in_grad ? small.grad : small.hidden;
        values[static_cast<std::size_t>(at)] = at % 2 == 0
                                                   ? std::numeric_limits<float>::quiet_NaN()
                                                   : -std::numeric_limits<float>::infinity();
        (in_grad ? small.job.request.grad_output : small.job.request.hidden_states) =
            SmallJob::InPieces(values, dtype, in_grad ? &small.grad_bytes : &small.hidden_bytes);
        auto pool = common::BufferPool::Create(1 << 20);
        common::ParallelTasks threads(2);
        const absl::Status status = StageOnArrival(*pool, threads, small.job);
        EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
            << "dtype " << dtype << " at " << at;
        const std::string field = in_grad ? "grad_output.raw_data" : "hidden_states.raw_data";
        EXPECT_NE(status.message().find(field), std::string::npos) << status;
        EXPECT_NE(status.message().find(absl::StrCat("element ", at)), std::string::npos) << status;
      }
    }
  }
}

// Large pieces of an odd size, as gRPC's slices may be (copied in one pass with streaming
// stores): the same bytes as received, and a non-finite element found and named wherever it is,
// the ones split between two pieces included.
TEST(StagingTest, LargeOddPiecesAreCopiedAndCheckedExactly) {
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    const std::size_t size = dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
    std::vector<float> values(6000);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.001f * static_cast<float>(i);
    // 4099-byte pieces: element 4099 / size (and every later piece boundary) is split.
    for (std::size_t at :
         {std::size_t{0}, 4099 / size, 2 * 4099 / size, std::size_t{5999}, std::size_t{6000}}) {
      std::vector<float> with_bad = values;
      if (at < with_bad.size()) with_bad[at] = std::numeric_limits<float>::quiet_NaN();
      std::string bytes;
      wire::EncodeFromFloat(with_bad, dtype, &bytes);
      std::vector<absl::string_view> pieces;
      for (std::size_t offset = 0; offset < bytes.size(); offset += 4099) {
        pieces.push_back(absl::string_view(bytes).substr(offset, 4099));
      }
      const WireTensor tensor(dtype, pieces, nullptr);
      std::vector<char> out(bytes.size() + 16);
      // Elements 3 .. 5999 (a copy that starts inside the first piece), then all of them.
      for (std::size_t first : {std::size_t{3}, std::size_t{0}}) {
        const absl::Status status =
            tensor.CopyFinite(first, values.size() - first, out.data(), "hidden_states.raw_data");
        EXPECT_EQ(0,
                  std::memcmp(out.data(), bytes.data() + first * size, bytes.size() - first * size))
            << "dtype " << dtype << " first " << first;
        if (at >= first && at < values.size()) {
          EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << "at " << at;
          EXPECT_NE(status.message().find(absl::StrCat("element ", at, " ")), std::string::npos)
              << status;
        } else {
          EXPECT_TRUE(status.ok()) << status << " at " << at << " first " << first;
        }
      }
    }
  }
}

TEST(StagingTest, WithoutMemoryFromThePoolTheJobIsLeftToTheWorker) {
  SmallJob small(v1::DTYPE_FLOAT32);
  common::BufferPool::Allocator none;
  none.allocate = [](std::size_t) -> char* { return nullptr; };
  none.free = [](char*) {};
  auto pool = common::BufferPool::Create(0, std::move(none));
  common::ParallelTasks threads(1);
  ASSERT_TRUE(StageOnArrival(*pool, threads, small.job).ok());
  EXPECT_EQ(small.job.arrival.staged_inputs.data(), nullptr);
  EXPECT_EQ(small.job.request.hidden_states.size_bytes(),
            small.hidden_bytes.size());  // still received
}

}  // namespace
}  // namespace attngrad::server
