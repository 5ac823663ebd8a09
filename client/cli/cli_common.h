// attngrad-cli: the flags every subcommand shares, the connection made from them, and small parsing
// and printing helpers. Each subcommand is a function `int Run<Name>()` returning the exit status.
#ifndef ATTNGRAD_CLIENT_CLI_CLI_COMMON_H_
#define ATTNGRAD_CLIENT_CLI_CLI_COMMON_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "attngrad/client.h"
#include "attngrad/sharded_client.h"
#include "attngrad/wire/safetensors.h"
#include "random_tensors.h"

// Connection.
ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(bool, tls);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_server_name);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, client_id);
ABSL_DECLARE_FLAG(std::string, for_client);
ABSL_DECLARE_FLAG(double, deadline_seconds);
ABSL_DECLARE_FLAG(double, connect_timeout_seconds);
ABSL_DECLARE_FLAG(int, retries);
ABSL_DECLARE_FLAG(int64_t, max_message_bytes);
ABSL_DECLARE_FLAG(int64_t, chunk_bytes);
ABSL_DECLARE_FLAG(int, channels);
// Batches (backward, bench).
ABSL_DECLARE_FLAG(int64_t, batch);
ABSL_DECLARE_FLAG(int64_t, seq_len);
ABSL_DECLARE_FLAG(int64_t, count);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, mode);
ABSL_DECLARE_FLAG(std::string, precision);
ABSL_DECLARE_FLAG(std::string, response_dtype);
ABSL_DECLARE_FLAG(std::string, input_dtype);
ABSL_DECLARE_FLAG(std::string, rotary);
ABSL_DECLARE_FLAG(int, in_flight);
ABSL_DECLARE_FLAG(uint64_t, batch_id);
ABSL_DECLARE_FLAG(uint64_t, expected_weights_version);
ABSL_DECLARE_FLAG(int, layer);
ABSL_DECLARE_FLAG(std::string, layers);
ABSL_DECLARE_FLAG(uint64_t, window);
ABSL_DECLARE_FLAG(std::string, hidden_states);
ABSL_DECLARE_FLAG(std::string, grad_output);
ABSL_DECLARE_FLAG(std::string, cos);
ABSL_DECLARE_FLAG(std::string, sin);
ABSL_DECLARE_FLAG(std::string, output);
// Checking against the CPU reference.
ABSL_DECLARE_FLAG(bool, check);
ABSL_DECLARE_FLAG(std::string, check_weights);
ABSL_DECLARE_FLAG(uint64_t, weights_seed);
ABSL_DECLARE_FLAG(std::string, weights_file);
ABSL_DECLARE_FLAG(int, weights_layer);
ABSL_DECLARE_FLAG(bool, wire_fp32);
// bench.
ABSL_DECLARE_FLAG(int, streams);
ABSL_DECLARE_FLAG(double, duration_seconds);
ABSL_DECLARE_FLAG(int, warmup);
ABSL_DECLARE_FLAG(bool, progress);
// fetch, zero, health.
ABSL_DECLARE_FLAG(bool, zero_after);
ABSL_DECLARE_FLAG(std::string, service);

namespace attngrad::cli {

// Connects to --target (one server, or a layer map "0-12=host-a:50051,13-25=host-b:50051") with
// the connection flags. read_info: see ClientOptions::read_info_on_connect (health passes false).
absl::StatusOr<std::unique_ptr<ShardedClient>> ConnectFromFlags(bool read_info = true);

absl::StatusOr<v1::GradientMode> ParseMode(const std::string& text);
absl::StatusOr<v1::Precision> ParsePrecision(const std::string& text);
absl::StatusOr<v1::DType> ParseDType(const std::string& text);
std::string ModeName(v1::GradientMode mode);

// Prints `status` to stderr as "attngrad-cli <command>: CODE: message" and returns exit status 1.
int Fail(const std::string& command, const absl::Status& status);

// The six weights for --check or load-weights: from --weights_file (a safetensors file, a sharded
// checkpoint's index or a folder; layer --weights_layer, converted to fp32) or random from
// --weights_seed (the server's generator).
absl::StatusOr<WeightSet> LocalWeights(const LayerConfig& config);
// "random:seed=N" or "safetensors:PATH#layer=I", as the server names its weights source.
std::string LocalWeightsSource();
// The checkpoint's name of a weight of layer --weights_layer (Hugging Face names, possibly behind
// a prefix).
absl::StatusOr<std::string> LayerTensorName(const wire::SafetensorsCheckpoint& checkpoint,
                                            Weight weight);

// L2 norm, max |x| and mean of a tensor, for summaries.
std::string TensorSummary(const HostTensor& tensor);
std::string FormatBytes(double bytes);

int RunInfo();
int RunHealth();
int RunBackward();
int RunBench();
int RunFetch();
int RunZero();
int RunLoadWeights();
int RunMetrics();

}  // namespace attngrad::cli

#endif  // ATTNGRAD_CLIENT_CLI_CLI_COMMON_H_
