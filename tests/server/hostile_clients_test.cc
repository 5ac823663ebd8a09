// One server (CPU backend, in-process, authentication off: protected mode on loopback, so client
// ids are whatever each client claims) while an honest trainer trains and a crowd of hostile
// clients attacks it at the same time:
//   - bad inputs: batches with wrong shapes, non-finite values and unknown layers, under their
//     own client id;
//   - garbage: bytes that are no message to every method, and Backward streams of such bytes;
//   - huge messages: requests over --max_message_bytes;
//   - idle streams: 16 streams under each of 4 self-chosen client ids (the server's 64 stream
//     slots), reopened as soon as the server ends them;
//   - a hog: RETURN batches whose answers it never reads and FetchGradients it never reads, on
//     its own window with sums;
//   - idle connections: TCP connections that send the HTTP/2 preface and SETTINGS and nothing else.
// The honest trainer runs rounds of one Backward stream of ACCUMULATE batches followed by a
// fetch-and-zero of its window. It is never refused (every batch answered without error, every
// call OK, no retry), each round's sums are exact (the batch count equals the batches it sent and
// the sums equal the sum of the reference gradients), and no call of it takes longer than
// kStallBound. The bound is generous for a loaded 2-core machine; the test prints the longest call.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>

#include "absl/strings/str_cat.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

using Clock = std::chrono::steady_clock;

// No call of the honest trainer (a round's stream of batches, or a fetch) may take longer.
constexpr auto kStallBound = std::chrono::seconds(20);
constexpr int kRounds = 6;
constexpr int kBatchesPerRound = 3;
constexpr int kIdleClientIds = 4;
constexpr int kIdleStreamsPerId = 16;  // --max_streams_per_client's default
constexpr int kIdleConnections = 100;
constexpr std::int64_t kMaxMessageBytes = std::int64_t{128} << 20;

// Client contexts the attackers have open, cancelled all at once when the attack stops.
class Contexts {
 public:
  // False once stopped (the caller must not start its call then).
  bool Add(grpc::ClientContext* context) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return false;
    open_.insert(context);
    return true;
  }
  void Remove(grpc::ClientContext* context) {
    std::lock_guard<std::mutex> lock(mutex_);
    open_.erase(context);
  }
  void CancelAll() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
    for (grpc::ClientContext* context : open_) context->TryCancel();
  }
  bool stopped() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stopped_;
  }

 private:
  std::mutex mutex_;
  bool stopped_ = false;
  std::set<grpc::ClientContext*> open_;
};

// A context registered in `contexts` for its lifetime.
class TrackedContext {
 public:
  TrackedContext(Contexts& contexts, const std::string& client_id) : contexts_(contexts) {
    context.AddMetadata("attngrad-client-id", client_id);
    added_ = contexts_.Add(&context);
  }
  ~TrackedContext() { contexts_.Remove(&context); }
  bool usable() const { return added_; }
  grpc::ClientContext context;

 private:
  Contexts& contexts_;
  bool added_ = false;
};

class HostileClientsTest : public ServerTest {
 protected:
  void Customize(ServerOptions& options) override {
    options.stream_idle_timeout_seconds = 5;
    options.max_message_bytes = kMaxMessageBytes;
    // Eight RETURN answers (~100 MB each for this layer), half of it per client (the default).
    options.max_inflight_bytes = 8 * ReturnAnswerBytes();
    options.max_inflight_share_per_client = 0.5;
  }

  static std::int64_t ReturnAnswerBytes() {
    return static_cast<std::int64_t>(PackedWeightLayout(LayerConfig::Gemma3_4B()).total_elements *
                                     sizeof(float)) +
           (1 << 20);
  }

  // Starts `body` on its own thread, repeated until the attack stops.
  void Attack(std::function<void()> body) {
    attackers_.emplace_back([this, body = std::move(body)] {
      while (!contexts_.stopped()) body();
    });
  }

  void StopAttacks() {
    contexts_.CancelAll();
    for (std::thread& attacker : attackers_) attacker.join();
    attackers_.clear();
    for (int fd : raw_connections_) close(fd);
    raw_connections_.clear();
  }

  void TearDown() override {
    StopAttacks();
    ServerTest::TearDown();
  }

  void StartBadInputs();
  void StartGarbage();
  void StartHugeMessages();
  void StartIdleStreams();
  void StartHog();
  void OpenIdleConnections();

  Contexts contexts_;
  std::vector<std::thread> attackers_;
  std::vector<int> raw_connections_;
  std::atomic<int> evictions_{0};
  std::atomic<int> hog_refusals_{0};
};

void HostileClientsTest::StartBadInputs() {
  auto stub = NewStub();
  Attack([this, stub = std::shared_ptr<v1::AttentionGradient::Stub>(std::move(stub))] {
    TrackedContext tracked(contexts_, "vandal");
    if (!tracked.usable()) return;
    auto stream = stub->Backward(&tracked.context);
    const Batch batch = MakeBatch(config(), 1, 4, 77);
    v1::BackwardRequest wrong_shape = MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_ACCUMULATE);
    wrong_shape.mutable_hidden_states()->set_shape(2, 17);
    v1::BackwardRequest not_finite = MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_ACCUMULATE);
    std::string& raw = *not_finite.mutable_grad_output()->mutable_raw_data();
    const float nan = std::nanf("");
    std::memcpy(raw.data() + 8, &nan, sizeof nan);
    v1::BackwardRequest unknown_layer =
        MakeRequest(config(), batch, 3, v1::GRADIENT_MODE_ACCUMULATE);
    unknown_layer.set_layer(99);
    for (const v1::BackwardRequest* request : {&wrong_shape, &not_finite, &unknown_layer}) {
      if (!stream->Write(*request)) break;
    }
    stream->WritesDone();
    v1::BackwardResponse response;
    while (stream->Read(&response)) {
    }
    stream->Finish();
  });
}

void HostileClientsTest::StartGarbage() {
  auto generic = std::make_shared<grpc::GenericStub>(channel());
  Attack([generic] {
    const std::string garbage("\x0a\x64\x01", 3);
    for (const char* method : {"GetModelInfo", "ZeroGradients", "RegisterRegion",
                               "UnregisterRegion", "FetchGradients", "Backward", "LoadWeights"}) {
      RawUnaryCall(*generic, absl::StrCat("/attngrad.v1.AttentionGradient/", method), garbage);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  });
}

void HostileClientsTest::StartHugeMessages() {
  auto stub = std::shared_ptr<v1::AttentionGradient::Stub>(NewStub());
  auto huge = std::make_shared<v1::BackwardRequest>();
  huge->mutable_hidden_states()->mutable_raw_data()->assign(kMaxMessageBytes + 1024, 'x');
  Attack([this, stub, huge] {
    TrackedContext tracked(contexts_, "giant");
    if (!tracked.usable()) return;
    auto stream = stub->Backward(&tracked.context);
    stream->Write(*huge);
    stream->WritesDone();
    v1::BackwardResponse response;
    while (stream->Read(&response)) {
    }
    stream->Finish();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  });
}

void HostileClientsTest::StartIdleStreams() {
  for (int id = 0; id < kIdleClientIds; ++id) {
    auto stub = std::shared_ptr<v1::AttentionGradient::Stub>(NewStub());
    for (int i = 0; i < kIdleStreamsPerId; ++i) {
      Attack([this, stub, id] {
        TrackedContext tracked(contexts_, absl::StrCat("idler-", id));
        if (!tracked.usable()) return;
        auto stream = stub->Backward(&tracked.context);
        v1::BackwardResponse response;
        while (stream->Read(&response)) {
        }
        const grpc::Status status = stream->Finish();
        if (status.error_code() == grpc::StatusCode::UNAVAILABLE) ++evictions_;
        // Refused (all slots taken): try again a moment later.
        if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      });
    }
  }
}

void HostileClientsTest::StartHog() {
  auto stub = std::shared_ptr<v1::AttentionGradient::Stub>(NewStub());
  // Sums in its window, so that its fetches hold memory.
  {
    grpc::ClientContext context;
    context.AddMetadata("attngrad-client-id", "hog");
    auto stream = stub->Backward(&context);
    stream->Write(
        MakeRequest(config(), MakeBatch(config(), 1, 4, 5), 1, v1::GRADIENT_MODE_ACCUMULATE));
    stream->WritesDone();
    v1::BackwardResponse response;
    while (stream->Read(&response)) {
    }
    ASSERT_TRUE(stream->Finish().ok());
  }
  for (int s = 0; s < 2; ++s) {  // RETURN answers never read, until the attack stops
    Attack([this, stub] {
      TrackedContext tracked(contexts_, "hog");
      if (!tracked.usable()) return;
      auto stream = stub->Backward(&tracked.context);
      for (std::uint64_t id = 1; id <= 4; ++id) {
        if (!stream->Write(MakeRequest(config(), MakeBatch(config(), 1, 4, id), id,
                                       v1::GRADIENT_MODE_RETURN))) {
          break;
        }
      }
      v1::BackwardResponse response;
      while (!contexts_.stopped()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      while (stream->Read(&response)) {
      }
      stream->Finish();
    });
  }
  for (int f = 0; f < 4; ++f) {  // fetches read no further than their first chunk
    Attack([this, stub] {
      TrackedContext tracked(contexts_, "hog");
      if (!tracked.usable()) return;
      auto reader = stub->FetchGradients(&tracked.context, v1::FetchGradientsRequest());
      v1::GradientChunk chunk;
      if (reader->Read(&chunk)) {
        while (!contexts_.stopped()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      while (reader->Read(&chunk)) {
      }
      if (reader->Finish().error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++hog_refusals_;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
  }
}

void HostileClientsTest::OpenIdleConnections() {
  const std::string preface = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") +
                              std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9);
  for (int i = 0; i < kIdleConnections; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<std::uint16_t>(server().port()));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    raw_connections_.push_back(fd);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    ASSERT_EQ(send(fd, preface.data(), preface.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(preface.size()));
  }
}

// The honest trainer's sums over one round: the six weight gradients of its batches, added.
LayerTensors SumOf(const std::vector<Gradients>& gradients) {
  LayerTensors sum = gradients.front().weights;
  for (std::size_t i = 1; i < gradients.size(); ++i) {
    for (Weight weight : kAllWeights) {
      for (std::size_t j = 0; j < sum[weight].size(); ++j) {
        sum[weight][j] += gradients[i].weights[weight][j];
      }
    }
  }
  return sum;
}

TEST_F(HostileClientsTest, AnHonestTrainerIsServedExactlyAndPromptlyUnderAttack) {
  OpenIdleConnections();
  StartHog();
  StartIdleStreams();
  StartBadInputs();
  StartGarbage();
  StartHugeMessages();
  // The attack is in place: the hog holds memory, the idle streams fill the server.
  const MemoryBudget& memory = server().inflight_memory();
  for (int i = 0; i < 600 && memory.in_use("hog") == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_GT(memory.in_use("hog"), 0);

  auto stub = NewStub();
  Clock::duration longest{};
  std::vector<std::vector<Batch>> rounds;
  std::vector<Fetched> fetched;
  std::uint64_t batch_id = 1000;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<Batch> batches;
    std::vector<v1::BackwardRequest> requests;
    for (int i = 0; i < kBatchesPerRound; ++i) {
      batches.push_back(MakeBatch(config(), 1, 4, ++batch_id));
      requests.push_back(
          MakeRequest(config(), batches.back(), batch_id, v1::GRADIENT_MODE_ACCUMULATE));
    }
    auto start = Clock::now();
    grpc::ClientContext context;
    context.AddMetadata("attngrad-client-id", "honest");
    auto stream = stub->Backward(&context);
    for (const v1::BackwardRequest& request : requests) ASSERT_TRUE(stream->Write(request));
    stream->WritesDone();
    v1::BackwardResponse response;
    int answered = 0;
    while (stream->Read(&response)) {
      EXPECT_FALSE(response.has_error()) << "round " << round << ": " << response.error().message();
      EXPECT_FALSE(response.duplicate());
      ++answered;
    }
    const grpc::Status status = stream->Finish();
    ASSERT_TRUE(status.ok()) << "round " << round << ": " << status.error_message();
    EXPECT_EQ(answered, kBatchesPerRound);
    longest = std::max(longest, Clock::now() - start);

    start = Clock::now();
    v1::FetchGradientsRequest fetch;
    fetch.set_zero_after_fetch(true);
    fetched.push_back(Fetch(*stub, fetch, "honest"));
    ASSERT_TRUE(fetched.back().status.ok()) << fetched.back().status.error_message();
    longest = std::max(longest, Clock::now() - start);
    rounds.push_back(std::move(batches));
  }
  const int evictions = evictions_.load();
  StopAttacks();
  std::printf(
      "hostile clients: the honest trainer's longest call took %.2f s (bound %lld s); "
      "%d idle streams were closed to make room; the hog's fetches were refused %d "
      "times\n",
      std::chrono::duration<double>(longest).count(), static_cast<long long>(kStallBound.count()),
      evictions, hog_refusals_.load());
  EXPECT_LE(longest, kStallBound);
  EXPECT_GT(evictions, 0) << "the idle streams never filled the server";

  // Exact sums: every round's window holds exactly its batches.
  for (int round = 0; round < kRounds; ++round) {
    EXPECT_EQ(fetched[round].state.batches(), kBatchesPerRound) << "round " << round;
    std::vector<Gradients> references;
    for (const Batch& batch : rounds[round]) references.push_back(Reference(weights(), batch));
    EXPECT_TRUE(Close(fetched[round].gradients, SumOf(references), 1e-4,
                      absl::StrCat("round ", round, "'s sums")));
  }
  // The server still serves.
  grpc::ClientContext context;
  v1::GetModelInfoResponse info;
  EXPECT_TRUE(stub->GetModelInfo(&context, {}, &info).ok());
}

}  // namespace
}  // namespace attngrad::server::testing
