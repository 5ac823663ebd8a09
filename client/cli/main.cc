// attngrad-cli: command-line client of the attngrad gradient service.
//   attngrad-cli <info|health|backward|bench|fetch|zero|load-weights> [--flags]
// (`attngrad-cli --help` lists every flag).
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "cli_common.h"

namespace {

constexpr char kUsage[] = R"(attngrad-cli <subcommand> [--flags]

Subcommands (all take --target=HOST:PORT, default 127.0.0.1:50051; TLS with --tls_ca=CA.pem,
mutual TLS adding --tls_cert=CERT.pem --tls_key=KEY.pem, a bearer token with --token_file=PATH,
a client id on servers without authentication with --client_id=NAME):
  info          the server's layer configuration, weights version and source, devices, limits
  health        grpc.health.v1 check (--service=NAME); exit 0 only when SERVING
  backward      send --count batches of --batch x --seq_len tokens (random from --seed, SPEC
                section 3, or --hidden_states/--grad_output[/--cos/--sin] .npy files), --mode
                return|accumulate; --check compares each answer with the local CPU reference
                (SPEC section 4) using weights it uploads first (--check_weights=upload, the
                default: random from --weights_seed or --weights_file) or that the server already
                holds (--check_weights=server); --output=DIR writes the results as .npy
  bench         --streams concurrent streams, --in_flight batches each, for --count batches per
                stream or --duration_seconds; prints tokens/s, GB/s, latency p50/p90/p99
  fetch         the accumulated gradients (--zero_after to start a new window); --output writes
                them (.safetensors file, or a directory of .npy)
  zero          zero the accumulators (--window=ID to expect a window)
  load-weights  upload --weights_file (layer --weights_layer) or random --weights_seed weights
  metrics       summary of the server's Prometheus metrics (--metrics_target, default
                127.0.0.1:9464): counters and gauges, histogram counts and means
)";

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() != 2) {
    std::cerr << kUsage << "\n"
              << (positional.size() < 2 ? "missing subcommand" : "too many arguments")
              << " (try --help)\n";
    return 2;
  }
  const std::string command = positional[1];
  using namespace attngrad::cli;
  if (command == "info") return RunInfo();
  if (command == "health") return RunHealth();
  if (command == "backward") return RunBackward();
  if (command == "bench") return RunBench();
  if (command == "fetch") return RunFetch();
  if (command == "zero") return RunZero();
  if (command == "load-weights") return RunLoadWeights();
  if (command == "metrics") return RunMetrics();
  std::cerr << kUsage << "\nunknown subcommand '" << command << "'\n";
  return 2;
}
