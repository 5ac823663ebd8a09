// attngrad-cli bench: --streams concurrent Backward streams, --in_flight batches each, for --count
// batches per stream or --duration_seconds. Reports throughput (tokens/s, GB/s on the wire),
// round-trip latency percentiles and the server's mean stage times, with a live progress line.
#include <algorithm>
#include <atomic>
#include <iostream>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "cli_common.h"

ABSL_FLAG(bool, answer_buffers, true,
          "bench: decode each answer's grad_hidden_states (and, RETURN, its weight gradients) into "
          "one of the stream's reused buffers (BackwardBatch::grad_hidden_states_out and "
          "weight_gradients_out, as a trainer decoding into its own tensors does); false: into "
          "fresh vectors per batch (BackwardResult::grad_hidden_states, weight_gradients)");

ABSL_FLAG(bool, borrow_inputs, true,
          "bench: send the float32 inputs from the bench's own memory, not copied "
          "(BackwardBatch::borrow_inputs; the inputs live for the whole run); false: one copy per "
          "request into the client's buffers");

ABSL_FLAG(bool, float32_api, false,
          "bench: hand the client float32 inputs and take float32 answers whatever --input_dtype "
          "and --response_dtype say (the client converts every batch on the host); false: a "
          "float16 / bfloat16 input is drawn once in that dtype and sent as it is "
          "(BackwardBatch::hidden_states_16bit, grad_output_16bit), a float16 / bfloat16 answer "
          "copied as it is into the reused buffers (grad_hidden_states_16bit_out)");

namespace attngrad::cli {
namespace {

// User + system CPU seconds of this process so far.
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

struct Totals {
  absl::Mutex mu;
  std::vector<double> latencies ABSL_GUARDED_BY(mu);  // seconds, timed batches only
  int64_t batches ABSL_GUARDED_BY(mu) = 0;
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;
  double bytes ABSL_GUARDED_BY(mu) = 0;      // timed batches
  double all_bytes ABSL_GUARDED_BY(mu) = 0;  // every answered batch, warm-up included
  int64_t errors ABSL_GUARDED_BY(mu) = 0;
  std::string first_error ABSL_GUARDED_BY(mu);
  v1::StageTimings stages ABSL_GUARDED_BY(mu);  // sums
  std::string device ABSL_GUARDED_BY(mu);
};

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t index =
      std::min(values.size() - 1, static_cast<size_t>(p / 100.0 * (values.size() - 1) + 0.5));
  return values[index];
}

// The flags of a bench run.
struct BenchOptions {
  v1::GradientMode mode = v1::GRADIENT_MODE_ACCUMULATE;
  v1::Precision precision = v1::PRECISION_AUTO;
  v1::DType response_dtype = v1::DTYPE_FLOAT32;
  v1::DType input_dtype = v1::DTYPE_FLOAT32;
  int64_t batch = 0, seq_len = 0;
  int64_t count = 0;  // batches per stream; <= 0: for `duration`
  int streams = 1, in_flight = 1, warmup = 0;
  absl::Duration duration;
  bool answer_buffers = true;
  // 16-bit wire dtypes from and into 16-bit memory, as a bf16 trainer has it (not --float32_api).
  bool inputs_16bit = false, answers_16bit = false;
};

absl::StatusOr<BenchOptions> ParseBenchFlags() {
  BenchOptions options;
  ATTNGRAD_ASSIGN_OR_RETURN(
      options.mode,
      ParseMode(absl::GetFlag(FLAGS_mode).empty() ? "accumulate" : absl::GetFlag(FLAGS_mode)));
  ATTNGRAD_ASSIGN_OR_RETURN(options.precision, ParsePrecision(absl::GetFlag(FLAGS_precision)));
  ATTNGRAD_ASSIGN_OR_RETURN(options.response_dtype,
                            ParseDType(absl::GetFlag(FLAGS_response_dtype)));
  ATTNGRAD_ASSIGN_OR_RETURN(options.input_dtype, ParseDType(absl::GetFlag(FLAGS_input_dtype)));
  options.batch = absl::GetFlag(FLAGS_batch);
  options.seq_len = absl::GetFlag(FLAGS_seq_len);
  options.count = absl::GetFlag(FLAGS_count);
  options.streams = std::max(1, absl::GetFlag(FLAGS_streams));
  options.in_flight = std::max(1, absl::GetFlag(FLAGS_in_flight));
  options.warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  options.duration = absl::Seconds(absl::GetFlag(FLAGS_duration_seconds));
  options.answer_buffers = absl::GetFlag(FLAGS_answer_buffers);
  const bool float32_api = absl::GetFlag(FLAGS_float32_api);
  options.inputs_16bit = !float32_api && wire::DTypeSize(options.input_dtype) == 2;
  options.answers_16bit = !float32_api && wire::DTypeSize(options.response_dtype) == 2;
  return options;
}

// One batch of inputs, drawn once and shared by every stream and submission (each submission
// gets a fresh batch id), so the bench measures the service and not the random generator. The
// batch's spans point into this object.
class SharedBatch {
 public:
  SharedBatch(const BenchOptions& options, const LayerConfig& config)
      : inputs_(
            RandomBatchInputs(config, options.batch, options.seq_len, absl::GetFlag(FLAGS_seed))) {
    batch_ = inputs_.View();
    if (absl::GetFlag(FLAGS_rotary) == "positions") batch_.cos = batch_.sin = {};
    batch_.mode = options.mode;
    batch_.precision = options.precision;
    batch_.response_dtype = options.response_dtype;
    batch_.input_dtype = options.input_dtype;
    if (absl::GetFlag(FLAGS_layer) >= 0) batch_.layer = absl::GetFlag(FLAGS_layer);
    batch_.expected_weights_version = absl::GetFlag(FLAGS_expected_weights_version);
    batch_.borrow_inputs = absl::GetFlag(FLAGS_borrow_inputs);
    // 16-bit inputs converted here once (the wire library's conversion, which the client would
    // otherwise run per batch).
    if (options.inputs_16bit) {
      for (auto [from, to] : {std::pair(&inputs_.hidden_states, &hidden_16bit_),
                              std::pair(&inputs_.grad_output, &grad_16bit_)}) {
        to->resize(from->size());
        wire::EncodeFromFloat(*from, options.input_dtype, reinterpret_cast<char*>(to->data()));
      }
      batch_.hidden_states = batch_.grad_output = {};
      batch_.hidden_states_16bit = hidden_16bit_;
      batch_.grad_output_16bit = grad_16bit_;
    }
  }
  SharedBatch(const SharedBatch&) = delete;
  SharedBatch& operator=(const SharedBatch&) = delete;

  const BackwardBatch& batch() const { return batch_; }

 private:
  const BatchInputs inputs_;
  std::vector<uint16_t> hidden_16bit_, grad_16bit_;
  BackwardBatch batch_;
};

// What the streams share: the totals, and the start of the timed part, which the last stream to
// end its warm-up sets.
struct BenchState {
  explicit BenchState(int streams) : streams(streams) {}

  void RecordError(const absl::Status& status) {
    absl::MutexLock lock(&totals.mu);
    ++totals.errors;
    if (totals.first_error.empty()) totals.first_error = status.ToString();
  }

  // A stream ended its warm-up (or could not start): the last of them starts the clock.
  void Warmed() {
    if (warmed.fetch_add(1) + 1 == streams) {
      timing_start = absl::Now();
      timing_start_cpu = ProcessCpuSeconds();
      timing_started.Notify();
    }
  }

  // The answer of a timed batch of `tokens` tokens.
  void Record(const BackwardResult& result, int64_t tokens) {
    absl::MutexLock lock(&totals.mu);
    if (!result.status.ok()) {
      ++totals.errors;
      if (totals.first_error.empty()) totals.first_error = result.status.ToString();
      return;
    }
    totals.latencies.push_back(absl::ToDoubleSeconds(result.latency));
    ++totals.batches;
    totals.tokens += tokens;
    totals.bytes += static_cast<double>(result.request_bytes + result.response_bytes);
    totals.all_bytes += static_cast<double>(result.request_bytes + result.response_bytes);
    const v1::StageTimings& t = result.timings;
    totals.stages.set_queue_seconds(totals.stages.queue_seconds() + t.queue_seconds());
    totals.stages.set_copy_in_seconds(totals.stages.copy_in_seconds() + t.copy_in_seconds());
    totals.stages.set_compute_seconds(totals.stages.compute_seconds() + t.compute_seconds());
    totals.stages.set_copy_out_seconds(totals.stages.copy_out_seconds() + t.copy_out_seconds());
    totals.stages.set_total_seconds(totals.stages.total_seconds() + t.total_seconds());
    totals.device = result.device;
  }

  const int streams;
  Totals totals;
  std::atomic<int> warmed{0};
  absl::Notification timing_started;
  absl::Time timing_start;
  double timing_start_cpu = 0;
  std::atomic<int> finished_streams{0};
};

// One of the bench's streams, run on a thread of its own: --warmup rounds, then batches until
// --count or --duration_seconds, --in_flight at a time.
class BenchStream {
 public:
  BenchStream(const BenchOptions& options, const LayerConfig& config, const BackwardBatch& batch,
              BenchState& state)
      : options_(options), config_(config), batch_(batch), state_(state) {}

  void Run(ShardedClient& client) {
    auto stream = client.StartStream();
    if (!stream.ok()) {
      state_.RecordError(stream.status());
      state_.Warmed();
      state_.finished_streams.fetch_add(1);
      return;
    }
    stream_ = *std::move(stream);
    if (options_.answer_buffers) AllocateAnswerBuffers();
    WarmUp();
    state_.Warmed();
    state_.timing_started.WaitForNotification();
    RunTimed();
    state_.finished_streams.fetch_add(1);
  }

 private:
  // --answer_buffers: one buffer per batch in flight (and one for the warm-up), each lent to a
  // batch from its Submit until its result is taken.
  void AllocateAnswerBuffers() {
    const size_t answer_floats =
        static_cast<size_t>(options_.batch * options_.seq_len * config_.hidden_size);
    const size_t count = static_cast<size_t>(options_.in_flight) + 1;
    for (size_t b = 0; b < count; ++b) {
      if (options_.answers_16bit) {
        buffers_16bit_.emplace_back(answer_floats);
      } else {
        buffers_.emplace_back(answer_floats);
      }
      free_buffers_.push_back(b);
    }
    if (options_.mode == v1::GRADIENT_MODE_RETURN) {
      weight_buffers_.resize(count);
      for (PerWeight<std::vector<float>>& set : weight_buffers_) {
        for (Weight weight : kAllWeights) set[weight].resize(WeightElements(config_, weight));
      }
    }
  }

  absl::StatusOr<uint64_t> Submit() {
    BackwardBatch own = batch_;
    if (options_.answer_buffers) {
      if (options_.answers_16bit) {
        own.grad_hidden_states_16bit_out = absl::MakeSpan(buffers_16bit_[free_buffers_.back()]);
      } else {
        own.grad_hidden_states_out = absl::MakeSpan(buffers_[free_buffers_.back()]);
      }
      if (!weight_buffers_.empty()) {
        for (Weight weight : kAllWeights) {
          own.weight_gradients_out[weight] =
              absl::MakeSpan(weight_buffers_[free_buffers_.back()][weight]);
        }
      }
    }
    absl::StatusOr<uint64_t> id = stream_->Submit(own);
    if (id.ok() && options_.answer_buffers) {
      lent_[*id] = free_buffers_.back();
      free_buffers_.pop_back();
    }
    return id;
  }

  void GiveBack(uint64_t id) {
    auto it = lent_.find(id);
    if (it == lent_.end()) return;
    free_buffers_.push_back(it->second);
    lent_.erase(it);
  }

  // --warmup rounds of --in_flight batches at once, answered before the clock starts
  // (connections, and the buffers of the server's and the client's pools as many as the timed
  // part keeps in flight: page-locking a fresh 100 MB buffer costs the server tens of ms).
  void WarmUp() {
    for (int w = 0; w < options_.warmup; ++w) {
      std::vector<uint64_t> ids;
      for (int i = 0; i < options_.in_flight; ++i) {
        auto id = Submit();
        if (!id.ok()) break;
        ids.push_back(*id);
      }
      bool failed = ids.size() < static_cast<size_t>(options_.in_flight);
      for (uint64_t id : ids) {
        auto result = stream_->Await(id);
        GiveBack(id);
        if (!result.ok()) {
          failed = true;
          continue;
        }
        absl::MutexLock lock(&state_.totals.mu);
        state_.totals.all_bytes +=
            static_cast<double>(result->request_bytes + result->response_bytes);
      }
      if (failed) break;
    }
  }

  // Takes the next answer; false when there is none (the stream ended).
  bool Take() {
    auto result = stream_->Next();
    if (!result.ok()) return false;
    GiveBack(result->batch_id);
    state_.Record(*result, options_.batch * options_.seq_len);
    return true;
  }

  void RunTimed() {
    const int64_t count = options_.count;
    int64_t submitted = 0;
    while ((count <= 0 || submitted < count) &&
           (count > 0 || absl::Now() - state_.timing_start < options_.duration)) {
      auto id = Submit();
      if (!id.ok()) {
        state_.RecordError(id.status());
        break;
      }
      ++submitted;
      while (stream_->outstanding() >= options_.in_flight && Take()) {
      }
    }
    absl::Status finished = stream_->Finish();
    while (Take()) {
    }
    if (!finished.ok()) state_.RecordError(finished);
  }

  const BenchOptions& options_;
  const LayerConfig& config_;
  const BackwardBatch& batch_;
  BenchState& state_;
  std::unique_ptr<ShardedStream> stream_;  // outlives the buffers it answers into
  std::vector<std::vector<float>> buffers_;
  std::vector<std::vector<uint16_t>> buffers_16bit_;           // instead, for a 16-bit answer
  std::vector<PerWeight<std::vector<float>>> weight_buffers_;  // RETURN: one set per buffer
  std::vector<size_t> free_buffers_;
  std::unordered_map<uint64_t, size_t> lent_;  // batch id -> buffer
};

// Until every stream is done: with --progress, a line every 0.5 s (rewritten in place on a tty).
void WatchProgress(BenchState& state, bool progress, bool tty) {
  state.timing_started.WaitForNotification();
  while (state.finished_streams.load() < state.streams) {
    absl::SleepFor(absl::Milliseconds(500));
    if (!progress) continue;
    absl::MutexLock lock(&state.totals.mu);
    const Totals& totals = state.totals;
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - state.timing_start);
    const std::string line =
        absl::StrFormat("[%6.1f s] %d batches, %.0f tokens/s, %.3f GB/s, p50 %.3f s, errors %d",
                        elapsed, totals.batches, totals.tokens / std::max(elapsed, 1e-9),
                        totals.bytes / 1e9 / std::max(elapsed, 1e-9),
                        Percentile(totals.latencies, 50), totals.errors);
    std::cerr << (tty ? "\r" : "") << line << (tty ? "" : "\n") << std::flush;
  }
}

// Prints the run's figures (`elapsed` and `timed_cpu` seconds of the timed part) and returns the
// exit status: 0 when batches were answered and none failed.
int PrintBenchReport(const BenchOptions& options, const BackwardBatch& batch, BenchState& state,
                     double elapsed, double timed_cpu) {
  const std::string inputs_described = absl::StrCat(
      batch.borrow_inputs && (options.inputs_16bit || options.input_dtype == v1::DTYPE_FLOAT32)
          ? "borrowed "
          : "copied ",
      options.inputs_16bit ? wire::DTypeName(options.input_dtype) : "float32");
  const std::string answers_described =
      !options.answer_buffers
          ? "fresh float32 vectors"
          : absl::StrCat(
                "reused ",
                options.answers_16bit ? wire::DTypeName(options.response_dtype) : "float32",
                " buffers");
  absl::MutexLock lock(&state.totals.mu);
  const Totals& totals = state.totals;
  const double n = std::max<double>(1, static_cast<double>(totals.batches));
  std::cout << absl::StrFormat(
      "bench: %d batches [%d,%d] (%d tokens) in %.2f s on %s, %d streams x %d in flight, %d "
      "channels, mode %s, input %s, response %s\n"
      "  throughput  %.1f tokens/s, %.2f batches/s, %.3f GB/s on the wire\n"
      "  latency     p50 %.4f s  p90 %.4f s  p99 %.4f s  max %.4f s (round trip per batch)\n"
      "  server      mean total %.6f s: queue %.6f, copy_in %.6f, compute %.6f, copy_out %.6f\n"
      "  moved       %.3f GB in all (requests + answers, warm-up included)\n"
      "  client CPU  %.3f s per GB moved while timed (%.2f CPU s, user + system; inputs %s, "
      "answers into %s)\n"
      "  errors      %d%s\n",
      totals.batches, options.batch, options.seq_len, totals.tokens, elapsed, totals.device,
      options.streams, options.in_flight, absl::GetFlag(FLAGS_channels), ModeName(options.mode),
      wire::DTypeName(options.input_dtype), wire::DTypeName(options.response_dtype),
      totals.tokens / elapsed, totals.batches / elapsed, totals.bytes / 1e9 / elapsed,
      Percentile(totals.latencies, 50), Percentile(totals.latencies, 90),
      Percentile(totals.latencies, 99), Percentile(totals.latencies, 100),
      totals.stages.total_seconds() / n, totals.stages.queue_seconds() / n,
      totals.stages.copy_in_seconds() / n, totals.stages.compute_seconds() / n,
      totals.stages.copy_out_seconds() / n, totals.all_bytes / 1e9,
      timed_cpu / std::max(totals.bytes / 1e9, 1e-12), timed_cpu, inputs_described,
      answers_described, totals.errors,
      totals.first_error.empty() ? "" : absl::StrCat(" (first: ", totals.first_error, ")"));
  return totals.errors == 0 && totals.batches > 0 ? 0 : 1;
}

}  // namespace

int RunBench() {
  const std::string command = "bench";
  absl::StatusOr<BenchOptions> parsed = ParseBenchFlags();
  if (!parsed.ok()) return Fail(command, parsed.status());
  const BenchOptions& options = *parsed;
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(command, client.status());
  const LayerConfig config = wire::LayerConfigFromWire((*client)->cached_info().config());
  const SharedBatch shared(options, config);
  const int64_t B = options.batch, S = options.seq_len;
  std::cerr << absl::StrFormat(
      "bench: %s, %d streams x %d in flight over %d channels, batches [%d,%d] (%d tokens), mode "
      "%s, input %s, response %s, %s\n",
      (*client)->target(), options.streams, options.in_flight, absl::GetFlag(FLAGS_channels), B, S,
      B * S, ModeName(options.mode), wire::DTypeName(options.input_dtype),
      wire::DTypeName(options.response_dtype),
      options.count > 0 ? absl::StrFormat("%d batches per stream", options.count)
                        : absl::StrFormat("%.0f s", absl::ToDoubleSeconds(options.duration)));

  BenchState state(options.streams);
  std::vector<std::thread> threads;
  for (int i = 0; i < options.streams; ++i) {
    threads.emplace_back(
        [&] { BenchStream(options, config, shared.batch(), state).Run(**client); });
  }
  const bool progress = absl::GetFlag(FLAGS_progress);
  const bool tty = isatty(STDERR_FILENO);
  WatchProgress(state, progress, tty);
  for (std::thread& t : threads) t.join();
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - state.timing_start);
  const double timed_cpu = ProcessCpuSeconds() - state.timing_start_cpu;
  if (progress && tty) std::cerr << "\n";
  return PrintBenchReport(options, shared.batch(), state, elapsed, timed_cpu);
}

}  // namespace attngrad::cli
