#include "ceiling_client.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "attngrad/v1/attngrad.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/time.h"

namespace attngrad::wire_ceiling {
namespace {

// The value at percentile p (0..100) of `values`, nearest rank (as attngrad-cli bench).
double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t index =
      std::min(values.size() - 1, static_cast<size_t>(p / 100.0 * (values.size() - 1) + 0.5));
  return values[index];
}

// What one stream counted over its timed batches.
struct StreamTotals {
  std::vector<double> latencies;  // seconds
  int64_t batches = 0;
  int64_t request_bytes = 0;
  int64_t response_bytes = 0;
  absl::Time last_answer = absl::InfinitePast();
  int64_t errors = 0;
  std::string first_error;
};

// The submission window of one stream, independent of its transport: which batch to write next,
// when, and what its answers add up to. The transport (Stream<Codec>) calls the On* methods from
// its reactions; the run calls Begin / StopSubmitting / WaitIdle / Close.
class StreamBase {
 public:
  virtual ~StreamBase() = default;

  // Lets the stream submit `budget` more batches (-1: until StopSubmitting) with at most `window`
  // in flight; their answers count in totals() when `timed`.
  void Begin(int64_t budget, int window, bool timed) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      budget_ = budget;
      window_ = window;
      timed_ = timed;
    }
    TrySubmit();
  }
  void StopSubmitting() {
    std::lock_guard<std::mutex> lock(mutex_);
    budget_ = 0;
  }
  // Until nothing is in flight and nothing more may be submitted, or the stream broke; false when
  // it broke.
  bool WaitIdle() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock,
                  [&] { return broken_ || (outstanding_ == 0 && !writing_ && budget_ == 0); });
    return !broken_;
  }
  // Half-closes the stream and waits for the server's status.
  absl::Status Close() {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      closing_ = true;
      budget_ = 0;
      // A broken stream may still have a write outstanding; WritesDone must not overlap it.
      changed_.wait(lock, [&] { return !writing_; });
    }
    HalfClose();
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return done_; });
    return status_;
  }
  StreamTotals TakeTotals() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(totals_);
  }

 protected:
  explicit StreamBase(uint64_t first_batch_id) : next_batch_id_(first_batch_id) {}

  // The transport: prepares the request of batch `batch_id` and returns its serialized size;
  // then writes it (StartWrite).
  virtual int64_t PrepareWrite(uint64_t batch_id) = 0;
  virtual void StartPreparedWrite() = 0;
  // StartWritesDone and the release of the hold taken before StartCall.
  virtual void HalfClose() = 0;

  void TrySubmit() {
    uint64_t batch_id = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (writing_ || broken_ || closing_ || budget_ == 0 || outstanding_ >= window_) return;
      writing_ = true;
      if (budget_ > 0) --budget_;
      ++outstanding_;
      batch_id = next_batch_id_++;
    }
    // Only this call writes until OnWritten: the request may be prepared outside the lock, and
    // its answer cannot arrive before it is in in_flight_.
    const int64_t bytes = PrepareWrite(batch_id);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_flight_.push_back(InFlight{batch_id, absl::Now(), bytes});
    }
    StartPreparedWrite();
  }

  void OnWritten(bool ok) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      writing_ = false;
      if (!ok) BreakLocked("a write failed (the stream is closed)");
      changed_.notify_all();
    }
    TrySubmit();
  }

  // An answer to `batch_id` of `bytes`; `error` is non-empty when it carries one.
  void OnAnswer(uint64_t batch_id, int64_t bytes, const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const absl::Time now = absl::Now();
      if (in_flight_.empty() || in_flight_.front().batch_id != batch_id) {
        BreakLocked(
            absl::StrCat("an answer for batch ", batch_id, " that is not the oldest in flight"));
        return;
      }
      const InFlight batch = in_flight_.front();
      in_flight_.pop_front();
      --outstanding_;
      if (timed_) {
        if (!error.empty()) {
          RecordErrorLocked(error);
        } else {
          totals_.latencies.push_back(absl::ToDoubleSeconds(now - batch.start));
          ++totals_.batches;
          totals_.request_bytes += batch.request_bytes;
          totals_.response_bytes += bytes;
          totals_.last_answer = now;
        }
      } else if (!error.empty()) {
        BreakLocked(error);
      }
      changed_.notify_all();
    }
    TrySubmit();
  }

  void OnReadsClosed() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!closing_) BreakLocked("the server ended the stream");
    changed_.notify_all();
  }

  void OnFinished(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    if (!status.ok()) {
      status_ =
          absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
      RecordErrorLocked(status_.ToString());
    }
    broken_ = broken_ || !status.ok();
    changed_.notify_all();
  }

 private:
  struct InFlight {
    uint64_t batch_id;
    absl::Time start;
    int64_t request_bytes;
  };

  void BreakLocked(const std::string& why) {
    broken_ = true;
    RecordErrorLocked(why);
  }
  void RecordErrorLocked(const std::string& error) {
    ++totals_.errors;
    if (totals_.first_error.empty()) totals_.first_error = error;
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t next_batch_id_;
  int64_t budget_ = 0;
  int window_ = 1;
  bool timed_ = false;
  bool writing_ = false;
  int outstanding_ = 0;
  bool broken_ = false;
  bool closing_ = false;
  bool done_ = false;
  absl::Status status_;
  std::deque<InFlight> in_flight_;
  StreamTotals totals_;
};

// The protobuf transport: the stream's own BackwardRequest (the shape's, built once) with the
// batch id set, serialized by gRPC at each write; answers parsed into a BackwardResponse.
class ProtobufCodec {
 public:
  using Request = v1::BackwardRequest;
  using Response = v1::BackwardResponse;

  explicit ProtobufCodec(const WireShape& shape) : request_(MakeRequest(shape)) {}

  Request* Prepare(uint64_t batch_id, int64_t* bytes) {
    request_.set_batch_id(batch_id);
    *bytes = static_cast<int64_t>(request_.ByteSizeLong());
    return &request_;
  }
  // The answer's batch id, size and error ("" for none).
  void Take(Response* response, uint64_t* batch_id, int64_t* bytes, std::string* error) {
    *batch_id = response->batch_id();
    *bytes = static_cast<int64_t>(response->ByteSizeLong());
    if (response->has_error()) *error = response->error().message();
    response->Clear();
  }
  void StartCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                 grpc::ClientBidiReactor<Request, Response>* reactor) {
    stub_ = v1::AttentionGradient::NewStub(channel);
    stub_->async()->Backward(context, reactor);
  }

 private:
  Request request_;
  std::unique_ptr<v1::AttentionGradient::Stub> stub_;
};

// The grpc::ByteBuffer transport: every write is a slice with the batch id field followed by one
// slice of the serialized rest of the request, shared by every stream (reference-counted, never
// copied); answers are only measured and their leading batch id read.
class ByteBufferCodec {
 public:
  using Request = grpc::ByteBuffer;
  using Response = grpc::ByteBuffer;

  explicit ByteBufferCodec(grpc::Slice body) : body_(std::move(body)) {}

  Request* Prepare(uint64_t batch_id, int64_t* bytes) {
    const std::string header = EncodeBatchIdField(batch_id);
    grpc::Slice slices[2] = {grpc::Slice(header.data(), header.size()), body_};
    request_ = grpc::ByteBuffer(slices, 2);
    *bytes = static_cast<int64_t>(request_.Length());
    return &request_;
  }
  void Take(Response* response, uint64_t* batch_id, int64_t* bytes, std::string* error) {
    *bytes = static_cast<int64_t>(response->Length());
    if (!ReadBatchIdField(response, batch_id)) *error = "an answer without a batch_id";
    response->Clear();
  }
  void StartCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                 grpc::ClientBidiReactor<Request, Response>* reactor) {
    stub_ = std::make_unique<grpc::GenericStub>(channel);
    stub_->PrepareBidiStreamingCall(context, kByteBufferBackwardMethod, grpc::StubOptions(),
                                    reactor);
  }

 private:
  grpc::Slice body_;
  Request request_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

template <typename Codec>
class Stream final
    : public StreamBase,
      public grpc::ClientBidiReactor<typename Codec::Request, typename Codec::Response> {
 public:
  Stream(const std::shared_ptr<grpc::Channel>& channel, const WireShape& shape,
         uint64_t first_batch_id, Codec codec)
      : StreamBase(first_batch_id), codec_(std::move(codec)) {
    context_.AddMetadata(kShapeMetadataKey, shape.ToMetadata());
    codec_.StartCall(channel, &context_, this);
    this->AddHold();  // released by HalfClose: writes may start until then
    this->StartRead(&response_);
    this->StartCall();
  }

  void OnWriteDone(bool ok) override { OnWritten(ok); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      OnReadsClosed();
      return;
    }
    uint64_t batch_id = 0;
    int64_t bytes = 0;
    std::string error;
    codec_.Take(&response_, &batch_id, &bytes, &error);
    OnAnswer(batch_id, bytes, error);
    this->StartRead(&response_);
  }
  void OnDone(const grpc::Status& status) override { OnFinished(status); }

 private:
  int64_t PrepareWrite(uint64_t batch_id) override {
    int64_t bytes = 0;
    prepared_ = codec_.Prepare(batch_id, &bytes);
    return bytes;
  }
  void StartPreparedWrite() override { this->StartWrite(prepared_); }
  void HalfClose() override {
    this->StartWritesDone();
    this->RemoveHold();
  }

  grpc::ClientContext context_;
  Codec codec_;
  typename Codec::Request* prepared_ = nullptr;
  typename Codec::Response response_;
};

absl::StatusOr<ServerStats> FetchServerStats(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  const std::string text = "stats";
  grpc::Slice slice(text.data(), text.size());
  grpc::ByteBuffer request(&slice, 1), response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, kStatsMethod, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("ServerStats: ", status.error_message()));
  }
  grpc::Slice answer;
  if (!response.DumpToSingleSlice(&answer).ok()) {
    return absl::InternalError("ServerStats: unreadable answer");
  }
  return ServerStats::FromText(
      absl::string_view(reinterpret_cast<const char*>(answer.begin()), answer.size()));
}

// Closes every stream (a failed one has its error counted already) and adds up what they counted.
void CloseAndCollect(const std::vector<std::unique_ptr<StreamBase>>& streams, RunResult* result,
                     std::vector<double>* latencies = nullptr, absl::Time* last_answer = nullptr) {
  for (const auto& stream : streams) {
    stream->Close().IgnoreError();  // its error is in its totals
    StreamTotals totals = stream->TakeTotals();
    result->errors += totals.errors;
    if (result->first_error.empty()) result->first_error = totals.first_error;
    result->batches += totals.batches;
    result->request_bytes += totals.request_bytes;
    result->response_bytes += totals.response_bytes;
    if (last_answer != nullptr) *last_answer = std::max(*last_answer, totals.last_answer);
    if (latencies != nullptr) {
      latencies->insert(latencies->end(), totals.latencies.begin(), totals.latencies.end());
    }
  }
}

}  // namespace

absl::StatusOr<RunResult> RunClient(const RunOptions& options) {
  const WireShape& shape = options.shape;
  if (absl::Status valid = shape.Validate(); !valid.ok()) return valid;
  if (options.channels < 1 || options.streams < 1 || options.in_flight < 1 || options.warmup < 0 ||
      options.count < 0) {
    return absl::InvalidArgumentError(
        "--channels, --streams and --in_flight must be >= 1, --warmup and --count >= 0");
  }
  const v1::BackwardRequest request = MakeRequest(shape);
  RunResult result;
  result.request_bytes_per_batch = SizeWithBatchId(request);
  result.response_bytes_per_batch = SizeWithBatchId(MakeResponse(shape));
  if (std::max(result.request_bytes_per_batch, result.response_bytes_per_batch) >
      options.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a batch of ", shape.Describe(), " is ", result.request_bytes_per_batch,
        " bytes, answered with ", result.response_bytes_per_batch, ": over --max_message_bytes ",
        options.max_message_bytes, " (attngrad's client would split it along B)"));
  }

  // --channels separate TCP connections: a local subchannel pool per channel keeps gRPC from
  // sharing one connection between channels to the same target.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < options.channels; ++i) {
    grpc::ChannelArguments arguments;
    const int limit = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
    arguments.SetMaxReceiveMessageSize(limit);
    arguments.SetMaxSendMessageSize(limit);
    arguments.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);  // as attngrad's client (client/src/client.cc)
    arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    channels.push_back(
        grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(), arguments));
    if (!channels.back()->WaitForConnected(
            absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
      return absl::UnavailableError(absl::StrCat("cannot connect to ", options.target, " within ",
                                                 absl::FormatDuration(options.connect_timeout)));
    }
  }

  std::vector<std::unique_ptr<StreamBase>> streams;
  grpc::Slice request_body;
  if (options.transport == Transport::kByteBuffer) request_body = SerializedSlice(request);
  for (int s = 0; s < options.streams; ++s) {
    const auto& channel = channels[s % options.channels];
    const uint64_t first_batch_id = kFirstBatchId + (static_cast<uint64_t>(s) << 40);
    if (options.transport == Transport::kProtobuf) {
      streams.push_back(std::make_unique<Stream<ProtobufCodec>>(channel, shape, first_batch_id,
                                                                ProtobufCodec(shape)));
    } else {
      streams.push_back(std::make_unique<Stream<ByteBufferCodec>>(channel, shape, first_batch_id,
                                                                  ByteBufferCodec(request_body)));
    }
  }

  // Warm-up: `warmup` batches per stream, one at a time, before the clock starts.
  for (auto& stream : streams) stream->Begin(options.warmup, 1, /*timed=*/false);
  for (auto& stream : streams) {
    if (!stream->WaitIdle()) {
      RunResult failed;
      CloseAndCollect(streams, &failed);
      return absl::UnavailableError(absl::StrCat("warm-up failed: ", failed.first_error));
    }
  }

  absl::StatusOr<ServerStats> server_before = FetchServerStats(channels[0]);
  if (!server_before.ok()) return server_before.status();
  const double cpu_before = ProcessCpuSeconds();
  const absl::Time start = absl::Now();
  for (auto& stream : streams) {
    stream->Begin(options.count > 0 ? options.count : -1, options.in_flight, /*timed=*/true);
  }
  if (options.count == 0) {
    absl::SleepFor(options.duration);
    for (auto& stream : streams) stream->StopSubmitting();
  }
  for (auto& stream : streams) stream->WaitIdle();
  const absl::Time stopped = absl::Now();
  const double cpu_after = ProcessCpuSeconds();
  absl::StatusOr<ServerStats> server_after = FetchServerStats(channels[0]);
  if (!server_after.ok()) return server_after.status();

  absl::Time last_answer = absl::InfinitePast();
  std::vector<double> latencies;
  CloseAndCollect(streams, &result, &latencies, &last_answer);
  result.tokens = result.batches * shape.tokens();
  result.seconds =
      absl::ToDoubleSeconds((last_answer == absl::InfinitePast() ? stopped : last_answer) - start);
  result.p50_seconds = Percentile(latencies, 50);
  result.p90_seconds = Percentile(latencies, 90);
  result.p99_seconds = Percentile(latencies, 99);
  result.max_seconds = Percentile(latencies, 100);
  result.client_cpu_seconds = cpu_after - cpu_before;
  result.server.cpu_seconds = server_after->cpu_seconds - server_before->cpu_seconds;
  result.server.received_bytes = server_after->received_bytes - server_before->received_bytes;
  result.server.sent_bytes = server_after->sent_bytes - server_before->sent_bytes;
  result.server.batches = server_after->batches - server_before->batches;
  return result;
}

}  // namespace attngrad::wire_ceiling
