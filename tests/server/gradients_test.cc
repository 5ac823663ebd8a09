// ACCUMULATE, FetchGradients and ZeroGradients: sums over concurrent streams, batch-id dedup within
// a window, fetch-and-zero, window ids, and a cancelled stream.
#include <thread>

#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

class ServerGradientsTest : public ServerTest {
 protected:
  // Sum of the reference weight gradients of `batches`.
  LayerTensors SumOfReferences(const std::vector<Batch>& batches) {
    LayerTensors sum = ZeroWeights<std::vector<float>>(config());
    for (const Batch& batch : batches) {
      const Gradients gradients = Reference(weights(), batch);
      for (Weight i : kAllWeights) {
        for (std::size_t j = 0; j < sum[i].size(); ++j) {
          sum[i][j] += gradients.weights[i][j];
        }
      }
    }
    return sum;
  }

  Fetched FetchAll(bool zero, v1::DType dtype = v1::DTYPE_FLOAT32, std::int64_t chunk_bytes = 0) {
    v1::FetchGradientsRequest request;
    request.set_zero_after_fetch(zero);
    request.set_dtype(dtype);
    request.set_chunk_bytes(chunk_bytes);
    return Fetch(stub(), request);
  }
};

TEST_F(ServerGradientsTest, AccumulateFromConcurrentStreamsEqualsSumOfReturn) {
  constexpr int kStreams = 3, kPerStream = 2;
  std::vector<Batch> batches;
  for (int i = 0; i < kStreams * kPerStream; ++i)
    batches.push_back(MakeBatch(config(), 1, 3, 500 + i));
  std::vector<std::thread> threads;
  std::vector<std::vector<v1::BackwardResponse>> responses(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      auto stub = NewStub();
      std::vector<v1::BackwardRequest> requests;
      for (int k = 0; k < kPerStream; ++k) {
        const int index = s * kPerStream + k;
        requests.push_back(
            MakeRequest(config(), batches[index], index, v1::GRADIENT_MODE_ACCUMULATE));
      }
      responses[s] = RunStream(*stub, requests);
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::uint64_t window = 0;
  for (const auto& stream : responses) {
    ASSERT_EQ(stream.size(), static_cast<std::size_t>(kPerStream));
    for (const v1::BackwardResponse& response : stream) {
      ASSERT_FALSE(response.has_error()) << response.error().message();
      EXPECT_FALSE(response.duplicate());
      if (window == 0) window = response.accumulation_window_id();
      EXPECT_EQ(response.accumulation_window_id(), window);
    }
  }
  // The reference: the RETURN gradients of one batch through the server equal BackwardHost
  // (ServerBackwardTest), so the sum of BackwardHost's is the sum of RETURN gradients; check one
  // here too.
  const v1::BackwardResponse returned =
      RunOne(stub(), MakeRequest(config(), batches[0], 99, v1::GRADIENT_MODE_RETURN));
  ASSERT_FALSE(returned.has_error());
  LayerTensors sum = ResponseWeightGradients(returned);
  for (std::size_t i = 1; i < batches.size(); ++i) {
    const Gradients gradients = Reference(weights(), batches[i]);
    for (Weight w : kAllWeights) {
      for (std::size_t j = 0; j < sum[w].size(); ++j) sum[w][j] += gradients.weights[w][j];
    }
  }
  const Fetched fetched = FetchAll(/*zero=*/false);
  ASSERT_TRUE(fetched.status.ok()) << fetched.status.error_message();
  EXPECT_EQ(fetched.state.batches(), kStreams * kPerStream);
  EXPECT_EQ(fetched.state.tokens(), kStreams * kPerStream * 3);
  EXPECT_EQ(fetched.state.window_id(), window);
  EXPECT_EQ(fetched.state.weights_version(), 1u);
  EXPECT_EQ(fetched.state.server_instance_id(), server().instance_id());
  EXPECT_TRUE(Close(fetched.gradients, sum, Tolerance(1e-5), "accumulated"));
}

TEST_F(ServerGradientsTest, RetriedBatchIdIsAnsweredButNotCountedTwice) {
  const Batch batch = MakeBatch(config(), 1, 4, 600);
  const Batch other = MakeBatch(config(), 1, 4, 601);
  const v1::BackwardRequest request =
      MakeRequest(config(), batch, 77, v1::GRADIENT_MODE_ACCUMULATE);
  const v1::BackwardResponse first = RunOne(stub(), request);
  const v1::BackwardResponse again = RunOne(stub(), request);  // a retry on a new stream
  ASSERT_FALSE(first.has_error());
  ASSERT_FALSE(again.has_error());
  EXPECT_FALSE(first.duplicate());
  EXPECT_TRUE(again.duplicate());
  EXPECT_EQ(first.accumulation_window_id(), again.accumulation_window_id());
  EXPECT_TRUE(Close(ToFloats(again.grad_hidden_states()), ToFloats(first.grad_hidden_states()),
                    Tolerance(0), "retried grad_hidden_states"));
  // A different batch with another id counts.
  ASSERT_FALSE(
      RunOne(stub(), MakeRequest(config(), other, 78, v1::GRADIENT_MODE_ACCUMULATE)).has_error());
  const Fetched fetched = FetchAll(/*zero=*/true);
  ASSERT_TRUE(fetched.status.ok());
  EXPECT_EQ(fetched.state.batches(), 2);
  EXPECT_TRUE(Close(fetched.gradients, SumOfReferences({batch, other}), Tolerance(1e-5),
                    "deduplicated sum"));
  // In the next window the same id counts again.
  const v1::BackwardResponse next_window = RunOne(stub(), request);
  EXPECT_FALSE(next_window.duplicate());
  EXPECT_NE(next_window.accumulation_window_id(), first.accumulation_window_id());
  const Fetched second = FetchAll(/*zero=*/false);
  EXPECT_EQ(second.state.batches(), 1);
  EXPECT_TRUE(Close(second.gradients, SumOfReferences({batch}), Tolerance(1e-5), "new window"));
}

TEST_F(ServerGradientsTest, FetchAndZeroStartsANewWindow) {
  const Batch batch = MakeBatch(config(), 2, 2, 700);
  const v1::BackwardResponse accumulated =
      RunOne(stub(), MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_ACCUMULATE));
  ASSERT_FALSE(accumulated.has_error());
  const std::uint64_t window = accumulated.accumulation_window_id();
  const LayerTensors expected = SumOfReferences({batch});

  // Small chunks, bf16 on the wire: reassembled, equal up to bf16 rounding (2^-8 relative).
  const Fetched peek = FetchAll(/*zero=*/false, v1::DTYPE_BFLOAT16, 64 * 1024);
  ASSERT_TRUE(peek.status.ok());
  EXPECT_GT(peek.chunks, 100);
  EXPECT_TRUE(Close(peek.gradients, expected, Tolerance(8e-3), "bf16 fetch"));

  const Fetched fetched = FetchAll(/*zero=*/true);
  ASSERT_TRUE(fetched.status.ok());
  EXPECT_EQ(fetched.state.window_id(), window);
  EXPECT_EQ(fetched.state.batches(), 1);
  EXPECT_EQ(fetched.state.tokens(), 4);
  EXPECT_TRUE(Close(fetched.gradients, expected, Tolerance(1e-5), "fetched"));

  const Fetched after = FetchAll(/*zero=*/false);
  ASSERT_TRUE(after.status.ok());
  EXPECT_EQ(after.state.window_id(), window + 1);
  EXPECT_EQ(after.state.batches(), 0);
  EXPECT_TRUE(
      Close(after.gradients, ZeroWeights<std::vector<float>>(config()), Tolerance(0), "zeroed"));

  // Naming the old window is refused, in-band, and nothing is added.
  v1::BackwardRequest stale = MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_ACCUMULATE);
  stale.set_accumulation_window_id(window);
  const v1::BackwardResponse refused = RunOne(stub(), stale);
  EXPECT_EQ(refused.error().code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  EXPECT_NE(refused.error().message().find("accumulation_window_id"), std::string::npos);
  v1::FetchGradientsRequest stale_fetch;
  stale_fetch.set_expected_window_id(window);
  EXPECT_EQ(Fetch(stub(), stale_fetch).status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  // Naming the current one works; ZeroGradients reports what it discarded.
  stale.set_accumulation_window_id(window + 1);
  ASSERT_FALSE(RunOne(stub(), stale).has_error());
  v1::ZeroGradientsRequest zero;
  zero.set_expected_window_id(window);
  v1::ZeroGradientsResponse zeroed;
  {
    grpc::ClientContext context;
    EXPECT_EQ(stub().ZeroGradients(&context, zero, &zeroed).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  zero.set_expected_window_id(window + 1);
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub().ZeroGradients(&context, zero, &zeroed).ok());
  }
  EXPECT_EQ(zeroed.previous().window_id(), window + 1);
  EXPECT_EQ(zeroed.previous().batches(), 1);
  EXPECT_EQ(zeroed.current().window_id(), window + 2);
  EXPECT_EQ(zeroed.current().batches(), 0);
  const Fetched empty = FetchAll(/*zero=*/false);
  EXPECT_EQ(empty.state.batches(), 0);
  EXPECT_TRUE(Close(empty.gradients, ZeroWeights<std::vector<float>>(config()), Tolerance(0),
                    "after ZeroGradients"));
}

TEST_F(ServerGradientsTest, CancelledStreamLeavesAccumulatorsConsistent) {
  std::vector<Batch> batches;
  std::vector<v1::BackwardRequest> requests;
  for (int i = 0; i < 4; ++i) {
    batches.push_back(MakeBatch(config(), 1, 3, 800 + i));
    requests.push_back(MakeRequest(config(), batches.back(), 10 + i, v1::GRADIENT_MODE_ACCUMULATE));
  }
  {
    grpc::ClientContext context;
    auto stream = stub().Backward(&context);
    for (const v1::BackwardRequest& request : requests) stream->Write(request);
    v1::BackwardResponse response;
    ASSERT_TRUE(stream->Read(&response));  // at least one batch is in
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Batches are taken in stream order, so the accumulators hold a prefix of them, exactly.
  const Fetched partial = FetchAll(/*zero=*/false);
  ASSERT_TRUE(partial.status.ok());
  const long long taken = partial.state.batches();
  ASSERT_GE(taken, 1);
  ASSERT_LE(taken, 4);
  EXPECT_TRUE(Close(partial.gradients,
                    SumOfReferences(std::vector<Batch>(batches.begin(), batches.begin() + taken)),
                    Tolerance(1e-5), "after cancel"));
  // The client retries everything: what was taken is a duplicate, the rest is added.
  const std::vector<v1::BackwardResponse> retried = RunStream(stub(), requests);
  ASSERT_EQ(retried.size(), 4u);
  // A batch the cancelled stream had read just before the cancel may have been taken after the
  // fetch above; either way the duplicates are again a prefix, at least as long as `taken`.
  long long duplicates = 0;
  for (const v1::BackwardResponse& response : retried) {
    ASSERT_FALSE(response.has_error()) << response.error().message();
    duplicates += response.duplicate();
  }
  EXPECT_GE(duplicates, taken);
  for (const v1::BackwardResponse& response : retried) {
    EXPECT_EQ(response.duplicate(), static_cast<long long>(response.batch_id() - 10) < duplicates)
        << "batch " << response.batch_id();
  }
  const Fetched full = FetchAll(/*zero=*/false);
  EXPECT_EQ(full.state.batches(), 4);
  EXPECT_TRUE(Close(full.gradients, SumOfReferences(batches), Tolerance(1e-5), "after retry"));
}

}  // namespace
}  // namespace attngrad::server::testing
