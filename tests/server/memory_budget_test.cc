// The in-flight memory budget (--max_inflight_bytes): nothing large is allocated before the data
// that needs it arrives, clients that do not read their answers are refused with
// RESOURCE_EXHAUSTED instead of growing the server, one client holds at most its share of the
// budget (--max_inflight_share_per_client) so that it cannot refuse the others, and streaming calls
// that make no progress end after --stream_idle_timeout_seconds and give their memory back.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <thread>

#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "scheduling/memory_budget.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

// This process's resident set (the server runs in it).
std::int64_t ResidentBytes() {
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  long long total_pages = 0, resident_pages = 0;
  if (statm != nullptr) {
    if (std::fscanf(statm, "%lld %lld", &total_pages, &resident_pages) != 2) resident_pages = 0;
    std::fclose(statm);
  }
  return resident_pages * sysconf(_SC_PAGESIZE);
}

class ServerIdleUploadTest : public ServerTest {};

TEST_F(ServerIdleUploadTest, SixteenUploadsThatSendOneSmallChunkTakeNoLayerOfMemory) {
  constexpr int kStreams = 16;
  const std::int64_t before = ResidentBytes();
  struct Upload {
    grpc::ClientContext context;
    v1::LoadWeightsResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::LoadWeightsRequest>> writer;
  };
  std::vector<std::unique_ptr<Upload>> uploads;
  for (int i = 0; i < kStreams; ++i) {
    auto upload = std::make_unique<Upload>();
    upload->writer = stub().LoadWeights(&upload->context, &upload->response);
    v1::LoadWeightsRequest chunk;
    chunk.set_name(v1::WEIGHT_NAME_Q_PROJ);
    chunk.set_dtype(v1::DTYPE_FLOAT32);
    for (std::int64_t dim : WeightShape(config(), Weight::kQProj)) chunk.add_shape(dim);
    wire::EncodeFromFloat(std::vector<float>(16, 0.5f), v1::DTYPE_FLOAT32, chunk.mutable_data());
    ASSERT_TRUE(upload->writer->Write(chunk));
    uploads.push_back(std::move(upload));
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));  // the server has read every chunk
  const std::int64_t grown = ResidentBytes() - before;
  // A whole layer's fp32 staging is 63 MB (Gemma-3 4B): 16 of them were 1 GB.
  EXPECT_LT(grown, std::int64_t{64} << 20) << "resident set grew by " << grown << " bytes";
  for (auto& upload : uploads) upload->context.TryCancel();
  for (auto& upload : uploads) upload->writer->Finish();
}

class ServerMemoryBudgetTest : public ServerTest {
 protected:
  // Smaller than one RETURN answer (63 MB of weight gradients), which is served when alone.
  void Customize(ServerOptions& options) override { options.max_inflight_bytes = 16 << 20; }

  v1::BackwardRequest Request(std::uint64_t batch_id) {
    return MakeRequest(config(), MakeBatch(config(), 1, 4, batch_id), batch_id,
                       v1::GRADIENT_MODE_RETURN);
  }
};

TEST_F(ServerMemoryBudgetTest, ASlowReaderOverTheBudgetGetsResourceExhausted) {
  {
    grpc::ClientContext context;
    auto stream = stub().Backward(&context);
    // Batch 1's answer is not read while batches 2 and 3 arrive: it holds the budget.
    for (std::uint64_t id : {1, 2, 3}) ASSERT_TRUE(stream->Write(Request(id)));
    stream->WritesDone();
    std::map<std::uint64_t, v1::BackwardResponse> answers;
    v1::BackwardResponse response;
    while (stream->Read(&response)) answers[response.batch_id()] = response;
    EXPECT_TRUE(stream->Finish().ok());
    ASSERT_EQ(answers.size(), 3u);
    EXPECT_FALSE(answers[1].has_error()) << answers[1].error().message();
    for (std::uint64_t id : {2, 3}) {
      EXPECT_EQ(answers[id].error().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED))
          << id;
      EXPECT_NE(answers[id].error().message().find("--max_inflight_bytes"), std::string::npos)
          << answers[id].error().message();
    }
  }
  // Everything was given back: the next batch is served.
  const v1::BackwardResponse again = RunOne(stub(), Request(4));
  EXPECT_FALSE(again.has_error()) << again.error().message();
}

TEST_F(ServerMemoryBudgetTest, AFetchNotReadHoldsTheBudgetAndASecondIsRefused) {
  // The window holds sums (a fetch of an empty window holds no memory).
  const v1::BackwardResponse accumulated = RunOne(
      stub(), MakeRequest(config(), MakeBatch(config(), 1, 4, 9), 9, v1::GRADIENT_MODE_ACCUMULATE));
  ASSERT_FALSE(accumulated.has_error()) << accumulated.error().message();
  grpc::ClientContext unread_context;
  v1::FetchGradientsRequest request;
  auto unread = stub().FetchGradients(&unread_context, request);
  v1::GradientChunk chunk;
  ASSERT_TRUE(unread->Read(&chunk));  // started: the layer's sums are held, the rest not read
  const Fetched second = Fetch(stub(), request);
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << second.status.error_message();
  EXPECT_NE(second.status.error_message().find("--max_inflight_bytes"), std::string::npos)
      << second.status.error_message();
  unread_context.TryCancel();
  unread->Finish();
}

TEST(MemoryBudgetTest, OneClientHoldsAtMostItsShare) {
  MemoryBudget budget(1000, 0.5);
  EXPECT_EQ(budget.per_client_limit(), 500);
  absl::StatusOr<MemoryBudget::Reservation> first = budget.Reserve("greedy", 400, "first");
  ASSERT_TRUE(first.ok()) << first.status();
  const absl::StatusOr<MemoryBudget::Reservation> over = budget.Reserve("greedy", 200, "second");
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("--max_inflight_share_per_client"), std::string::npos)
      << over.status();
  EXPECT_NE(over.status().message().find("'greedy'"), std::string::npos) << over.status();
  // The rest of the budget is the others'.
  absl::StatusOr<MemoryBudget::Reservation> other = budget.Reserve("honest", 500, "other");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(budget.in_use("greedy"), 400);
  EXPECT_EQ(budget.in_use("honest"), 500);
  // Server-wide: the budget is full.
  EXPECT_EQ(budget.Reserve("third", 200, "third").status().code(),
            absl::StatusCode::kResourceExhausted);
  // Given back piece by piece.
  MemoryBudget::Reservation part = first->Split(300);
  part.Release();
  EXPECT_EQ(budget.in_use("greedy"), 100);
  first->Release();
  other->Release();
  EXPECT_EQ(budget.in_use(), 0);
  EXPECT_EQ(budget.in_use("greedy"), 0);
  // One reservation larger than the share is served when its client holds nothing else.
  EXPECT_TRUE(budget.Reserve("greedy", 800, "alone").ok());
}

TEST(MemoryBudgetTest, ShareOneIsNoPerClientLimit) {
  MemoryBudget budget(1000, 1.0);
  absl::StatusOr<MemoryBudget::Reservation> first = budget.Reserve("only", 600, "first");
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(budget.Reserve("only", 400, "second").ok());
}

// The budget is 8 RETURN answers and each client may hold half of it.
class ServerMemoryShareTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override {
    options.max_inflight_bytes = 8 * AnswerBytes();
    options.max_inflight_share_per_client = 0.5;
  }

  // The answer of a 1x4 RETURN batch (its six weight gradients dominate) and its request.
  std::int64_t AnswerBytes() const {
    return static_cast<std::int64_t>(PackedWeightLayout(config()).total_elements * sizeof(float)) +
           (1 << 20);
  }

  v1::BackwardRequest Request(std::uint64_t batch_id) {
    return MakeRequest(config(), MakeBatch(config(), 1, 4, batch_id), batch_id,
                       v1::GRADIENT_MODE_RETURN);
  }

  // Waits (at most 60 s) until `done` holds.
  static bool WaitFor(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }
};

// A client that reads none of its RETURN answers holds at most its share; another client is served.
// (Before: its two streams' eight unread answers held the whole budget and every other client's
// batches were RESOURCE_EXHAUSTED until the hog read or its streams idled out.)
TEST_F(ServerMemoryShareTest, ASlowReaderHoldsAtMostItsShareAndOthersAreServed) {
  auto hog_stub = NewStub();
  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::BackwardRequest, v1::BackwardResponse>> stream;
  };
  std::vector<std::unique_ptr<Stream>> hogs;
  std::uint64_t batch_id = 100;
  for (int s = 0; s < 2; ++s) {
    auto hog = std::make_unique<Stream>();
    hog->context.AddMetadata("attngrad-client-id", "hog");
    hog->stream = hog_stub->Backward(&hog->context);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(hog->stream->Write(Request(++batch_id)));
    hogs.push_back(std::move(hog));
  }
  // The hog's eight batches are all handed in (reserved, or refused: RESOURCE_EXHAUSTED answers).
  const MemoryBudget& memory = server().inflight_memory();
  ASSERT_TRUE(WaitFor([&] { return memory.in_use("hog") >= 3 * AnswerBytes(); }));
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_LE(memory.in_use("hog"), memory.per_client_limit());
  // An honest client's RETURN batch (its own client id) is served.
  grpc::ClientContext context;
  context.AddMetadata("attngrad-client-id", "honest");
  auto stream = stub().Backward(&context);
  ASSERT_TRUE(stream->Write(Request(1)));
  stream->WritesDone();
  v1::BackwardResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_FALSE(answer.has_error()) << answer.error().message();
  EXPECT_TRUE(stream->Finish().ok());
  for (auto& hog : hogs) hog->context.TryCancel();
  for (auto& hog : hogs) hog->stream->Finish();
}

// Unread FetchGradients of one client's empty window hold no memory, and its unread fetches of
// sums hold at most its share. (Before: each reserved a whole layer, ~98 MiB for this layer,
// before any data existed, and a few refused every other client's batches.)
TEST_F(ServerMemoryShareTest, UnreadFetchesOfOneClientDoNotRefuseAnother) {
  auto hog_stub = NewStub();
  struct Call {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::GradientChunk>> reader;
  };
  std::vector<std::unique_ptr<Call>> fetches;
  for (int i = 0; i < 12; ++i) {
    auto call = std::make_unique<Call>();
    call->context.AddMetadata("attngrad-client-id", "hog");
    call->reader = hog_stub->FetchGradients(&call->context, v1::FetchGradientsRequest());
    v1::GradientChunk chunk;
    ASSERT_TRUE(call->reader->Read(&chunk));  // started, then left unread
    fetches.push_back(std::move(call));
  }
  EXPECT_EQ(server().inflight_memory().in_use("hog"), 0);
  const v1::BackwardResponse answer = RunOne(stub(), Request(1));
  EXPECT_FALSE(answer.has_error()) << answer.error().message();
  for (auto& call : fetches) call->context.TryCancel();
  for (auto& call : fetches) call->reader->Finish();
}

// Streaming calls that make no progress end after --stream_idle_timeout_seconds (before: only
// Backward streams did, and an unread FetchGradients or a stalled LoadWeights stayed forever).
class ServerIdleCallTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override { options.stream_idle_timeout_seconds = 2; }
};

TEST_F(ServerIdleCallTest, AnUnreadFetchEndsAndGivesItsMemoryBack) {
  const v1::BackwardResponse accumulated = RunOne(
      stub(), MakeRequest(config(), MakeBatch(config(), 1, 4, 3), 3, v1::GRADIENT_MODE_ACCUMULATE));
  ASSERT_FALSE(accumulated.has_error()) << accumulated.error().message();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub().FetchGradients(&context, v1::FetchGradientsRequest());
  v1::GradientChunk chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  const MemoryBudget& memory = server().inflight_memory();
  EXPECT_GT(memory.in_use(), 0);
  // Not read for longer than the timeout: the server ends the call.
  std::this_thread::sleep_for(std::chrono::seconds(4));
  const auto start = std::chrono::steady_clock::now();
  while (reader->Read(&chunk)) {
  }
  const grpc::Status status = reader->Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // The client sees the cancelled write or the idle end; the server ends it as idle.
  EXPECT_TRUE(status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
              status.error_code() == grpc::StatusCode::CANCELLED)
      << status.error_code() << " " << status.error_message();
  EXPECT_NE(status.error_message(), "Deadline Exceeded")
      << "the client's deadline, not the idle end";
  for (int i = 0; i < 100 && memory.in_use() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(memory.in_use(), 0);
}

TEST_F(ServerIdleCallTest, AStalledUploadEndsAndChangesNothing) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::LoadWeightsResponse response;
  auto writer = stub().LoadWeights(&context, &response);
  v1::LoadWeightsRequest chunk;
  chunk.set_name(v1::WEIGHT_NAME_Q_NORM);
  chunk.set_dtype(v1::DTYPE_FLOAT32);
  chunk.add_shape(config().head_dim);
  wire::EncodeFromFloat(std::vector<float>(16, 0.5f), v1::DTYPE_FLOAT32, chunk.mutable_data());
  ASSERT_TRUE(writer->Write(chunk));
  // Nothing more, no half-close.
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status status = writer->Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_NE(status.error_message().find("--stream_idle_timeout_seconds"), std::string::npos)
      << status.error_message();
  // The staged chunk is given back when gRPC is done with the call, a moment after its end.
  const MemoryBudget& memory = server().inflight_memory();
  for (int i = 0; i < 100 && memory.in_use() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(memory.in_use(), 0);
}

}  // namespace
}  // namespace attngrad::server::testing
