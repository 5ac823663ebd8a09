// attngrad_wire_ceiling: the transport's own number beside attngrad-cli bench's. A bare gRPC stream
// program that moves exactly the bytes attngrad moves for a batch shape (wire_shape.h) with
// attngrad-cli bench's streams, in-flight window, warm-up and count/duration (ceiling_client.h),
// over N separate connections, to a server that answers at once without computing
// (ceiling_server.h), over protobuf messages or grpc::ByteBuffer slices.
//
//   attngrad_wire_ceiling [flags]                 forks its own server on 127.0.0.1 and runs
//   attngrad_wire_ceiling --serve=0.0.0.0:50061   only the server (until SIGINT / SIGTERM)
//   attngrad_wire_ceiling --connect=HOST:50061    only the client, to a --serve server
//
// Prints one line (or a JSON object with --json): tokens/s, GB/s each way, round-trip p50/p99 per
// batch, and the CPU seconds per GB moved of the server process and of this client process.
// Exits 1 when a batch failed or none was answered.
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/common/status_macros.h"
#include "ceiling_client.h"
#include "ceiling_server.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, serve, "", "run only the server, listening on this address (host:port)");
ABSL_FLAG(std::string, connect, "",
          "run only the client, against a server started with --serve (host:port); without "
          "--serve or --connect the program forks its own server on 127.0.0.1");
ABSL_FLAG(std::string, transport, "protobuf",
          "protobuf: attngrad.v1 BackwardRequest/BackwardResponse messages (parsed and "
          "serialized, as attngrad does); bytebuffer: grpc::ByteBuffer slices, no user-space copy");
ABSL_FLAG(int, channels, 1, "separate TCP connections; streams are spread over them round-robin");
ABSL_FLAG(int, streams, 4, "concurrent Backward streams (as attngrad-cli bench)");
ABSL_FLAG(int, in_flight, 4, "batches in flight per stream (as attngrad-cli bench)");
ABSL_FLAG(int64_t, batch, 1, "B: sequences per batch");
ABSL_FLAG(int64_t, seq_len, 16, "S: tokens per sequence");
ABSL_FLAG(int64_t, count, 1, "batches per stream (0 = run for --duration_seconds)");
ABSL_FLAG(double, duration_seconds, 10, "how long to run when --count=0");
ABSL_FLAG(int, warmup, 1, "batches per stream answered one at a time before timing starts");
ABSL_FLAG(std::string, mode, "accumulate",
          "accumulate (the answer carries grad_hidden_states) | return (it also carries the six "
          "weight gradients)");
ABSL_FLAG(std::string, input_dtype, "float32",
          "wire dtype of hidden_states and grad_output: float32 | float16 | bfloat16");
ABSL_FLAG(std::string, response_dtype, "float32",
          "wire dtype of the answer's tensors: float32 | float16 | bfloat16");
ABSL_FLAG(std::string, rotary, "tables",
          "tables: fp32 cos/sin [B,S,head_dim] in every request (attngrad-cli's default); "
          "positions: S position ids");
ABSL_FLAG(int, hidden_size, 3072, "layer config (default: the SPEC layer)");
ABSL_FLAG(int, num_heads, 24, "layer config");
ABSL_FLAG(int, num_kv_heads, 8, "layer config");
ABSL_FLAG(int, head_dim, 128, "layer config");
ABSL_FLAG(bool, latency, false,
          "the latency target's setting: --mode=return --batch=1 --seq_len=128 --channels=1 "
          "--streams=1 --in_flight=1 (overriding those flags); give --count or --duration");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30,
          "gRPC message limit of client and server (attngrad's default)");
ABSL_FLAG(bool, json, false, "print the result as one JSON object instead of a line of text");

namespace attngrad::wire_ceiling {
namespace {

// SIGINT and SIGTERM blocked in the calling thread (and the threads it starts), for sigwait.
sigset_t BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// A server in a child process of this one (so that its CPU time is its own), on a free port of
// 127.0.0.1; stopped (SIGTERM) and reaped when this object goes.
class ForkedServer {
 public:
  // Must run before this process starts any gRPC thread.
  static absl::StatusOr<std::unique_ptr<ForkedServer>> Start(int64_t max_message_bytes) {
    int fds[2];
    if (pipe(fds) != 0) return absl::InternalError("pipe() failed");
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork() failed");
    if (pid == 0) {
      close(fds[0]);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);
      sigset_t signals = BlockStopSignals();
      auto server = CeilingServer::Start("127.0.0.1:0", max_message_bytes);
      const std::string port = server.ok() ? std::to_string((*server)->port()) : "0";
      if (write(fds[1], port.data(), port.size()) < 0 || !server.ok()) _exit(1);
      close(fds[1]);
      int signal = 0;
      sigwait(&signals, &signal);
      server->reset();
      _exit(0);
    }
    close(fds[1]);
    std::unique_ptr<ForkedServer> forked(new ForkedServer(pid));
    char text[16] = {};
    const ssize_t got = read(fds[0], text, sizeof(text) - 1);
    close(fds[0]);
    if (got <= 0 || !absl::SimpleAtoi(absl::string_view(text, got), &forked->port_) ||
        forked->port_ <= 0) {
      return absl::InternalError("the forked server did not start (see its error above)");
    }
    return forked;
  }
  ~ForkedServer() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  ForkedServer(const ForkedServer&) = delete;
  ForkedServer& operator=(const ForkedServer&) = delete;

  int port() const { return port_; }

 private:
  explicit ForkedServer(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  int port_ = 0;
};

absl::StatusOr<RunOptions> OptionsFromFlags() {
  RunOptions options;
  WireShape& shape = options.shape;
  const bool latency = absl::GetFlag(FLAGS_latency);
  const std::string mode = absl::AsciiStrToLower(latency ? "return" : absl::GetFlag(FLAGS_mode));
  if (mode == "accumulate") {
    shape.mode = v1::GRADIENT_MODE_ACCUMULATE;
  } else if (mode == "return") {
    shape.mode = v1::GRADIENT_MODE_RETURN;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--mode must be return or accumulate, got '", mode, "'"));
  }
  ATTNGRAD_ASSIGN_OR_RETURN(shape.input_dtype,
                            wire::ParseDTypeName(absl::GetFlag(FLAGS_input_dtype)));
  ATTNGRAD_ASSIGN_OR_RETURN(shape.response_dtype,
                            wire::ParseDTypeName(absl::GetFlag(FLAGS_response_dtype)));
  const std::string rotary = absl::GetFlag(FLAGS_rotary);
  if (rotary != "tables" && rotary != "positions") {
    return absl::InvalidArgumentError(
        absl::StrCat("--rotary must be tables or positions, got '", rotary, "'"));
  }
  shape.rotary = rotary == "tables" ? Rotary::kTables : Rotary::kPositions;
  shape.batch = latency ? 1 : absl::GetFlag(FLAGS_batch);
  shape.seq_len = latency ? 128 : absl::GetFlag(FLAGS_seq_len);
  shape.config.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  shape.config.num_heads = absl::GetFlag(FLAGS_num_heads);
  shape.config.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  shape.config.head_dim = absl::GetFlag(FLAGS_head_dim);
  ATTNGRAD_RETURN_IF_ERROR(shape.Validate());

  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "protobuf" && transport != "bytebuffer") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport must be protobuf or bytebuffer, got '", transport, "'"));
  }
  options.transport = transport == "protobuf" ? Transport::kProtobuf : Transport::kByteBuffer;
  options.channels = latency ? 1 : absl::GetFlag(FLAGS_channels);
  options.streams = latency ? 1 : absl::GetFlag(FLAGS_streams);
  options.in_flight = latency ? 1 : absl::GetFlag(FLAGS_in_flight);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.count = absl::GetFlag(FLAGS_count);
  options.duration = absl::Seconds(absl::GetFlag(FLAGS_duration_seconds));
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  return options;
}

void Print(const RunOptions& options, const RunResult& result) {
  const double seconds = std::max(result.seconds, 1e-9);
  const double moved_gb = (result.request_bytes + result.response_bytes) / 1e9;
  const char* transport = options.transport == Transport::kProtobuf ? "protobuf" : "bytebuffer";
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json json = {
        {"transport", transport},
        {"channels", options.channels},
        {"streams", options.streams},
        {"in_flight", options.in_flight},
        {"batch", options.shape.batch},
        {"seq_len", options.shape.seq_len},
        {"mode", options.shape.mode == v1::GRADIENT_MODE_ACCUMULATE ? "accumulate" : "return"},
        {"input_dtype", wire::DTypeName(options.shape.input_dtype)},
        {"response_dtype", wire::DTypeName(options.shape.response_dtype)},
        {"rotary", options.shape.rotary == Rotary::kTables ? "tables" : "positions"},
        {"hidden_size", options.shape.config.hidden_size},
        {"num_heads", options.shape.config.num_heads},
        {"num_kv_heads", options.shape.config.num_kv_heads},
        {"head_dim", options.shape.config.head_dim},
        {"batches", result.batches},
        {"tokens", result.tokens},
        {"seconds", result.seconds},
        {"tokens_per_second", result.tokens / seconds},
        {"request_bytes", result.request_bytes},
        {"response_bytes", result.response_bytes},
        {"request_bytes_per_batch", result.request_bytes_per_batch},
        {"response_bytes_per_batch", result.response_bytes_per_batch},
        {"request_gb_per_second", result.request_bytes / 1e9 / seconds},
        {"response_gb_per_second", result.response_bytes / 1e9 / seconds},
        {"gb_per_second", moved_gb / seconds},
        {"p50_seconds", result.p50_seconds},
        {"p90_seconds", result.p90_seconds},
        {"p99_seconds", result.p99_seconds},
        {"max_seconds", result.max_seconds},
        {"server_cpu_seconds", result.server.cpu_seconds},
        {"server_received_bytes", result.server.received_bytes},
        {"server_sent_bytes", result.server.sent_bytes},
        {"server_batches", result.server.batches},
        {"server_cpu_seconds_per_gb", result.server.cpu_seconds / std::max(moved_gb, 1e-12)},
        {"client_cpu_seconds", result.client_cpu_seconds},
        {"client_cpu_seconds_per_gb", result.client_cpu_seconds / std::max(moved_gb, 1e-12)},
        {"errors", result.errors},
        {"first_error", result.first_error},
    };
    std::cout << json.dump() << "\n";
    return;
  }
  std::cout << absl::StrFormat(
      "wire_ceiling %s, %d channels, %d streams x %d in flight, %s: %d batches in %.2f s, "
      "%.0f tokens/s, %.3f GB/s up (%d B/batch), %.3f GB/s down (%d B/batch), %.3f GB/s both "
      "ways, round trip p50 "
      "%.4f s p99 %.4f s, server %.3f CPU s/GB, client %.3f CPU s/GB, errors %d%s\n",
      transport, options.channels, options.streams, options.in_flight, options.shape.Describe(),
      result.batches, result.seconds, result.tokens / seconds, result.request_bytes / 1e9 / seconds,
      result.request_bytes_per_batch, result.response_bytes / 1e9 / seconds,
      result.response_bytes_per_batch, moved_gb / seconds, result.p50_seconds, result.p99_seconds,
      result.server.cpu_seconds / std::max(moved_gb, 1e-12),
      result.client_cpu_seconds / std::max(moved_gb, 1e-12), result.errors,
      result.first_error.empty() ? "" : absl::StrCat(" (first: ", result.first_error, ")"));
}

int Main() {
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  const std::string serve = absl::GetFlag(FLAGS_serve);
  if (!serve.empty()) {
    // The shape flags give the answer to attngrad's own client (attngrad-cli bench against this
    // server), whose streams do not name their shape.
    absl::StatusOr<RunOptions> options = OptionsFromFlags();
    if (!options.ok()) {
      std::cerr << "attngrad_wire_ceiling: " << options.status() << "\n";
      return 2;
    }
    sigset_t signals = BlockStopSignals();
    auto server = CeilingServer::Start(serve, max_message_bytes, options->shape);
    if (!server.ok()) {
      std::cerr << "attngrad_wire_ceiling: " << server.status() << "\n";
      return 2;
    }
    std::cerr << "attngrad_wire_ceiling: serving on port " << (*server)->port()
              << " (SIGINT or SIGTERM stops)\n";
    int signal = 0;
    sigwait(&signals, &signal);
    return 0;
  }
  absl::StatusOr<RunOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::cerr << "attngrad_wire_ceiling: " << options.status() << "\n";
    return 2;
  }
  std::unique_ptr<ForkedServer> forked;
  options->target = absl::GetFlag(FLAGS_connect);
  if (options->target.empty()) {
    auto started = ForkedServer::Start(max_message_bytes);
    if (!started.ok()) {
      std::cerr << "attngrad_wire_ceiling: " << started.status() << "\n";
      return 2;
    }
    forked = std::move(*started);
    options->target = absl::StrCat("127.0.0.1:", forked->port());
  }
  absl::StatusOr<RunResult> result = RunClient(*options);
  if (!result.ok()) {
    std::cerr << "attngrad_wire_ceiling: " << result.status() << "\n";
    return 1;
  }
  Print(*options, *result);
  return result->errors == 0 && result->batches > 0 ? 0 : 1;
}

}  // namespace
}  // namespace attngrad::wire_ceiling

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the wire ceiling of attngrad: moves the bytes attngrad moves, over a bare gRPC stream");
  absl::ParseCommandLine(argc, argv);
  return attngrad::wire_ceiling::Main();
}
