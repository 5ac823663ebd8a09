// attngrad-server: serves attngrad.v1.AttentionGradient (plus grpc.health.v1 and reflection) and
// Prometheus metrics. SIGTERM/SIGINT: stop accepting, let in-flight batches finish within
// --shutdown_grace_seconds, exit 0.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC listen address (host:port)");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "Prometheus /metrics listen address (host:port); empty = no metrics endpoint");
ABSL_FLAG(std::string, devices, "",
          "Devices to serve on: empty = every GPU (the CPU when there is none), \"cpu\" = the CPU "
          "backend, or CUDA device indices like \"0,1\"");
ABSL_FLAG(std::string, weights, "random",
          "\"random\" (SPEC section 3 distribution from --weights_seed) or a Gemma-3 .safetensors "
          "file (or a sharded checkpoint's model.safetensors.index.json)");
ABSL_FLAG(uint64_t, weights_seed, 0, "Seed of the random weights");
ABSL_FLAG(int, weights_layer, 0, "Decoder layer to load from --weights");
ABSL_FLAG(int64_t, max_batch_tokens, 65536,
          "Largest batch (B*S tokens) accepted; larger ones are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_message_bytes, 1073741824, "Largest gRPC message, received or sent");
ABSL_FLAG(int, max_concurrent_streams, 64,
          "Backward streams open at once (server-wide) and HTTP/2 streams per connection");
ABSL_FLAG(int, queue_depth, 4,
          "Batches one Backward stream may have in the server at once; also each GPU's pipeline "
          "depth (at least 3)");
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

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attngrad-server: gradients of a Gemma-3 attention layer over gRPC.\n"
      "  attngrad-server --listen=0.0.0.0:50051 --metrics_listen=0.0.0.0:9464 --devices=cpu");
  absl::ParseCommandLine(argc, argv);

  // The stop signals run OnStopSignal, which wakes main() below. Threads started before main()
  // (OpenBLAS starts its pool when the library loads) do not block them, so a SIGTERM may land on
  // one of those: with a handler installed that is harmless (with the default action, it killed the
  // process whenever main() was not yet waiting). The threads we start inherit a mask that blocks
  // them (no EINTR in gRPC's or the workers' threads); main() unblocks them once serving.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  // Blocking reads in main(), non-blocking writes in the handler.
  if (pipe2(stop_pipe, O_CLOEXEC) != 0 ||
      fcntl(stop_pipe[1], F_SETFL, fcntl(stop_pipe[1], F_GETFL) | O_NONBLOCK) != 0) {
    std::perror("attngrad-server: stop pipe");
    return 1;
  }
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  attngrad::server::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.devices = absl::GetFlag(FLAGS_devices);
  options.weights = absl::GetFlag(FLAGS_weights);
  options.weights_seed = absl::GetFlag(FLAGS_weights_seed);
  options.weights_layer = absl::GetFlag(FLAGS_weights_layer);
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  options.queue_depth = absl::GetFlag(FLAGS_queue_depth);
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.nccl = absl::GetFlag(FLAGS_nccl);
  const int grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  if (grace_seconds < 0) {
    std::cerr << "attngrad-server: --shutdown_grace_seconds must be >= 0\n";
    return 2;
  }

  absl::StatusOr<std::unique_ptr<attngrad::server::GradientServer>> server =
      attngrad::server::GradientServer::Start(options);
  if (!server.ok()) {
    std::cerr << "attngrad-server: " << server.status() << "\n";
    return 1;
  }
  // The "serving" line, which tools and tests wait for, comes last.
  std::cerr << "attngrad-server: " << (*server)->gradient_sum() << std::endl;
  std::cerr << "attngrad-server: serving on port " << (*server)->port()
            << ((*server)->metrics_port() != 0
                    ? absl::StrCat(", metrics on port ", (*server)->metrics_port())
                    : std::string(", metrics off"))
            << ", instance " << (*server)->instance_id() << std::endl;

  // Wait for a stop signal (one that came during start-up is already in the pipe).
  pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  unsigned char byte = 0;
  ssize_t n;
  while ((n = read(stop_pipe[0], &byte, 1)) < 0 && errno == EINTR) {
  }
  if (n != 1) std::perror("attngrad-server: read(stop pipe)");
  const int signal_number = byte;
  std::cerr << "attngrad-server: signal " << signal_number << ", shutting down (grace "
            << grace_seconds << " s)" << std::endl;
  (*server)->Shutdown(absl::Seconds(grace_seconds));
  server->reset();
  std::cerr << "attngrad-server: stopped" << std::endl;
  return 0;
}
