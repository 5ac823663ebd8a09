// attngrad-cli backward: sends batches (random SPEC section 3 inputs, or .npy files) on one
// Backward stream, prints each answer, and with --check compares it with the local CPU reference.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "cli_common.h"
#include "reference_check.h"
#include "tensor_files.h"

namespace attngrad::cli {
namespace {

// Inputs from --hidden_states/--grad_output[/--cos/--sin] .npy files.
absl::StatusOr<BatchInputs> FileInputs(const LayerConfig& config) {
  ATTNGRAD_ASSIGN_OR_RETURN(HostTensor hidden, ReadNpy(absl::GetFlag(FLAGS_hidden_states)));
  ATTNGRAD_ASSIGN_OR_RETURN(HostTensor grad, ReadNpy(absl::GetFlag(FLAGS_grad_output)));
  if (hidden.shape.size() != 3 || hidden.shape[2] != config.hidden_size ||
      grad.shape != hidden.shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--hidden_states ", wire::ShapeString(hidden.shape), " and --grad_output ",
        wire::ShapeString(grad.shape), " must both be [B,S,", config.hidden_size, "]"));
  }
  BatchInputs inputs;
  inputs.batch = hidden.shape[0];
  inputs.seq_len = hidden.shape[1];
  inputs.hidden_states = std::move(hidden.data);
  inputs.grad_output = std::move(grad.data);
  const std::string cos_path = absl::GetFlag(FLAGS_cos), sin_path = absl::GetFlag(FLAGS_sin);
  if (cos_path.empty() != sin_path.empty()) {
    return absl::InvalidArgumentError("give both --cos and --sin, or neither");
  }
  if (cos_path.empty()) {
    RotaryTables(inputs.batch, inputs.seq_len, config.head_dim, 10000.0, &inputs.cos, &inputs.sin);
    return inputs;
  }
  ATTNGRAD_ASSIGN_OR_RETURN(HostTensor cos, ReadNpy(cos_path));
  ATTNGRAD_ASSIGN_OR_RETURN(HostTensor sin, ReadNpy(sin_path));
  const std::vector<int64_t> rotary_shape = {inputs.batch, inputs.seq_len, config.head_dim};
  if (cos.shape != rotary_shape || sin.shape != rotary_shape) {
    return absl::InvalidArgumentError(absl::StrCat("--cos ", wire::ShapeString(cos.shape),
                                                   " and --sin ", wire::ShapeString(sin.shape),
                                                   " must be ", wire::ShapeString(rotary_shape)));
  }
  inputs.cos = std::move(cos.data);
  inputs.sin = std::move(sin.data);
  return inputs;
}

std::string TimingLine(const BackwardResult& r) {
  const v1::StageTimings& t = r.timings;
  return absl::StrFormat(
      "server %.3f s (queue %.3f, copy_in %.3f, compute %.3f, copy_out %.3f), round trip %.3f s",
      t.total_seconds(), t.queue_seconds(), t.copy_in_seconds(), t.compute_seconds(),
      t.copy_out_seconds(), absl::ToDoubleSeconds(r.latency));
}

// The flags that shape every batch of the run.
struct BackwardOptions {
  v1::GradientMode mode = v1::GRADIENT_MODE_RETURN;
  v1::Precision precision = v1::PRECISION_AUTO;
  v1::DType response_dtype = v1::DTYPE_FLOAT32;
  v1::DType input_dtype = v1::DTYPE_FLOAT32;
  std::string rotary;  // "tables" or "positions"
};

absl::StatusOr<BackwardOptions> ParseBackwardFlags() {
  BackwardOptions options;
  ATTNGRAD_ASSIGN_OR_RETURN(
      options.mode,
      ParseMode(absl::GetFlag(FLAGS_mode).empty() ? "return" : absl::GetFlag(FLAGS_mode)));
  ATTNGRAD_ASSIGN_OR_RETURN(options.precision, ParsePrecision(absl::GetFlag(FLAGS_precision)));
  ATTNGRAD_ASSIGN_OR_RETURN(options.response_dtype,
                            ParseDType(absl::GetFlag(FLAGS_response_dtype)));
  ATTNGRAD_ASSIGN_OR_RETURN(options.input_dtype, ParseDType(absl::GetFlag(FLAGS_input_dtype)));
  options.rotary = absl::GetFlag(FLAGS_rotary);
  if (options.rotary != "tables" && options.rotary != "positions") {
    return absl::InvalidArgumentError("--rotary must be tables or positions");
  }
  return options;
}

// The inputs of --hidden_states/--grad_output when either is given (one batch); none otherwise.
absl::StatusOr<std::optional<BatchInputs>> NamedFileInputs(const LayerConfig& config) {
  if (absl::GetFlag(FLAGS_hidden_states).empty() && absl::GetFlag(FLAGS_grad_output).empty()) {
    return std::nullopt;
  }
  ATTNGRAD_ASSIGN_OR_RETURN(BatchInputs inputs, FileInputs(config));
  return std::optional<BatchInputs>(std::move(inputs));
}

// --check: the weights the answers are checked against. `pinned_version`
// (--expected_weights_version on entry) becomes the version of the addressed layer that holds them:
// the version of the upload
// (--check_weights=upload), or the server's (--check_weights=server) when none was given.
absl::StatusOr<WeightSet> WeightsToCheckAgainst(ShardedClient& client,
                                                const v1::GetModelInfoResponse& info,
                                                const LayerConfig& config,
                                                std::optional<int> addressed,
                                                uint64_t* pinned_version) {
  ATTNGRAD_ASSIGN_OR_RETURN(WeightSet weights, LocalWeights(config));
  const std::string how = absl::GetFlag(FLAGS_check_weights);
  if (how == "upload") {
    ATTNGRAD_ASSIGN_OR_RETURN(const uint64_t version,
                              client.LoadWeights(weights, *pinned_version, addressed));
    *pinned_version = version;
    std::cout << "uploaded " << LocalWeightsSource() << " as weights version " << version << "\n";
    return weights;
  }
  if (how != "server") {
    return absl::InvalidArgumentError("--check_weights must be upload or server");
  }
  if (info.weights_source() != LocalWeightsSource()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--check_weights=server: the server holds '", info.weights_source(),
                     "' but the CLI would check against '", LocalWeightsSource(),
                     "'; start the server with the same --weights/--weights_seed, or "
                     "use --check_weights=upload"));
  }
  if (*pinned_version == 0) {
    *pinned_version = info.weights_version();
    for (const v1::LayerInfo& layer_info : info.layers()) {
      if (addressed.has_value() && layer_info.index() == *addressed) {
        *pinned_version = layer_info.weights_version();
      }
    }
  }
  std::cout << "checking against the server's " << info.weights_source() << " (version "
            << *pinned_version << ")\n";
  return weights;
}

// The scalars the server applies to batches of `layer` (-1: the server's defaults), for --check.
Scalars LayerScalars(const v1::GetModelInfoResponse& info, int layer) {
  Scalars scalars;
  if (info.default_scaling() > 0) scalars.scaling = info.default_scaling();
  if (info.default_softcap() > 0) scalars.softcap = info.default_softcap();
  if (info.default_eps() > 0) scalars.eps = info.default_eps();
  // --layer: that layer's defaults (a server of a whole model lists them; softcap <= 0 = none).
  for (const v1::LayerInfo& layer_info : info.layers()) {
    if (layer >= 0 && layer_info.index() == layer) {
      scalars.scaling = layer_info.scaling();
      scalars.softcap = std::max(0.f, layer_info.softcap());
      scalars.eps = layer_info.eps();
      scalars.sliding_window = layer_info.sliding_window();
    }
  }
  return scalars;
}

// The request of batch `index` of the run: its inputs rounded to the wire dtype first (what the
// server receives is the rounded input: --check compares with its reference). The batch's spans
// point into `inputs`.
BackwardBatch MakeBatch(const BackwardOptions& options, uint64_t pinned_version, int64_t index,
                        BatchInputs& inputs) {
  RoundToWireDType(options.input_dtype, &inputs.hidden_states);
  RoundToWireDType(options.input_dtype, &inputs.grad_output);
  BackwardBatch batch = inputs.View();
  batch.input_dtype = options.input_dtype;
  if (options.rotary == "positions" && absl::GetFlag(FLAGS_cos).empty()) {
    batch.cos = {};
    batch.sin = {};  // the server builds the tables of positions 0..S-1 (theta 10000)
  }
  batch.mode = options.mode;
  batch.precision = options.precision;
  batch.response_dtype = options.response_dtype;
  batch.expected_weights_version = pinned_version;
  if (absl::GetFlag(FLAGS_layer) >= 0) batch.layer = absl::GetFlag(FLAGS_layer);
  if (options.mode == v1::GRADIENT_MODE_ACCUMULATE)
    batch.accumulation_window_id = absl::GetFlag(FLAGS_window);
  if (absl::GetFlag(FLAGS_batch_id) != 0) batch.batch_id = absl::GetFlag(FLAGS_batch_id) + index;
  return batch;
}

// The batches of a run in flight on its stream, and their answers: printed as they come, checked
// against the CPU reference (--check, with the weights given) and written as .npy (--output).
class BackwardAnswers {
 public:
  BackwardAnswers(const LayerConfig& config, v1::GradientMode mode, int64_t batch, int64_t seq_len,
                  std::optional<WeightSet> weights, Scalars scalars, std::string output)
      : config_(config),
        mode_(mode),
        batch_(batch),
        seq_len_(seq_len),
        weights_(std::move(weights)),
        scalars_(scalars),
        output_(std::move(output)) {}

  // Batch `index` went out as `id`; --check keeps its inputs until it is answered.
  void Sent(uint64_t id, int64_t index, BatchInputs inputs) {
    index_of_[id] = index;
    if (weights_.has_value()) kept_.emplace(id, std::move(inputs));
  }

  void Handle(const BackwardResult& result) {
    ++answered_;
    const int64_t index = index_of_[result.batch_id];
    if (!result.status.ok()) {
      ++failures_;
      std::cout << "batch " << result.batch_id << ": FAILED "
                << absl::StatusCodeToString(result.status.code()) << ": " << result.status.message()
                << "\n";
      kept_.erase(result.batch_id);
      return;
    }
    std::cout << absl::StrFormat(
        "batch %d: [%d,%d] %s on %s, weights v%d%s%s, %s%s\n", result.batch_id, batch_, seq_len_,
        ModeName(mode_), result.device, result.weights_version,
        mode_ == v1::GRADIENT_MODE_ACCUMULATE
            ? absl::StrCat(", window ", result.accumulation_window_id)
            : "",
        result.duplicate ? " (duplicate: not added again)" : "", TimingLine(result),
        result.parts > 1 ? absl::StrCat(", split into ", result.parts) : "");
    HostTensor grad{result.shape, result.grad_hidden_states};
    std::cout << "  grad_hidden_states   " << TensorSummary(grad) << "\n";
    if (weights_.has_value()) Check(result);
    if (!output_.empty()) Write(result, index, grad);
    kept_.erase(result.batch_id);
  }

  int64_t answered() const { return answered_; }
  int64_t failures() const { return failures_; }

 private:
  void Check(const BackwardResult& result) {
    auto reference = ComputeReference(config_, kept_.at(result.batch_id), *weights_, scalars_);
    if (!reference.ok()) {
      ++failures_;
      std::cout << "  check: " << reference.status() << "\n";
      return;
    }
    const double atol = SpecAtol(batch_, seq_len_);
    const CheckReport report = CheckAgainstReference(
        result.grad_hidden_states, result.weight_gradients ? &*result.weight_gradients : nullptr,
        *reference, atol);
    std::cout << "  check against the CPU reference (SPEC section 4, atol " << atol
              << "): " << (report.passed() ? "PASS" : "FAIL") << "\n"
              << report.ToString();
    if (!report.passed()) ++failures_;
  }

  void Write(const BackwardResult& result, int64_t index, const HostTensor& grad) {
    const std::string prefix = absl::StrCat(output_, "/batch", index, "_");
    absl::Status status = WriteNpy(prefix + "grad_hidden_states.npy", grad);
    if (status.ok() && result.weight_gradients) {
      for (Weight weight : kAllWeights) {
        if (!status.ok()) break;
        status = WriteNpy(absl::StrCat(prefix, "grad_", WeightModuleName(weight), ".npy"),
                          (*result.weight_gradients)[weight]);
      }
    }
    if (!status.ok()) {
      ++failures_;
      std::cout << "  writing " << prefix << "*.npy: " << status << "\n";
    }
  }

  const LayerConfig config_;
  const v1::GradientMode mode_;
  const int64_t batch_, seq_len_;
  const std::optional<WeightSet> weights_;  // --check
  const Scalars scalars_;
  const std::string output_;              // --output: a folder, or empty
  std::map<uint64_t, BatchInputs> kept_;  // inputs of batches in flight (for --check)
  std::map<uint64_t, int64_t> index_of_;  // batch id -> index i
  int64_t failures_ = 0, answered_ = 0;
};

}  // namespace

int RunBackward() {
  const std::string command = "backward";
  absl::StatusOr<BackwardOptions> options = ParseBackwardFlags();
  if (!options.ok()) return Fail(command, options.status());
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(command, client.status());
  const v1::GetModelInfoResponse info = (*client)->cached_info();
  const LayerConfig config = wire::LayerConfigFromWire(info.config());
  absl::StatusOr<std::optional<BatchInputs>> file_inputs = NamedFileInputs(config);
  if (!file_inputs.ok()) return Fail(command, file_inputs.status());
  const bool from_files = file_inputs->has_value();
  const int64_t B = from_files ? (*file_inputs)->batch : absl::GetFlag(FLAGS_batch);
  const int64_t S = from_files ? (*file_inputs)->seq_len : absl::GetFlag(FLAGS_seq_len);
  const int64_t count = from_files ? 1 : absl::GetFlag(FLAGS_count);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const bool check = absl::GetFlag(FLAGS_check);
  const std::string output = absl::GetFlag(FLAGS_output);
  // --layer: the decoder layer every batch addresses (-1: the server's first).
  const int layer = absl::GetFlag(FLAGS_layer);
  const std::optional<int> addressed = layer >= 0 ? std::optional<int>(layer) : std::nullopt;
  uint64_t pinned_version = absl::GetFlag(FLAGS_expected_weights_version);
  std::optional<WeightSet> weights;
  if (check) {
    auto local = WeightsToCheckAgainst(**client, info, config, addressed, &pinned_version);
    if (!local.ok()) return Fail(command, local.status());
    weights = *std::move(local);
  }
  BackwardAnswers answers(config, options->mode, B, S, std::move(weights),
                          LayerScalars(info, layer), output);

  auto stream = (*client)->StartStream();
  if (!stream.ok()) return Fail(command, stream.status());
  if (!output.empty()) std::filesystem::create_directories(output);
  const absl::Time start = absl::Now();
  for (int64_t i = 0; i < count; ++i) {
    BatchInputs inputs = from_files ? **file_inputs : RandomBatchInputs(config, B, S, seed + i);
    auto id = (*stream)->Submit(MakeBatch(*options, pinned_version, i, inputs));
    if (!id.ok()) return Fail(command, id.status());
    answers.Sent(*id, i, std::move(inputs));
    while ((*stream)->outstanding() >= std::max(1, absl::GetFlag(FLAGS_in_flight))) {
      auto result = (*stream)->Next();
      if (!result.ok()) return Fail(command, result.status());
      answers.Handle(*result);
    }
  }
  absl::Status finished = (*stream)->Finish();
  while (true) {
    auto result = (*stream)->Next();
    if (!result.ok()) break;  // OUT_OF_RANGE: everything answered
    answers.Handle(*result);
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t answered = answers.answered(), failures = answers.failures();
  std::cout << absl::StrFormat("%d batches (%d tokens) in %.2f s: %d ok, %d failed%s\n", answered,
                               answered * B * S, seconds, answered - failures, failures,
                               check ? " (failed includes checks)" : "");
  if (!finished.ok()) return Fail(command, finished);
  return failures == 0 && answered == count ? 0 : 1;
}

}  // namespace attngrad::cli
