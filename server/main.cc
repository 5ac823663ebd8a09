// attngrad-server: serves attngrad.v1.AttentionGradient (plus grpc.health.v1 and reflection) and
// Prometheus metrics. Stopping: the first SIGTERM/SIGINT starts one grace period
// (--shutdown_grace_seconds) in which running RPCs may finish; a repeated SIGTERM changes nothing;
// a SIGINT after the first signal (a second Ctrl-C) exits at once with 130. The exit comes within
// the grace period plus 0.3 s in every case: if gRPC's shutdown or the workers' drain is
// still running then, the process ends with _exit (code 0, the stop having been asked for).
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/strings/strip.h"
#include "rpc/tls.h"
#include "server.h"

#ifndef ATTNGRAD_VERSION
#define ATTNGRAD_VERSION "unknown"
#endif
#ifndef ATTNGRAD_BUILD_TYPE
#define ATTNGRAD_BUILD_TYPE "unknown"
#endif
#ifndef ATTNGRAD_SOURCE_DIR
#define ATTNGRAD_SOURCE_DIR ""
#endif

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC listen address (host:port)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics listen address (host:port; plaintext HTTP without authentication: "
          "loopback by default, a private interface otherwise); empty = no metrics endpoint");
ABSL_FLAG(std::string, devices, "",
          "Devices to serve on: empty = every GPU (the CPU when there is none), \"cpu\" = the CPU "
          "backend, or CUDA device indices like \"0,1\"");
ABSL_FLAG(std::string, weights, "random",
          "\"random\" (SPEC section 3 distribution from --weights_seed: with --model every layer "
          "of that model, else one SPEC layer as layer 0), a Hugging Face model directory "
          "(config.json + model.safetensors or shards with model.safetensors.index.json: every "
          "layer resident), or a Gemma-3 .safetensors file / model.safetensors.index.json (one "
          "layer, --weights_layer)");
ABSL_FLAG(std::string, model, "",
          "With --weights=random: spec, gemma-3-270m, gemma-3-1b, gemma-3-4b, gemma-3-12b or "
          "gemma-3-27b (random weights of every layer of that model)");
ABSL_FLAG(std::string, layers, "",
          "A range of the model's decoder layers to hold, \"A-B\" (inclusive) or \"A\"; empty = "
          "every layer (a 27B model's attention weights are ~16 GB in fp32)");
ABSL_FLAG(uint64_t, weights_seed, 0, "Seed of the random weights (layer i of a model: seed + i)");
ABSL_FLAG(int, weights_layer, 0, "Decoder layer to load from a .safetensors file or index");
ABSL_FLAG(int64_t, max_batch_tokens, 65536,
          "Largest batch (B*S tokens) accepted; larger ones are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_message_bytes, 1073741824, "Largest gRPC message, received or sent");
ABSL_FLAG(int, max_concurrent_streams, 64,
          "Backward streams open at once (server-wide) and HTTP/2 streams per connection");
ABSL_FLAG(int, max_streams_per_client, 16,
          "Backward streams one client (one token, or one attngrad-client-id when authentication "
          "is off) may have open at once");
ABSL_FLAG(int, stream_idle_timeout_seconds, 300,
          "A streaming call (Backward, LoadWeights, FetchGradients) that reads no message and "
          "completes no write for this long, with no batch computing, is ended "
          "(DEADLINE_EXCEEDED); 0 = never");
ABSL_FLAG(int, connection_idle_timeout_seconds, 120,
          "A connection with no call for this long is closed (GOAWAY; gRPC clients reconnect when "
          "they next call), so idle connections that never call cannot pile up; 0 = never");
ABSL_FLAG(int, max_clients_with_sums, 4,
          "Clients whose accumulation windows may hold ACCUMULATE sums at once (each holds one "
          "set of fp32 weight-gradient accumulators per device, allocated when first used)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the gRPC port (TLS); empty = plaintext. Reloaded when the "
          "file changes");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: mutual TLS, every client must present a certificate signed by it");
ABSL_FLAG(int, tls_reload_interval_seconds, 10,
          "How often the TLS files are checked for changes (a change is picked up without a "
          "restart)");
ABSL_FLAG(std::string, tokens_file, "",
          "File of bearer tokens, one \"token role [client_id]\" per line (role trainer or admin); "
          "empty = authentication OFF: then only clients on this host are served, unless "
          "--allow_unauthenticated");
ABSL_FLAG(bool, allow_unauthenticated, false,
          "Without --tokens_file, serve clients of every host (authentication OFF: any client that "
          "reaches the port may do anything); by default such a server serves only clients on "
          "its own host (loopback and Unix sockets). No effect with --tokens_file");
ABSL_FLAG(
    std::string, region_socket, "",
    "Unix socket on which clients of this host pass sealed memfds to register shared-memory "
    "regions (mode 0600; only the server's user and root may register); empty = "
    "$XDG_RUNTIME_DIR/attngrad/regions-<port>.sock, or /tmp/attngrad-<uid>/regions-<port>.sock "
    "without XDG_RUNTIME_DIR; \"off\" = no shared-memory regions");
ABSL_FLAG(std::int64_t, max_inflight_bytes, std::int64_t{4} << 30,
          "host memory for data in flight, server-wide: received batches, answers not yet sent, "
          "LoadWeights staging, FetchGradients results; beyond it new batches and streams get "
          "RESOURCE_EXHAUSTED (one request larger than this is served when nothing else is in "
          "flight); 0 = no limit");
ABSL_FLAG(double, max_inflight_share_per_client, 0.5,
          "The fraction of --max_inflight_bytes that one client (one token, or one "
          "attngrad-client-id when authentication is off) may hold at once, in (0, 1]; beyond it "
          "that client's batches and streams get RESOURCE_EXHAUSTED while others are served; "
          "1 = no per-client limit");
ABSL_FLAG(int, stream_order_timeout_seconds, 60,
          "A batch ordered by its client's CUDA stream (BackwardRequest.stream_order) fails with "
          "DEADLINE_EXCEEDED when that stream has not reached it this many seconds after it "
          "arrived");
ABSL_FLAG(int, queue_depth, 4,
          "Batches one Backward stream may have in the server at once; also each GPU's pipeline "
          "depth (at least 3)");
ABSL_FLAG(bool, stage_on_arrival, true,
          "GPU servers: copy each batch's activations into page-locked memory on the thread that "
          "received them (the copies of several streams at once) instead of on the GPU worker's "
          "copy threads");
ABSL_FLAG(int, shutdown_grace_seconds, 30,
          "On SIGTERM/SIGINT: how long running RPCs may take to finish before they are cancelled");
ABSL_FLAG(int, cpu_threads, 0, "Threads of the CPU backend (0 = all cores)");
ABSL_FLAG(std::string, nccl, "auto",
          "How fetches sum the accumulators of several GPUs: \"auto\" = with NCCL (libnccl.so.2, "
          "loaded at run time) when it loads, else on the host; \"on\" = with two or more GPUs, "
          "NCCL or do not start; "
          "\"off\" = on the host");

namespace {

// The stop signals reach main() through this pipe (write() is async-signal-safe).
int stop_pipe[2] = {-1, -1};

extern "C" void OnStopSignal(int signal_number) {
  const unsigned char byte = static_cast<unsigned char>(signal_number);
  const int saved_errno = errno;
  [[maybe_unused]] const ssize_t written = write(stop_pipe[1], &byte, 1);  // full: one is pending
  errno = saved_errno;
}

// Writes one byte (a signal number, or 0 from the shutdown thread when it is done) to the pipe.
void WriteStopPipe(unsigned char byte) {
  [[maybe_unused]] const ssize_t written = write(stop_pipe[1], &byte, 1);
}

constexpr int kTimedOut = -1;
// After the grace period, how long the shutdown may still take before the process _exit()s.
constexpr std::chrono::milliseconds kExitMargin(300);

// The next byte of the pipe: a signal number, 0 (the shutdown is done), or kTimedOut after
// `timeout_ms` (-1: no limit).
int ReadStopPipe(long long timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int wait_ms = -1;
    if (timeout_ms >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return kTimedOut;
      wait_ms = static_cast<int>(std::min<long long>(left.count() + 1, 1 << 30));
    }
    pollfd readable{stop_pipe[0], POLLIN, 0};
    const int ready = poll(&readable, 1, wait_ms);
    if (ready < 0 && errno != EINTR) {
      std::perror("attngrad-server: poll(stop pipe)");
      return kTimedOut;
    }
    if (ready <= 0) continue;
    unsigned char byte = 0;
    const ssize_t n = read(stop_pipe[0], &byte, 1);
    if (n == 1) return byte;
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    std::perror("attngrad-server: read(stop pipe)");
    return kTimedOut;
  }
}

// --help names each flag's source file: relative to the source tree (absl's default shows the
// build machine's absolute path), and other libraries' files from their own top directory.
std::string SourcePathForHelp(absl::string_view path) {
  const absl::string_view source_directory = ATTNGRAD_SOURCE_DIR "/";
  if (absl::ConsumePrefix(&path, source_directory)) return std::string(path);
  const std::size_t library = path.rfind("/absl/");
  if (library != absl::string_view::npos) return std::string(path.substr(library + 1));
  const std::size_t slash = path.rfind('/');
  return std::string(slash == absl::string_view::npos ? path : path.substr(slash + 1));
}

// --version: the version and how this binary was built (absl's default says "Debug build"
// whenever absl itself was built without NDEBUG, whatever this build is).
std::string VersionText() {
#ifdef NDEBUG
  constexpr char kAssertions[] = "assertions off (NDEBUG)";
#else
  constexpr char kAssertions[] = "assertions on (no NDEBUG)";
#endif
  return absl::StrCat("attngrad-server ", ATTNGRAD_VERSION, "\n", ATTNGRAD_BUILD_TYPE, " build, ",
                      kAssertions, "\n");
}

// The usage message, --help's and --version's texts, then the flags parsed.
void ParseFlags(int argc, char** argv) {
  // absl prints "<program>: " before this message: it starts with what the program does.
  absl::SetProgramUsageMessage(
      "gradients of a Gemma-3 attention layer over gRPC.\n"
      "  attngrad-server --listen=0.0.0.0:50051 --metrics_listen=127.0.0.1:9464 --devices=cpu \\\n"
      "      --tls_cert=server.pem --tls_key=server.key [--tls_client_ca=clients-ca.pem] \\\n"
      "      --tokens_file=tokens.txt");
  // --help and --helpshort list the flags defined in this file (absl's default looks for a file
  // named after the program, attngrad-server.cc, and found none: "No flags matched").
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::EndsWith(path, "server/main.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  usage_config.normalize_filename = SourcePathForHelp;
  usage_config.version_string = VersionText;
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);
}

// Routes SIGTERM and SIGINT to the stop pipe and blocks them in this thread (so in every thread it
// starts); false (with the error printed) when the pipe cannot be made.
//
// The stop signals run OnStopSignal, which wakes main(). Threads started before main() (OpenBLAS
// starts its pool when the library loads) do not block them, so a SIGTERM may land on one of
// those: with a handler installed that is harmless (with the default action, it killed the process
// whenever main() was not yet waiting). The threads we start inherit a mask that blocks them (no
// EINTR in gRPC's or the workers' threads); main() unblocks them once serving.
bool InstallStopSignals(sigset_t* stop_signals) {
  sigemptyset(stop_signals);
  sigaddset(stop_signals, SIGTERM);
  sigaddset(stop_signals, SIGINT);
  // Reads in main() (after poll), non-blocking writes in the handler and the shutdown thread.
  if (pipe2(stop_pipe, O_CLOEXEC) != 0 ||
      fcntl(stop_pipe[1], F_SETFL, fcntl(stop_pipe[1], F_GETFL) | O_NONBLOCK) != 0) {
    std::perror("attngrad-server: stop pipe");
    return false;
  }
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  // SIGHUP (a closed terminal, or an operator expecting a reload) does not end the server: the TLS
  // files are reloaded when they change, without a signal.
  signal(SIGHUP, SIG_IGN);
  pthread_sigmask(SIG_BLOCK, stop_signals, nullptr);
  return true;
}

attngrad::server::ServerOptions OptionsFromFlags() {
  attngrad::server::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.devices = absl::GetFlag(FLAGS_devices);
  options.weights = absl::GetFlag(FLAGS_weights);
  options.model = absl::GetFlag(FLAGS_model);
  options.layers = absl::GetFlag(FLAGS_layers);
  options.weights_seed = absl::GetFlag(FLAGS_weights_seed);
  options.weights_layer = absl::GetFlag(FLAGS_weights_layer);
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  options.queue_depth = absl::GetFlag(FLAGS_queue_depth);
  options.stage_on_arrival = absl::GetFlag(FLAGS_stage_on_arrival);
  options.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  options.max_inflight_share_per_client = absl::GetFlag(FLAGS_max_inflight_share_per_client);
  options.stream_order_timeout_seconds = absl::GetFlag(FLAGS_stream_order_timeout_seconds);
  options.max_streams_per_client = absl::GetFlag(FLAGS_max_streams_per_client);
  options.stream_idle_timeout_seconds = absl::GetFlag(FLAGS_stream_idle_timeout_seconds);
  options.max_clients_with_sums = absl::GetFlag(FLAGS_max_clients_with_sums);
  options.connection_idle_timeout_seconds = absl::GetFlag(FLAGS_connection_idle_timeout_seconds);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.tls_reload_interval_seconds = absl::GetFlag(FLAGS_tls_reload_interval_seconds);
  options.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  options.allow_unauthenticated = absl::GetFlag(FLAGS_allow_unauthenticated);
  options.region_socket = absl::GetFlag(FLAGS_region_socket);
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.nccl = absl::GetFlag(FLAGS_nccl);
  return options;
}

// The start-up log; the "serving" line, which tools and tests wait for, comes last.
void LogServing(const attngrad::server::GradientServer& server) {
  std::cerr << "attngrad-server: " << server.model_summary() << std::endl;
  std::cerr << "attngrad-server: " << server.gradient_sum() << std::endl;
  for (const std::string& line : server.security_summary()) {
    std::cerr << "attngrad-server: " << line << std::endl;
  }
  std::cerr << "attngrad-server: serving on port " << server.port()
            << (server.metrics_port() != 0
                    ? absl::StrCat(", metrics on port ", server.metrics_port())
                    : std::string(", metrics off"))
            << ", instance " << server.instance_id() << std::endl;
}

// Waits for a stop signal (one that came during start-up is already in the pipe), then shuts the
// server down within the grace period; the process's exit code (or it _exit()s on a hard stop).
//
// The shutdown runs on its own thread; this one keeps reading the pipe (a later signal, or the
// shutdown thread's 0 byte when it is done) until the hard deadline. The shutdown thread starts
// with the stop signals blocked, like every thread but this one.
int ServeUntilStopped(std::unique_ptr<attngrad::server::GradientServer> server,
                      const sigset_t& stop_signals, int grace_seconds) {
  pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  const int first_signal = ReadStopPipe(-1);
  const auto hard_deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(grace_seconds) + kExitMargin;
  std::cerr << "attngrad-server: signal " << first_signal << ", shutting down (grace "
            << grace_seconds << " s; SIGINT to stop at once)" << std::endl;

  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::thread shutdown_thread([&server, grace_seconds] {
    server->Shutdown(absl::Seconds(grace_seconds));
    server.reset();
    WriteStopPipe(0);
  });
  pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        hard_deadline - std::chrono::steady_clock::now());
    const int next = ReadStopPipe(std::max<long long>(0, left.count()));
    if (next == 0) break;  // the shutdown finished
    if (next == kTimedOut) {
      std::cerr
          << "attngrad-server: shutdown still running " << kExitMargin.count()
          << " ms after the grace period (gRPC's shutdown or a batch that is still computing); "
             "exiting now"
          << std::endl;
      attngrad::server::RemoveTlsStagingDirectories();  // no destructor runs after _exit
      _exit(0);
    }
    if (next == SIGINT) {
      std::cerr << "attngrad-server: SIGINT during the shutdown: exiting now" << std::endl;
      attngrad::server::RemoveTlsStagingDirectories();
      _exit(128 + SIGINT);
    }
    std::cerr << "attngrad-server: signal " << next << " again: still shutting down (the grace "
              << "period is not restarted; SIGINT stops at once)" << std::endl;
  }
  shutdown_thread.join();
  std::cerr << "attngrad-server: stopped" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ParseFlags(argc, argv);
  sigset_t stop_signals;
  if (!InstallStopSignals(&stop_signals)) return 1;
  const attngrad::server::ServerOptions options = OptionsFromFlags();
  const int grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  if (grace_seconds < 0) {
    std::cerr << "attngrad-server: --shutdown_grace_seconds must be >= 0\n";
    return 2;
  }

  std::cerr << "attngrad-server: " << attngrad::server::RaiseOpenFileLimit() << std::endl;
  absl::StatusOr<std::unique_ptr<attngrad::server::GradientServer>> server =
      attngrad::server::GradientServer::Start(options);
  if (!server.ok()) {
    std::cerr << "attngrad-server: " << server.status() << "\n";
    return 1;
  }
  LogServing(**server);
  return ServeUntilStopped(*std::move(server), stop_signals, grace_seconds);
}
