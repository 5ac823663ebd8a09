// BackwardRequest validation and conversion.
#include "rpc/backward_request.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"
#include "rpc/rotary.h"

namespace attngrad::server {
namespace {

// A rotary table read from a region (ReadActivationsFromRegions): its dtype and shape as the
// message names them, and its bytes found there.
absl::Status CheckRotaryTableInRegion(const v1::Tensor& tensor, const WireTensor& bytes,
                                      const char* name,
                                      absl::Span<const std::int64_t> expected_shape) {
  return wire::CheckTensor(tensor.dtype(), tensor.shape(), bytes.size_bytes(),
                           absl::StrCat("rotary_tables.", name), expected_shape)
      .status();
}

absl::Status CheckScalar(bool present, float value, const char* field, bool positive) {
  if (!present) return absl::OkStatus();
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", value, " is not finite; expected a finite number"));
  }
  if (positive && !(value > 0.f)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", value, " must be > 0"));
  }
  return absl::OkStatus();
}

// Decodes a checked tensor's raw data into `out` and checks that every value is finite.
absl::Status DecodeFinite(const v1::Tensor& tensor, const std::string& field,
                          absl::Span<float> out) {
  ATTNGRAD_RETURN_IF_ERROR(wire::DecodeToFloat(tensor.raw_data(), tensor.dtype(), field, out));
  return wire::CheckFinite(out, field);
}

// The refusal of a field that only a backward batch may carry, in a FORWARD batch.
absl::Status NotInForward(const char* field, const char* why) {
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": not allowed in a FORWARD batch (computation = COMPUTATION_FORWARD), which ", why,
      "; leave it unset"));
}

// What the request asks for (`computation`), checked together with the fields that only one
// computation has: a FORWARD batch reads hidden_states alone, answers with `output` and adds
// nothing to the accumulators; output_region belongs to FORWARD batches only.
absl::StatusOr<Computation> ComputationOf(const v1::BackwardRequest& request) {
  if (!v1::Computation_IsValid(request.computation())) {
    return absl::InvalidArgumentError(
        absl::StrCat("computation: unknown value ", request.computation(),
                     "; expected COMPUTATION_BACKWARD (0) or COMPUTATION_FORWARD (1)"));
  }
  if (request.computation() == v1::COMPUTATION_BACKWARD) {
    if (request.has_output_region()) {
      return absl::InvalidArgumentError(
          "output_region: only for FORWARD batches (computation = COMPUTATION_FORWARD); a "
          "backward batch's grad_hidden_states goes to grad_hidden_states_region");
    }
    return Computation::kBackward;
  }
  if (request.has_grad_output()) {
    return NotInForward("grad_output", "computes the layer's output from hidden_states alone");
  }
  if (request.has_grad_output_region()) {
    return NotInForward("grad_output_region",
                        "computes the layer's output from hidden_states alone");
  }
  if (request.mode() == v1::GRADIENT_MODE_ACCUMULATE) {
    return NotInForward("mode: GRADIENT_MODE_ACCUMULATE",
                        "computes no weight gradients (mode must be unset or RETURN)");
  }
  if (request.has_grad_hidden_states_region()) {
    return NotInForward("grad_hidden_states_region",
                        "answers with `output` (write it into a region with output_region)");
  }
  if (request.has_weight_gradients_region()) {
    return NotInForward("weight_gradients_region", "computes no weight gradients");
  }
  return Computation::kForward;
}

// The request's options: mode, computation, precision, response dtype and window, checked.
absl::StatusOr<ParsedBackward> ParseOptions(const v1::BackwardRequest& request,
                                            Computation* computation) {
  ParsedBackward parsed;
  if (!v1::GradientMode_IsValid(request.mode())) {
    return absl::InvalidArgumentError(
        absl::StrCat("mode: unknown value ", request.mode(),
                     "; expected GRADIENT_MODE_RETURN (1) or GRADIENT_MODE_ACCUMULATE (2)"));
  }
  parsed.accumulate = request.mode() == v1::GRADIENT_MODE_ACCUMULATE;
  ATTNGRAD_ASSIGN_OR_RETURN(*computation, ComputationOf(request));
  if (!v1::Precision_IsValid(request.precision())) {
    return absl::InvalidArgumentError(absl::StrCat("precision: unknown value ", request.precision(),
                                                   "; expected AUTO, FP32, TF32 or FP16"));
  }
  const int response_dtype = request.response_dtype() == v1::DTYPE_UNSPECIFIED
                                 ? v1::DTYPE_FLOAT32
                                 : request.response_dtype();
  if (!wire::IsSupportedDType(response_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("response_dtype: ", wire::DTypeName(response_dtype),
                     " is not supported; expected float32, float16 "
                     "or bfloat16"));
  }
  parsed.response_dtype = response_dtype;
  if (!parsed.accumulate && request.accumulation_window_id() != 0) {
    return absl::InvalidArgumentError(
        "accumulation_window_id: only meaningful with mode GRADIENT_MODE_ACCUMULATE; leave it 0 "
        "for RETURN");
  }
  return parsed;
}

// The batch's B and S from hidden_states (and, backward, grad_output of the same shape), within
// the server's token limit.
absl::StatusOr<std::pair<std::int64_t, std::int64_t>> CheckActivations(
    const ReceivedBackwardRequest& received, const LayerConfig& config, const BatchLimits& limits,
    bool forward) {
  const v1::BackwardRequest& request = received.message;
  const std::int64_t hidden = config.hidden_size;
  if (!request.has_hidden_states()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states: missing; expected a [B,S,", hidden, "] tensor"));
  }
  ATTNGRAD_ASSIGN_OR_RETURN(
      const std::vector<std::int64_t> shape,
      wire::CheckTensor(request.hidden_states().dtype(), request.hidden_states().shape(),
                        received.hidden_states.size_bytes(), "hidden_states", {-1, -1, hidden}));
  const std::int64_t batch = shape[0];
  const std::int64_t seq_len = shape[1];
  const std::int64_t tokens = batch * seq_len;
  if (tokens > limits.max_batch_tokens || batch > std::numeric_limits<int>::max() ||
      seq_len > std::numeric_limits<int>::max()) {
    if (seq_len > limits.max_batch_tokens) {
      return absl::ResourceExhaustedError(
          absl::StrCat("hidden_states: one sequence of S=", seq_len,
                       " tokens exceeds the server's limit of ", limits.max_batch_tokens,
                       " tokens per batch (--max_batch_tokens); it cannot be split "
                       "along B"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "hidden_states: B*S = ", batch, "*", seq_len, " = ", tokens,
        " tokens exceeds the server's limit of ", limits.max_batch_tokens,
        " tokens per batch (--max_batch_tokens); split the batch along B (sequences are "
        "independent, so the split is exact): at most ",
        limits.max_batch_tokens / seq_len, " sequences of S=", seq_len,
        " per request, and sum the weight gradients (or use "
        "ACCUMULATE)"));
  }
  if (forward) return std::pair(batch, seq_len);  // ComputationOf refused a grad_output
  const std::vector<std::int64_t> activation_shape = {batch, seq_len, hidden};
  if (!request.has_grad_output()) {
    return absl::InvalidArgumentError(absl::StrCat("grad_output: missing; expected a ",
                                                   wire::ShapeString(activation_shape), " tensor"));
  }
  ATTNGRAD_RETURN_IF_ERROR(
      wire::CheckTensor(request.grad_output().dtype(), request.grad_output().shape(),
                        received.grad_output.size_bytes(), "grad_output", activation_shape)
          .status());
  return std::pair(batch, seq_len);
}

// B*S or S position ids and a usable RoPE base; the base (the layer's when the request's is 0).
absl::StatusOr<double> CheckPositions(const v1::RotaryPositions& positions,
                                      const LayerConfig& config, const LayerSettings& settings,
                                      std::int64_t batch, std::int64_t seq_len) {
  const std::int64_t count = positions.position_ids_size();
  if (count != batch * seq_len && count != seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("positions.position_ids: got ", count,
                                                   " values, expected B*S = ", batch * seq_len,
                                                   " or S = ", seq_len));
  }
  const double theta = positions.rope_theta() == 0 ? settings.rope_theta : positions.rope_theta();
  if (!std::isfinite(theta) || !(theta > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("positions.rope_theta: ", positions.rope_theta(),
                     " must be finite and > 0 (0 = the layer's RoPE base)"));
  }
  // Ids within +-2^40 (std::llabs(INT64_MIN) overflowed and passed) and a theta whose tables
  // are finite (a subnormal theta overflowed theta^(-2i/head_dim) into NaN tables).
  ATTNGRAD_RETURN_IF_ERROR(CheckRotaryInputs(
      absl::MakeConstSpan(positions.position_ids().data(), positions.position_ids_size()),
      config.head_dim, theta, settings.rope_scaling_factor));
  return theta;
}

// The rotary inputs checked against [B,S,head_dim]: the tables (in the message or, rpc/regions.h
// read them, in GPU memory), or positions; the RoPE base of positions (0 for tables).
absl::StatusOr<double> CheckRotary(const ReceivedBackwardRequest& received,
                                   const LayerConfig& config, const LayerSettings& settings,
                                   std::int64_t batch, std::int64_t seq_len) {
  const v1::BackwardRequest& request = received.message;
  const std::vector<std::int64_t> rotary_shape = {batch, seq_len, config.head_dim};
  switch (request.rotary_case()) {
    case v1::BackwardRequest::kRotaryTables:
      if (!request.rotary_tables().has_cos() || !request.rotary_tables().has_sin()) {
        return absl::InvalidArgumentError(
            absl::StrCat("rotary_tables: both cos and sin are required, each ",
                         wire::ShapeString(rotary_shape)));
      }
      if (request.has_cos_region()) {  // in GPU memory (rpc/regions.h read them)
        ATTNGRAD_RETURN_IF_ERROR(CheckRotaryTableInRegion(request.rotary_tables().cos(),
                                                          received.cos, "cos", rotary_shape));
        ATTNGRAD_RETURN_IF_ERROR(CheckRotaryTableInRegion(request.rotary_tables().sin(),
                                                          received.sin, "sin", rotary_shape));
        return 0.0;
      }
      ATTNGRAD_RETURN_IF_ERROR(
          wire::CheckTensor(request.rotary_tables().cos(), "rotary_tables.cos", rotary_shape));
      ATTNGRAD_RETURN_IF_ERROR(
          wire::CheckTensor(request.rotary_tables().sin(), "rotary_tables.sin", rotary_shape));
      return 0.0;
    case v1::BackwardRequest::kPositions:
      return CheckPositions(request.positions(), config, settings, batch, seq_len);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rotary: neither rotary_tables (cos/sin ", wire::ShapeString(rotary_shape),
                       ") nor positions (position_ids, rope_theta) is set"));
  }
}

// The layer's scalars (config.json), overridden by the request's; softcap <= 0 = none.
absl::StatusOr<Scalars> ScalarsOf(const v1::BackwardRequest& request,
                                  const LayerSettings& settings) {
  Scalars scalars = settings.scalars;
  if (request.has_scaling()) scalars.scaling = request.scaling();
  if (request.has_softcap()) scalars.softcap = std::max(0.f, request.softcap());
  if (request.has_eps()) scalars.eps = request.eps();
  ATTNGRAD_RETURN_IF_ERROR(CheckScalar(request.has_scaling(), request.scaling(), "scaling", false));
  ATTNGRAD_RETURN_IF_ERROR(CheckScalar(request.has_softcap(), request.softcap(), "softcap", false));
  ATTNGRAD_RETURN_IF_ERROR(CheckScalar(request.has_eps(), request.eps(), "eps", true));
  if (request.has_sliding_window()) {
    if (request.sliding_window() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("sliding_window: ", request.sliding_window(),
                                                     " must be >= 0 (0 = full causal attention)"));
    }
    scalars.sliding_window = request.sliding_window();
  }
  return scalars;
}

// The response must fit in one message: the [B,S,hidden] tensor and, RETURN, the weight gradients.
absl::Status CheckResponseSize(const LayerConfig& config, std::int64_t tokens,
                               bool weight_gradients, int response_dtype,
                               const BatchLimits& limits) {
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t response_elements =
      tokens * hidden + (weight_gradients
                             ? 2 * static_cast<std::int64_t>(config.q_out()) * hidden +
                                   2 * static_cast<std::int64_t>(config.kv_out()) * hidden +
                                   2 * static_cast<std::int64_t>(config.head_dim)
                             : 0);
  const std::int64_t response_bytes =
      response_elements * static_cast<std::int64_t>(wire::DTypeSize(response_dtype)) + 4096;
  if (response_bytes <= limits.max_message_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "hidden_states: the response would be about ", response_bytes,
      " bytes, over the message limit of ", limits.max_message_bytes,
      " bytes; split the batch along B (exact: sequences are independent), ask for a 16-bit "
      "response_dtype, or use ACCUMULATE"));
}

// The rotary tables of a job whose tables are not in GPU memory: decoded from the request (and
// checked finite), or built from its positions with the RoPE base `theta`.
absl::Status FillRotaryTables(const v1::BackwardRequest& request, const LayerSettings& settings,
                              double theta, BatchJob& job) {
  const std::size_t rotary = static_cast<std::size_t>(job.tokens()) *
                             static_cast<std::size_t>(job.request.config.head_dim);
  job.request.cos.resize(rotary);
  job.request.sin.resize(rotary);
  if (request.rotary_case() == v1::BackwardRequest::kRotaryTables) {
    ATTNGRAD_RETURN_IF_ERROR(DecodeFinite(request.rotary_tables().cos(),
                                          "rotary_tables.cos.raw_data",
                                          absl::MakeSpan(job.request.cos)));
    return DecodeFinite(request.rotary_tables().sin(), "rotary_tables.sin.raw_data",
                        absl::MakeSpan(job.request.sin));
  }
  const auto& ids = request.positions().position_ids();
  BuildRotaryTables(absl::MakeConstSpan(ids.data(), ids.size()), job.request.batch,
                    job.request.seq_len, job.request.config.head_dim, theta,
                    absl::MakeSpan(job.request.cos), absl::MakeSpan(job.request.sin),
                    settings.rope_scaling_factor);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ParsedBackward> ParseBackwardRequest(ReceivedBackwardRequest received,
                                                    const LayerConfig& config,
                                                    const LayerSettings& settings,
                                                    const BatchLimits& limits) {
  const v1::BackwardRequest& request = received.message;
  Computation computation = Computation::kBackward;
  ATTNGRAD_ASSIGN_OR_RETURN(ParsedBackward parsed, ParseOptions(request, &computation));
  const bool forward = computation == Computation::kForward;
  ATTNGRAD_ASSIGN_OR_RETURN(const auto shape, CheckActivations(received, config, limits, forward));
  const auto [batch, seq_len] = shape;
  ATTNGRAD_ASSIGN_OR_RETURN(const double theta,
                            CheckRotary(received, config, settings, batch, seq_len));
  ATTNGRAD_ASSIGN_OR_RETURN(const Scalars scalars, ScalarsOf(request, settings));
  const bool weight_gradients = !parsed.accumulate && !forward;  // RETURN's answer has them
  ATTNGRAD_RETURN_IF_ERROR(
      CheckResponseSize(config, batch * seq_len, weight_gradients, parsed.response_dtype, limits));

  // The activations stay as they arrived (the worker copies them once, checking every value is
  // finite); the rotary tables are decoded (and checked) here.
  auto job = std::make_unique<BatchJob>();
  job->request.computation = computation;
  job->request.batch = static_cast<int>(batch);
  job->request.seq_len = static_cast<int>(seq_len);
  job->request.config = config;
  job->request.response_dtype = parsed.response_dtype;
  job->request.scalars = scalars;
  job->request.precision = request.precision() == v1::PRECISION_UNSPECIFIED
                               ? Precision::kAuto
                               : static_cast<Precision>(static_cast<int>(request.precision()) - 1);
  job->admission.accumulate = parsed.accumulate;
  job->request.return_weight_gradients = weight_gradients;
  received.hidden_states.set_dtype(request.hidden_states().dtype());
  if (!forward) received.grad_output.set_dtype(request.grad_output().dtype());
  job->request.hidden_states = std::move(received.hidden_states);
  job->request.grad_output = std::move(received.grad_output);
  if (received.cos.cuda_device() >= 0) {  // the kernels read them in the client's GPU memory
    job->request.device_cos = std::move(received.cos);
    job->request.device_sin = std::move(received.sin);
  } else {
    ATTNGRAD_RETURN_IF_ERROR(FillRotaryTables(request, settings, theta, *job));
  }
  parsed.job = std::move(job);
  return parsed;
}

absl::StatusOr<ParsedBackward> ParseBackwardRequest(const v1::BackwardRequest& request,
                                                    const LayerConfig& config,
                                                    const BatchLimits& limits) {
  LayerSettings settings;
  settings.scalars.scaling = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
  return ParseBackwardRequest(ReceivedFromMessage(request), config, settings, limits);
}

ReceivedBackwardRequest ReceivedFromMessage(v1::BackwardRequest message) {
  ReceivedBackwardRequest received;
  if (message.has_hidden_states()) {
    received.hidden_states =
        WireTensor::FromBytes(message.hidden_states().dtype(),
                              std::move(*message.mutable_hidden_states()->mutable_raw_data()));
    message.mutable_hidden_states()->clear_raw_data();
  }
  if (message.has_grad_output()) {
    received.grad_output =
        WireTensor::FromBytes(message.grad_output().dtype(),
                              std::move(*message.mutable_grad_output()->mutable_raw_data()));
    message.mutable_grad_output()->clear_raw_data();
  }
  received.message = std::move(message);
  return received;
}

std::int64_t PayloadBytes(const ReceivedBackwardRequest& request) {
  std::int64_t bytes = static_cast<std::int64_t>(request.hidden_states.size_bytes() +
                                                 request.grad_output.size_bytes());
  const v1::BackwardRequest& message = request.message;
  if (message.has_rotary_tables()) {
    bytes += message.rotary_tables().cos().raw_data().size() +
             message.rotary_tables().sin().raw_data().size();
  }
  return bytes;
}

std::int64_t PayloadBytes(const BatchJob& job) {
  return static_cast<std::int64_t>(job.result.answer.size);
}

}  // namespace attngrad::server
