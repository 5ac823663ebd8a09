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

#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
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

}  // namespace

int RunBench() {
  const std::string command = "bench";
  auto mode =
      ParseMode(absl::GetFlag(FLAGS_mode).empty() ? "accumulate" : absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return Fail(command, mode.status());
  auto precision = ParsePrecision(absl::GetFlag(FLAGS_precision));
  if (!precision.ok()) return Fail(command, precision.status());
  auto response_dtype = ParseDType(absl::GetFlag(FLAGS_response_dtype));
  if (!response_dtype.ok()) return Fail(command, response_dtype.status());
  auto input_dtype = ParseDType(absl::GetFlag(FLAGS_input_dtype));
  if (!input_dtype.ok()) return Fail(command, input_dtype.status());
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(command, client.status());
  const LayerConfig config = wire::LayerConfigFromWire((*client)->cached_info().config());
  const int64_t B = absl::GetFlag(FLAGS_batch), S = absl::GetFlag(FLAGS_seq_len);
  const int64_t count = absl::GetFlag(FLAGS_count);
  const int streams = std::max(1, absl::GetFlag(FLAGS_streams));
  const int in_flight = std::max(1, absl::GetFlag(FLAGS_in_flight));
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  const absl::Duration duration = absl::Seconds(absl::GetFlag(FLAGS_duration_seconds));
  // One batch of inputs, drawn once and shared by every stream and submission (each submission
  // gets a fresh batch id), so the bench measures the service and not the random generator.
  const BatchInputs inputs = RandomBatchInputs(config, B, S, absl::GetFlag(FLAGS_seed));
  BackwardBatch batch = inputs.View();
  if (absl::GetFlag(FLAGS_rotary) == "positions") batch.cos = batch.sin = {};
  batch.mode = *mode;
  batch.precision = *precision;
  batch.response_dtype = *response_dtype;
  batch.input_dtype = *input_dtype;
  if (absl::GetFlag(FLAGS_layer) >= 0) batch.layer = absl::GetFlag(FLAGS_layer);
  batch.expected_weights_version = absl::GetFlag(FLAGS_expected_weights_version);
  batch.borrow_inputs = absl::GetFlag(FLAGS_borrow_inputs);
  // 16-bit wire dtypes from and into 16-bit memory, as a bf16 trainer has it: the inputs converted
  // here once (the wire library's conversion, which the client would otherwise run per batch).
  const bool float32_api = absl::GetFlag(FLAGS_float32_api);
  const bool inputs_16bit = !float32_api && wire::DTypeSize(*input_dtype) == 2;
  const bool answers_16bit = !float32_api && wire::DTypeSize(*response_dtype) == 2;
  std::vector<uint16_t> hidden_16bit, grad_16bit;
  if (inputs_16bit) {
    for (auto [from, to] : {std::pair(&inputs.hidden_states, &hidden_16bit),
                            std::pair(&inputs.grad_output, &grad_16bit)}) {
      to->resize(from->size());
      wire::EncodeFromFloat(*from, *input_dtype, reinterpret_cast<char*>(to->data()));
    }
    batch.hidden_states = batch.grad_output = {};
    batch.hidden_states_16bit = hidden_16bit;
    batch.grad_output_16bit = grad_16bit;
  }

  std::cerr << absl::StrFormat(
      "bench: %s, %d streams x %d in flight over %d channels, batches [%d,%d] (%d tokens), mode "
      "%s, input %s, response %s, %s\n",
      (*client)->target(), streams, in_flight, absl::GetFlag(FLAGS_channels), B, S, B * S,
      ModeName(*mode), wire::DTypeName(*input_dtype), wire::DTypeName(*response_dtype),
      count > 0 ? absl::StrFormat("%d batches per stream", count)
                : absl::StrFormat("%.0f s", absl::ToDoubleSeconds(duration)));

  Totals totals;
  std::atomic<int> warmed{0};
  absl::Notification timing_started;
  absl::Time timing_start;
  double timing_start_cpu = 0;
  std::atomic<int> finished_streams{0};
  const bool answer_buffers = absl::GetFlag(FLAGS_answer_buffers);
  const size_t answer_floats = static_cast<size_t>(B * S * config.hidden_size);

  auto run_stream = [&](int index) {
    auto record_error = [&](const absl::Status& status) {
      absl::MutexLock lock(&totals.mu);
      ++totals.errors;
      if (totals.first_error.empty()) totals.first_error = status.ToString();
    };
    auto stream = (*client)->StartStream();
    if (!stream.ok()) {
      record_error(stream.status());
      if (warmed.fetch_add(1) + 1 == streams) {
        timing_start = absl::Now();
        timing_start_cpu = ProcessCpuSeconds();
        timing_started.Notify();
      }
      finished_streams.fetch_add(1);
      return;
    }
    // --answer_buffers: one buffer per batch in flight (and one for the warm-up), each lent to a
    // batch from its Submit until its result is taken.
    std::vector<std::vector<float>> buffers;
    std::vector<std::vector<uint16_t>> buffers_16bit;           // instead, for a 16-bit answer
    std::vector<PerWeight<std::vector<float>>> weight_buffers;  // RETURN: one set per buffer
    std::vector<size_t> free_buffers;
    std::unordered_map<uint64_t, size_t> lent;  // batch id -> buffer
    if (answer_buffers) {
      const size_t count = static_cast<size_t>(in_flight) + 1;
      for (size_t b = 0; b < count; ++b) {
        if (answers_16bit) {
          buffers_16bit.emplace_back(answer_floats);
        } else {
          buffers.emplace_back(answer_floats);
        }
        free_buffers.push_back(b);
      }
      if (*mode == v1::GRADIENT_MODE_RETURN) {
        weight_buffers.resize(count);
        for (PerWeight<std::vector<float>>& set : weight_buffers) {
          for (Weight weight : kAllWeights) set[weight].resize(WeightElements(config, weight));
        }
      }
    }
    auto submit = [&]() -> absl::StatusOr<uint64_t> {
      BackwardBatch own = batch;
      if (answer_buffers) {
        if (answers_16bit) {
          own.grad_hidden_states_16bit_out = absl::MakeSpan(buffers_16bit[free_buffers.back()]);
        } else {
          own.grad_hidden_states_out = absl::MakeSpan(buffers[free_buffers.back()]);
        }
        if (!weight_buffers.empty()) {
          for (Weight weight : kAllWeights) {
            own.weight_gradients_out[weight] =
                absl::MakeSpan(weight_buffers[free_buffers.back()][weight]);
          }
        }
      }
      absl::StatusOr<uint64_t> id = (*stream)->Submit(own);
      if (id.ok() && answer_buffers) {
        lent[*id] = free_buffers.back();
        free_buffers.pop_back();
      }
      return id;
    };
    auto give_back = [&](uint64_t id) {
      auto it = lent.find(id);
      if (it == lent.end()) return;
      free_buffers.push_back(it->second);
      lent.erase(it);
    };
    // Warm-up: --warmup rounds of --in_flight batches at once, answered before the clock starts
    // (connections, and the buffers of the server's and the client's pools as many as the timed
    // part keeps in flight: page-locking a fresh 100 MB buffer costs the server tens of ms).
    for (int w = 0; w < warmup; ++w) {
      std::vector<uint64_t> ids;
      for (int i = 0; i < in_flight; ++i) {
        auto id = submit();
        if (!id.ok()) break;
        ids.push_back(*id);
      }
      bool failed = ids.size() < static_cast<size_t>(in_flight);
      for (uint64_t id : ids) {
        auto result = (*stream)->Await(id);
        give_back(id);
        if (!result.ok()) {
          failed = true;
          continue;
        }
        absl::MutexLock lock(&totals.mu);
        totals.all_bytes += static_cast<double>(result->request_bytes + result->response_bytes);
      }
      if (failed) break;
    }
    if (warmed.fetch_add(1) + 1 == streams) {
      timing_start = absl::Now();
      timing_start_cpu = ProcessCpuSeconds();
      timing_started.Notify();
    }
    timing_started.WaitForNotification();
    int64_t submitted = 0;
    auto take = [&]() {
      auto result = (*stream)->Next();
      if (!result.ok()) return false;
      give_back(result->batch_id);
      absl::MutexLock lock(&totals.mu);
      if (!result->status.ok()) {
        ++totals.errors;
        if (totals.first_error.empty()) totals.first_error = result->status.ToString();
        return true;
      }
      totals.latencies.push_back(absl::ToDoubleSeconds(result->latency));
      ++totals.batches;
      totals.tokens += B * S;
      totals.bytes += static_cast<double>(result->request_bytes + result->response_bytes);
      totals.all_bytes += static_cast<double>(result->request_bytes + result->response_bytes);
      const v1::StageTimings& t = result->timings;
      totals.stages.set_queue_seconds(totals.stages.queue_seconds() + t.queue_seconds());
      totals.stages.set_copy_in_seconds(totals.stages.copy_in_seconds() + t.copy_in_seconds());
      totals.stages.set_compute_seconds(totals.stages.compute_seconds() + t.compute_seconds());
      totals.stages.set_copy_out_seconds(totals.stages.copy_out_seconds() + t.copy_out_seconds());
      totals.stages.set_total_seconds(totals.stages.total_seconds() + t.total_seconds());
      totals.device = result->device;
      return true;
    };
    while ((count <= 0 || submitted < count) &&
           (count > 0 || absl::Now() - timing_start < duration)) {
      auto id = submit();
      if (!id.ok()) {
        record_error(id.status());
        break;
      }
      ++submitted;
      while ((*stream)->outstanding() >= in_flight && take()) {
      }
    }
    absl::Status finished = (*stream)->Finish();
    while (take()) {
    }
    if (!finished.ok()) record_error(finished);
    finished_streams.fetch_add(1);
    (void)index;
  };

  std::vector<std::thread> threads;
  for (int i = 0; i < streams; ++i) threads.emplace_back(run_stream, i);
  const bool progress = absl::GetFlag(FLAGS_progress);
  const bool tty = isatty(STDERR_FILENO);
  timing_started.WaitForNotification();
  while (finished_streams.load() < streams) {
    absl::SleepFor(absl::Milliseconds(500));
    if (!progress) continue;
    absl::MutexLock lock(&totals.mu);
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - timing_start);
    const std::string line =
        absl::StrFormat("[%6.1f s] %d batches, %.0f tokens/s, %.3f GB/s, p50 %.3f s, errors %d",
                        elapsed, totals.batches, totals.tokens / std::max(elapsed, 1e-9),
                        totals.bytes / 1e9 / std::max(elapsed, 1e-9),
                        Percentile(totals.latencies, 50), totals.errors);
    std::cerr << (tty ? "\r" : "") << line << (tty ? "" : "\n") << std::flush;
  }
  for (std::thread& t : threads) t.join();
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - timing_start);
  const double timed_cpu = ProcessCpuSeconds() - timing_start_cpu;
  if (progress && tty) std::cerr << "\n";

  const std::string inputs_described = absl::StrCat(
      batch.borrow_inputs && (inputs_16bit || *input_dtype == v1::DTYPE_FLOAT32) ? "borrowed "
                                                                                 : "copied ",
      inputs_16bit ? wire::DTypeName(*input_dtype) : "float32");
  const std::string answers_described =
      !answer_buffers
          ? "fresh float32 vectors"
          : absl::StrCat("reused ", answers_16bit ? wire::DTypeName(*response_dtype) : "float32",
                         " buffers");
  absl::MutexLock lock(&totals.mu);
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
      totals.batches, B, S, totals.tokens, elapsed, totals.device, streams, in_flight,
      absl::GetFlag(FLAGS_channels), ModeName(*mode), wire::DTypeName(*input_dtype),
      wire::DTypeName(*response_dtype), totals.tokens / elapsed, totals.batches / elapsed,
      totals.bytes / 1e9 / elapsed, Percentile(totals.latencies, 50),
      Percentile(totals.latencies, 90), Percentile(totals.latencies, 99),
      Percentile(totals.latencies, 100), totals.stages.total_seconds() / n,
      totals.stages.queue_seconds() / n, totals.stages.copy_in_seconds() / n,
      totals.stages.compute_seconds() / n, totals.stages.copy_out_seconds() / n,
      totals.all_bytes / 1e9, timed_cpu / std::max(totals.bytes / 1e9, 1e-12), timed_cpu,
      inputs_described, answers_described, totals.errors,
      totals.first_error.empty() ? "" : absl::StrCat(" (first: ", totals.first_error, ")"));
  return totals.errors == 0 && totals.batches > 0 ? 0 : 1;
}

}  // namespace attngrad::cli
