// attngrad-cli shared flags and helpers.
#include "cli_common.h"

#include <cmath>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/safetensors.h"
#include "attngrad/wire/tensor.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "gRPC address of the attngrad server, or a layer map of a model spread over several "
          "servers: \"0-12=host-a:50051,13-25=host-b:50051\" (each layer-addressed call goes to "
          "the server of its layer)");
ABSL_FLAG(std::string, tls_ca, "",
          "TLS: PEM CA bundle the server's certificate is checked against (empty with "
          "--tls=true: the system's roots)");
ABSL_FLAG(bool, tls, false, "TLS to the server (implied by --tls_ca / --tls_cert)");
ABSL_FLAG(std::string, tls_cert, "", "mutual TLS: this client's PEM certificate");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: the PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "TLS: the name the server's certificate carries, when --target's host differs");
ABSL_FLAG(std::string, token_file, "",
          "file whose first line is the bearer token (servers with --tokens_file); a token is "
          "never passed on the command line");
ABSL_FLAG(std::string, client_id, "",
          "servers without authentication: the client id that scopes windows, batch ids and "
          "stream limits (default: the server's \"default\")");
ABSL_FLAG(std::string, for_client, "",
          "fetch / zero, admin only: the client whose window to address");
ABSL_FLAG(double, deadline_seconds, 300, "deadline of each call (and of one-batch streams)");
ABSL_FLAG(double, connect_timeout_seconds, 10, "how long to wait for the server to be reachable");
ABSL_FLAG(int, retries, 4, "attempts of idempotent calls (info, health, fetch without zeroing)");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30,
          "client-side gRPC message limit; batches are split along B to fit it and the server's");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{4} << 20,
          "chunk size of weight uploads / gradient fetches");
ABSL_FLAG(int, channels, 8,
          "connections per server; streams take them in turn (bench: --streams <= --channels gives "
          "every stream a connection of its own)");

ABSL_FLAG(int64_t, batch, 1, "B: sequences per batch");
ABSL_FLAG(int64_t, seq_len, 16, "S: tokens per sequence");
ABSL_FLAG(int64_t, count, 1,
          "backward: batches to send; bench: batches per stream (0 = run for --duration_seconds)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the random inputs (batch i uses seed + i)");
ABSL_FLAG(std::string, mode, "",
          "return | accumulate (default: return for backward, accumulate for bench)");
ABSL_FLAG(std::string, precision, "auto", "auto | fp32 | tf32 | fp16");
ABSL_FLAG(std::string, response_dtype, "float32",
          "wire dtype of answers: float32 | float16 | bfloat16");
ABSL_FLAG(std::string, input_dtype, "float32",
          "wire dtype of hidden_states and grad_output: float32 | float16 | bfloat16 (--check "
          "compares with the reference of the rounded inputs)");
ABSL_FLAG(
    std::string, rotary, "tables",
    "tables: send cos/sin [B,S,128]; positions: send position ids 0..S-1 (server builds them)");
ABSL_FLAG(int, in_flight, 4, "batches in flight per stream");
ABSL_FLAG(uint64_t, batch_id, 0, "id of the first batch (then +1 each); 0 = chosen by the client");
ABSL_FLAG(uint64_t, expected_weights_version, 0,
          "refuse work if the server's weights version differs (0 = any)");
ABSL_FLAG(int, layer, -1,
          "decoder layer that backward, fetch, zero and load-weights address (GetModelInfo's "
          "layers; -1 = the server's first layer)");
ABSL_FLAG(std::string, layers, "",
          "fetch: several decoder layers at once, e.g. \"0,1,5\" (overrides --layer)");
ABSL_FLAG(uint64_t, window, 0,
          "accumulation window: ACCUMULATE batches name it; fetch/zero expect it (0 = current)");
ABSL_FLAG(std::string, hidden_states, "",
          "backward: .npy file (float32 [B,S,3072]) instead of random inputs");
ABSL_FLAG(std::string, grad_output, "",
          "backward: .npy file (float32 [B,S,3072]) instead of random inputs");
ABSL_FLAG(std::string, cos, "",
          "backward: .npy file (float32 [B,S,128]); default: positions 0..S-1, theta 1e4");
ABSL_FLAG(std::string, sin, "",
          "backward: .npy file (float32 [B,S,128]); default: positions 0..S-1, theta 1e4");
ABSL_FLAG(std::string, output, "",
          "backward: directory for the results as .npy; fetch: a .safetensors file or a directory");

ABSL_FLAG(bool, check, false,
          "backward: compare every answer with the local CPU reference under SPEC section 4");
ABSL_FLAG(
    std::string, check_weights, "upload",
    "--check's weights. upload: upload --weights_file or random(--weights_seed) weights first "
    "and pin that version; server: trust that the server already holds them (its "
    "weights_source must match)");
ABSL_FLAG(uint64_t, weights_seed, 0, "seed of random weights (the server's generator)");
ABSL_FLAG(std::string, weights_file, "", "safetensors file with the layer's weights");
ABSL_FLAG(int, weights_layer, 0, "layer index in --weights_file");
ABSL_FLAG(bool, wire_fp32, false,
          "load-weights: convert to float32 before uploading (default: the file's dtype when the "
          "server accepts it)");

ABSL_FLAG(int, streams, 4, "bench: concurrent Backward streams");
ABSL_FLAG(double, duration_seconds, 10, "bench: how long to run when --count=0");
ABSL_FLAG(int, warmup, 1,
          "bench: rounds of --in_flight batches per stream answered before timing starts");
ABSL_FLAG(bool, progress, true, "bench: a live progress line on stderr");

ABSL_FLAG(bool, zero_after, false, "fetch: atomically zero the accumulators (start a new window)");
ABSL_FLAG(std::string, service, "", "health: service name (\"\" = the whole server)");

namespace attngrad::cli {

absl::StatusOr<std::unique_ptr<ShardedClient>> ConnectFromFlags(bool read_info) {
  ClientOptions options;
  options.read_info_on_connect = read_info;
  options.deadline = absl::Seconds(absl::GetFlag(FLAGS_deadline_seconds));
  options.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_seconds));
  options.max_attempts = absl::GetFlag(FLAGS_retries);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.max_in_flight = absl::GetFlag(FLAGS_in_flight);
  options.channels = absl::GetFlag(FLAGS_channels);
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  const std::string certificate = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  if (absl::GetFlag(FLAGS_tls) || !ca.empty() || !certificate.empty() || !key.empty()) {
    ATTNGRAD_ASSIGN_OR_RETURN(options.credentials, TlsCredentialsFromFiles(ca, certificate, key));
    options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  }
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    ATTNGRAD_ASSIGN_OR_RETURN(options.token, ReadTokenFile(absl::GetFlag(FLAGS_token_file)));
  }
  options.client_id = absl::GetFlag(FLAGS_client_id);
  options.for_client = absl::GetFlag(FLAGS_for_client);
  return ShardedClient::Connect(absl::GetFlag(FLAGS_target), options);
}

absl::StatusOr<v1::GradientMode> ParseMode(const std::string& text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "return") return v1::GRADIENT_MODE_RETURN;
  if (t == "accumulate") return v1::GRADIENT_MODE_ACCUMULATE;
  return absl::InvalidArgumentError(
      absl::StrCat("--mode must be return or accumulate, got '", text, "'"));
}

absl::StatusOr<v1::Precision> ParsePrecision(const std::string& text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "auto" || t.empty()) return v1::PRECISION_AUTO;
  if (t == "fp32") return v1::PRECISION_FP32;
  if (t == "tf32") return v1::PRECISION_TF32;
  if (t == "fp16") return v1::PRECISION_FP16;
  return absl::InvalidArgumentError(
      absl::StrCat("--precision must be auto, fp32, tf32 or fp16, got '", text, "'"));
}

absl::StatusOr<v1::DType> ParseDType(const std::string& text) {
  if (text.empty()) return v1::DTYPE_FLOAT32;
  return wire::ParseDTypeName(text);
}

std::string ModeName(v1::GradientMode mode) {
  return mode == v1::GRADIENT_MODE_ACCUMULATE ? "accumulate" : "return";
}

int Fail(const std::string& command, const absl::Status& status) {
  std::cerr << "attngrad-cli " << command << ": " << absl::StatusCodeToString(status.code()) << ": "
            << status.message() << "\n";
  return 1;
}

std::string LocalWeightsSource() {
  const std::string file = absl::GetFlag(FLAGS_weights_file);
  if (!file.empty()) {
    return absl::StrCat("safetensors:", file, "#layer=", absl::GetFlag(FLAGS_weights_layer));
  }
  return absl::StrCat("random:seed=", absl::GetFlag(FLAGS_weights_seed));
}

absl::StatusOr<std::string> LayerTensorName(const wire::SafetensorsCheckpoint& checkpoint,
                                            Weight weight) {
  return wire::FindLayerTensorName(checkpoint.TensorNames(), absl::GetFlag(FLAGS_weights_layer),
                                   weight, checkpoint.path());
}

absl::StatusOr<WeightSet> LocalWeights(const LayerConfig& config) {
  const std::string path = absl::GetFlag(FLAGS_weights_file);
  if (path.empty()) return RandomWeights(config, absl::GetFlag(FLAGS_weights_seed));
  ATTNGRAD_ASSIGN_OR_RETURN(const wire::SafetensorsCheckpoint checkpoint,
                            wire::SafetensorsCheckpoint::Open(path));
  WeightSet weights;
  for (Weight weight : kAllWeights) {
    ATTNGRAD_ASSIGN_OR_RETURN(const std::string name, LayerTensorName(checkpoint, weight));
    ATTNGRAD_ASSIGN_OR_RETURN(const wire::SafetensorsEntry* entry, checkpoint.Find(name));
    if (entry->shape != WeightShape(config, weight)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", name, " has shape ", wire::ShapeString(entry->shape),
                       ", expected ", wire::ShapeString(WeightShape(config, weight))));
    }
    HostTensor& tensor = weights[weight];
    tensor.shape = entry->shape;
    ATTNGRAD_ASSIGN_OR_RETURN(tensor.data, checkpoint.ReadFloats(name));
  }
  return weights;
}

std::string TensorSummary(const HostTensor& tensor) {
  double sum_squares = 0, max_abs = 0, sum = 0;
  int64_t non_finite = 0;
  for (float v : tensor.data) {
    if (!std::isfinite(v)) {
      ++non_finite;
      continue;
    }
    sum_squares += double{v} * v;
    sum += v;
    max_abs = std::max(max_abs, std::fabs(double{v}));
  }
  const double n = tensor.data.empty() ? 1.0 : static_cast<double>(tensor.data.size());
  std::string text =
      absl::StrFormat("%-14s l2 %-11.5g max|x| %-11.5g mean % .4e", wire::ShapeString(tensor.shape),
                      std::sqrt(sum_squares), max_abs, sum / n);
  if (non_finite) absl::StrAppend(&text, "  NON-FINITE: ", non_finite);
  return text;
}

std::string FormatBytes(double bytes) {
  if (bytes >= 1e9) return absl::StrFormat("%.2f GB", bytes / 1e9);
  if (bytes >= 1e6) return absl::StrFormat("%.2f MB", bytes / 1e6);
  if (bytes >= 1e3) return absl::StrFormat("%.2f kB", bytes / 1e3);
  return absl::StrFormat("%.0f B", bytes);
}

}  // namespace attngrad::cli
