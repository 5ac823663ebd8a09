// Everything the server is started with (main.cc fills it from the command-line flags; tests fill
// it directly). Defaults match the flags' defaults.
#ifndef ATTNGRAD_SERVER_SERVER_OPTIONS_H_
#define ATTNGRAD_SERVER_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

namespace attngrad::server {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";           // gRPC address (port 0: any free port)
  std::string metrics_listen = "127.0.0.1:9464";  // Prometheus /metrics (plaintext); empty = off
  std::string devices;                            // "" = all GPUs, else CPU; "cpu"; "0,1"
  // "random", a Hugging Face model directory (config.json + safetensors: every layer), or a
  // .safetensors / index .json path (one layer, --weights_layer).
  std::string weights = "random";
  std::string model;   // with weights "random": a name of proto/models/gemma3.json; "" = one layer
  std::string layers;  // "A-B" or "A": a range of the model's layers; "" = all
  std::uint64_t weights_seed = 0;  // layer i of a model: seed + i
  int weights_layer = 0;
  std::int64_t max_batch_tokens = 65536;
  std::int64_t max_message_bytes = 1073741824;
  int max_concurrent_streams = 64;
  int max_streams_per_client = 16;  // Backward streams of one client id at once
  // A streaming call (Backward, LoadWeights, FetchGradients) without progress ends; 0 = never.
  int stream_idle_timeout_seconds = 300;
  // A connection with no call for this long is closed (GOAWAY; clients reconnect when they next
  // call); 0 = never.
  int connection_idle_timeout_seconds = 120;
  int max_clients_with_sums = 4;  // client windows holding ACCUMULATE sums at once
  // Security (server/README.md, "Security model").
  std::string tls_cert;       // PEM certificate chain of the gRPC port; empty = plaintext
  std::string tls_key;        // its PEM private key
  std::string tls_client_ca;  // PEM CA bundle: mutual TLS (client certificates required)
  int tls_reload_interval_seconds = 10;  // how often the TLS files are checked for changes
  std::string tokens_file;  // "token role [client_id]" lines; empty = authentication off
  // Without tokens_file: serve clients of other hosts too (else only this host's: protected mode).
  bool allow_unauthenticated = false;
  // Unix socket for shared-memory regions (rpc/region_socket.h): "" = the default path of the
  // gRPC port (wire::DefaultRegionSocketPath), "off" = none.
  std::string region_socket;
  int queue_depth = 4;  // batches per stream in flight; GPU pipeline depth (at least 3)
  // GPU servers: activations staged into page-locked memory by the receiving thread.
  bool stage_on_arrival = true;
  // Host memory for data in flight, server-wide (MemoryBudget); 0 = no limit.
  std::int64_t max_inflight_bytes = std::int64_t{4} << 30;
  // The fraction of max_inflight_bytes one client id may hold at once, in (0, 1]; 1 = no
  // per-client limit.
  double max_inflight_share_per_client = 0.5;
  // A stream-ordered batch waits this long at most for its client's stream to reach it.
  int stream_order_timeout_seconds = 60;
  int cpu_threads = 0;  // CPU backend threads (0 = all cores)
  std::string nccl =
      "auto";  // cross-GPU sums: "auto" (NCCL when usable), "on" (NCCL or fail), "off"
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_SERVER_OPTIONS_H_
