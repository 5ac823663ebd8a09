// The in-flight memory budget (--max_inflight_bytes): nothing large is allocated before the data
// that needs it arrives, and clients that do not read their answers are refused with
// RESOURCE_EXHAUSTED instead of growing the server.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <thread>

#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
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

}  // namespace
}  // namespace attngrad::server::testing
