// Server assembly: weights, workers, service, gRPC builder, health, reflection, the /metrics
// endpoint.
#include "server.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "attngrad/common/status_macros.h"
#include "devices/cpu_worker.h"
#include "devices/gpu_worker.h"
#include "metrics/metrics.h"
#include "metrics/metrics_http_server.h"
#include "rpc/auth.h"
#include "rpc/gradient_service.h"
#include "rpc/region_socket_listener.h"
#include "rpc/rpc_metrics_interceptor.h"
#include "rpc/tls.h"
#include "scheduling/gradient_core.h"
#include "weights/checkpoint_layer.h"

#ifndef ATTNGRAD_VERSION
#define ATTNGRAD_VERSION "unknown"
#endif

namespace attngrad::server {
namespace {

absl::Status WithFlag(const char* flag, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(flag, ": ", status.message()));
}

TlsFiles TlsFilesOf(const ServerOptions& options) {
  TlsFiles files;
  files.certificate = options.tls_cert;
  files.private_key = options.tls_key;
  files.client_ca = options.tls_client_ca;
  files.reload_interval_seconds = options.tls_reload_interval_seconds;
  return files;
}

// A TLS reload is logged and counted (attngrad_tls_reloads_total{result}).
TlsReloadObserver LogAndCountTlsReloads(ServerMetrics* metrics) {
  return [metrics](bool applied, const std::string& message) {
    metrics->CountTlsReload(applied);
    std::cerr << "attngrad-server: " << (applied ? "" : "ERROR: ") << message << std::endl;
  };
}

}  // namespace

namespace {

// Connections cost a descriptor each, with or without a call: one that stays without a call is
// closed, and one that does not finish its TLS handshake is dropped sooner than gRPC's 120 s.
void AddConnectionLimits(const ServerOptions& options, grpc::ServerBuilder& builder) {
  constexpr int kHandshakeTimeoutMs = 20'000;
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeTimeoutMs);
  if (options.connection_idle_timeout_seconds > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               static_cast<int>(std::min<long long>(
                                   INT_MAX, options.connection_idle_timeout_seconds * 1000LL)));
  }
}

}  // namespace

std::string RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::StrCat("open files: cannot read the limit (", std::strerror(errno), ")");
  }
  auto text = [](rlim_t value) {
    return value == RLIM_INFINITY ? std::string("unlimited") : absl::StrCat(value);
  };
  if (limit.rlim_cur == limit.rlim_max) {
    return absl::StrCat("open files: limit ", text(limit.rlim_cur), " (soft = hard)");
  }
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::StrCat("WARNING: open files: cannot raise the soft limit ", text(before),
                        " to the hard limit ", text(limit.rlim_max), " (", std::strerror(errno),
                        "): connections beyond it are refused");
  }
  return absl::StrCat("open files: soft limit raised from ", text(before), " to the hard limit ",
                      text(limit.rlim_max));
}

absl::StatusOr<ServedModel> LoadServedModel(const ServerOptions& options) {
  std::error_code error;
  const bool model_directory =
      options.weights != "random" && std::filesystem::is_directory(options.weights, error) &&
      std::filesystem::exists(std::filesystem::path(options.weights) / "config.json", error);
  if (!options.model.empty() && options.weights != "random") {
    return absl::InvalidArgumentError(
        "--model: only with --weights=random (a checkpoint directory's config.json names its "
        "model)");
  }
  if (options.weights == "random" && !options.model.empty()) {
    absl::StatusOr<ServedModel> model =
        RandomModel(options.model, options.weights_seed, options.layers);
    if (!model.ok()) return WithFlag("--weights=random", model.status());
    return model;
  }
  if (model_directory) {
    absl::StatusOr<ServedModel> model = LoadModelDirectory(options.weights, options.layers);
    if (!model.ok()) return WithFlag("--weights", model.status());
    return model;
  }
  // The seed's single layer.
  if (!options.layers.empty()) {
    return absl::InvalidArgumentError(
        "--layers: only with a model (--weights=DIR holding config.json, or --weights=random "
        "--model=NAME); a single layer is chosen with --weights_layer");
  }
  if (options.weights == "random") {
    return SingleLayerModel(RandomLayerWeights(LayerConfig::Gemma3_4B(), options.weights_seed), 0);
  }
  absl::StatusOr<LayerWeights> weights =
      LoadSafetensorsLayer(options.weights, options.weights_layer);
  if (!weights.ok()) return WithFlag("--weights", weights.status());
  return SingleLayerModel(*std::move(weights), options.weights_layer);
}

std::string ModelSummary(const ServedModel& model) {
  std::size_t elements = 0;
  for (const ServedLayer& layer : model.layers) {
    for (const std::vector<float>& values : layer.weights->values) elements += values.size();
  }
  const int first = model.layers.front().settings.index;
  const int last = model.layers.back().settings.index;
  return absl::StrCat(
      "weights: ", model.name.empty() ? std::string("one layer") : model.name, ", layer",
      first == last ? absl::StrCat(" ", first) : absl::StrCat("s ", first, "-", last), " of ",
      model.num_hidden_layers, " (", model.layers.size(), " resident, ",
      absl::StrFormat("%.2f", static_cast<double>(elements) * 4 / (1 << 30)), " GiB fp32; ",
      model.layers.front().weights->source, model.layers.size() > 1 ? ", ..." : "", ")");
}

absl::StatusOr<DeviceSelection> ParseDevices(const std::string& devices, int gpu_count) {
  DeviceSelection selection;
  if (devices.empty()) {
    if (gpu_count == 0) {
      selection.cpu = true;
    } else {
      for (int i = 0; i < gpu_count; ++i) selection.gpus.push_back(i);
    }
    return selection;
  }
  if (devices == "cpu") {
    selection.cpu = true;
    return selection;
  }
  for (absl::string_view part : absl::StrSplit(devices, ',')) {
    int index;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &index) || index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: '", part,
                       "' is not a device index; expected \"\" (all GPUs, or the CPU "
                       "when there is none), \"cpu\" or a list like \"0,1\""));
    }
    if (index >= gpu_count) {
      return absl::InvalidArgumentError(absl::StrCat("--devices: CUDA device ", index,
                                                     " does not exist (", gpu_count,
                                                     " usable by this build)"));
    }
    if (std::find(selection.gpus.begin(), selection.gpus.end(), index) != selection.gpus.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: device ", index, " is listed twice"));
    }
    selection.gpus.push_back(index);
  }
  return selection;
}

namespace {

// The numeric flags' ranges, checked before anything starts.
absl::Status CheckLimitFlags(const ServerOptions& options) {
  if (options.max_batch_tokens < 1) {
    return absl::InvalidArgumentError("--max_batch_tokens must be >= 1");
  }
  if (options.max_message_bytes < (1 << 20) || options.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes must be in [1 MiB, ", INT_MAX, "] (gRPC's limit)"));
  }
  if (options.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError("--max_concurrent_streams must be >= 1");
  }
  if (options.max_streams_per_client < 1) {
    return absl::InvalidArgumentError("--max_streams_per_client must be >= 1");
  }
  if (options.stream_idle_timeout_seconds < 0) {
    return absl::InvalidArgumentError("--stream_idle_timeout_seconds must be >= 0 (0 = never)");
  }
  if (options.stream_order_timeout_seconds < 1) {
    return absl::InvalidArgumentError("--stream_order_timeout_seconds must be >= 1");
  }
  if (options.connection_idle_timeout_seconds < 0) {
    return absl::InvalidArgumentError("--connection_idle_timeout_seconds must be >= 0 (0 = never)");
  }
  if (!(options.max_inflight_share_per_client > 0.0 &&
        options.max_inflight_share_per_client <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_inflight_share_per_client: ", options.max_inflight_share_per_client,
                     " is not in (0, 1] (a fraction of --max_inflight_bytes)"));
  }
  if (options.max_clients_with_sums < 1) {
    return absl::InvalidArgumentError("--max_clients_with_sums must be >= 1");
  }
  return absl::OkStatus();
}

absl::StatusOr<NcclMode> ParseNcclMode(const std::string& nccl) {
  if (nccl == "auto") return NcclMode::kAuto;
  if (nccl == "on") return NcclMode::kOn;
  if (nccl == "off") return NcclMode::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("--nccl: '", nccl, "' is not one of auto, on, off"));
}

// The started workers of --devices: one per GPU, or the CPU backend's one worker. The CPU's come
// in the GPU workers' shape: one device (nothing to sum across devices), no CUDA IPC memory, no
// arrival staging.
absl::StatusOr<GpuWorkers> StartWorkers(const ServerOptions& options,
                                        const DeviceSelection& devices,
                                        const LayerSlots& layer_slots, NcclMode nccl_mode,
                                        ServerMetrics* metrics) {
  if (!devices.cpu) {
    return CreateGpuWorkers(devices.gpus, layer_slots, options.queue_depth, nccl_mode, metrics);
  }
  auto worker = std::make_unique<CpuWorker>(layer_slots, options.cpu_threads, metrics);
  ATTNGRAD_RETURN_IF_ERROR(worker->Start());
  GpuWorkers cpu;
  cpu.workers.push_back(std::move(worker));
  cpu.sum.description = "gradients: one device (cpu), nothing to sum across devices";
  return cpu;
}

ServiceLimits ServiceLimitsOf(const ServerOptions& options) {
  ServiceLimits limits;
  limits.batch.max_batch_tokens = options.max_batch_tokens;
  limits.batch.max_message_bytes = options.max_message_bytes;
  limits.streams.max_streams = options.max_concurrent_streams;
  limits.streams.max_streams_per_client = options.max_streams_per_client;
  limits.streams.idle_timeout = std::chrono::seconds(options.stream_idle_timeout_seconds);
  limits.stream_window = options.queue_depth;
  limits.max_inflight_bytes = options.max_inflight_bytes;
  limits.inflight_share_per_client = options.max_inflight_share_per_client;
  limits.stream_order_timeout = std::chrono::seconds(options.stream_order_timeout_seconds);
  return limits;
}

// The start-up log's line about authentication: bearer tokens, loopback only, or OFF said loudly.
std::string AuthenticationSummary(const Authenticator& authenticator,
                                  const ServerOptions& options) {
  if (authenticator.enabled()) {
    return absl::StrCat("authentication: bearer tokens from ", options.tokens_file, " (",
                        authenticator.token_count(), " tokens; roles trainer and admin)",
                        options.tls_cert.empty()
                            ? "; WARNING: without --tls_cert the tokens cross the network "
                              "in plaintext"
                            : "");
  }
  if (authenticator.loopback_only()) {
    return "protected mode: no --tokens_file, so only clients on this host (loopback, Unix "
           "sockets) are served and every other caller is refused (PERMISSION_DENIED); give "
           "--tokens_file, or --allow_unauthenticated to serve everyone";
  }
  return "WARNING: authentication is OFF (no --tokens_file, --allow_unauthenticated): any client "
         "that reaches the gRPC port may replace the weights, zero or fetch any client's sums "
         "(clients name themselves with the attngrad-client-id metadata)";
}

std::string MetricsListenSummary(const std::string& metrics_listen) {
  return absl::StrCat(
      "/metrics: plaintext HTTP, no authentication, on ", metrics_listen,
      absl::StartsWith(metrics_listen, "127.") || absl::StartsWith(metrics_listen, "localhost:")
          ? " (loopback only)"
          : " (keep it on a private network)");
}

std::string GrpcListenSummary(const std::string& listen) {
  return absl::StrCat("gRPC listens on ", listen,
                      absl::StartsWith(listen, "0.0.0.0:") || absl::StartsWith(listen, "[::]:")
                          ? " (every interface)"
                          : "");
}

// The gRPC server of `service` on --listen, with health checks and reflection; `port` is the bound
// port (0 when binding failed). Null when it could not start.
std::unique_ptr<grpc::Server> BuildGrpcServer(const ServerOptions& options,
                                              std::shared_ptr<grpc::ServerCredentials> credentials,
                                              grpc::Service* service, ServerMetrics* metrics,
                                              int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, std::move(credentials), port);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  // Compressed messages are refused (UNIMPLEMENTED): gRPC would inflate one in full before any
  // memory budget sees it, so a few kB of gzip could take gigabytes.
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  AddConnectionLimits(options, builder);
  // The RPC metrics of every call, including the ones gRPC itself ends (rpc_metrics_interceptor.h).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<RpcMetricsInterceptorFactory>(metrics));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  return builder.BuildAndStart();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GradientServer>> GradientServer::Start(
    const ServerOptions& options) {
  ATTNGRAD_RETURN_IF_ERROR(CheckLimitFlags(options));
  std::unique_ptr<GradientServer> server(new GradientServer());
  server->metrics_ = std::make_unique<ServerMetrics>(ATTNGRAD_VERSION);
  ATTNGRAD_ASSIGN_OR_RETURN(
      ServerTransport transport,
      MakeServerTransport(TlsFilesOf(options), LogAndCountTlsReloads(server->metrics_.get())));
  server->tls_reloader_ = std::move(transport.reloader);
  Authenticator authenticator = Authenticator::Open(!options.allow_unauthenticated);
  if (!options.tokens_file.empty()) {
    ATTNGRAD_ASSIGN_OR_RETURN(authenticator, Authenticator::FromFile(options.tokens_file));
  }
  if (options.queue_depth < 1) return absl::InvalidArgumentError("--queue_depth must be >= 1");
  if (options.cpu_threads < 0) return absl::InvalidArgumentError("--cpu_threads must be >= 0");
  ATTNGRAD_ASSIGN_OR_RETURN(const NcclMode nccl_mode, ParseNcclMode(options.nccl));
  ATTNGRAD_ASSIGN_OR_RETURN(const DeviceSelection devices,
                            ParseDevices(options.devices, DeviceCount()));

  // Weights: every layer the server holds.
  ATTNGRAD_ASSIGN_OR_RETURN(const ServedModel model, LoadServedModel(options));
  const LayerSlots layer_slots = GradientCore::LayerSlotsOf(model);
  server->model_summary_ = ModelSummary(model);

  // Workers.
  ATTNGRAD_ASSIGN_OR_RETURN(GpuWorkers workers, StartWorkers(options, devices, layer_slots,
                                                             nccl_mode, server->metrics_.get()));
  if (!options.stage_on_arrival) workers.arrival_staging.reset();
  server->uses_nccl_ = workers.sum.nccl;
  server->nccl_version_ = workers.sum.nccl_version;
  server->gradient_sum_ = workers.sum.description;
  server->metrics_->SetGradientSumPath(server->uses_nccl_ ? "nccl" : "host", server->nccl_version_);
  server->core_ = std::make_unique<GradientCore>(
      model, std::move(workers.workers), server->metrics_.get(), options.max_clients_with_sums);

  server->security_summary_.push_back(transport.description);
  server->security_summary_.push_back(AuthenticationSummary(authenticator, options));
  server->service_ = std::make_unique<GradientService>(
      server->core_.get(), server->metrics_.get(), ServiceLimitsOf(options),
      std::move(authenticator), ATTNGRAD_VERSION, std::move(workers.device_memory),
      std::move(workers.arrival_staging));

  // Metrics.
  if (!options.metrics_listen.empty()) {
    ATTNGRAD_ASSIGN_OR_RETURN(
        server->metrics_http_,
        MetricsHttpServer::Start(options.metrics_listen, server->metrics_->registry()));
    server->metrics_port_ = server->metrics_http_->port();
    server->security_summary_.push_back(MetricsListenSummary(options.metrics_listen));
  }

  // gRPC.
  server->server_ = BuildGrpcServer(options, transport.credentials, server->service_.get(),
                                    server->metrics_.get(), &server->port_);
  if (server->server_ == nullptr || server->port_ == 0) {
    server->server_.reset();
    return absl::UnavailableError(absl::StrCat("--listen: cannot listen on ", options.listen));
  }
  server->server_->GetHealthCheckService()->SetServingStatus(true);
  server->security_summary_.push_back(GrpcListenSummary(options.listen));
  ATTNGRAD_ASSIGN_OR_RETURN(std::string region_summary,
                            StartRegionSocket(options.region_socket, *server));
  server->security_summary_.push_back(std::move(region_summary));
  server->instance_id_ = server->core_->instance_id();
  return server;
}

absl::StatusOr<std::string> GradientServer::StartRegionSocket(const std::string& flag,
                                                              GradientServer& server) {
  const std::string path = RegionSocketPath(flag, server.port_);
  if (path.empty()) return std::string("shared-memory regions: off (--region_socket=off)");
  absl::StatusOr<std::unique_ptr<RegionSocketListener>> listener = RegionSocketListener::Start(
      path,
      RegisterFromSocket(server.service_->authenticator(), server.service_->mutable_regions()));
  if (!listener.ok()) {
    // A path the operator named must work; the default one is a convenience, and a server that
    // cannot create it serves everything but shared memory.
    if (!flag.empty()) return listener.status();
    return absl::StrCat("shared-memory regions: off (", listener.status().message(),
                        "; give --region_socket=PATH)");
  }
  server.region_socket_ = *std::move(listener);
  return absl::StrCat("shared-memory regions: sealed memfds passed on ", path,
                      " (mode 0600: the server's user and root only)");
}

const MemoryBudget& GradientServer::inflight_memory() const { return service_->memory(); }

const std::string& GradientServer::region_socket_path() const {
  static const std::string kNone;
  return region_socket_ == nullptr ? kNone : region_socket_->path();
}

void GradientServer::Shutdown(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  region_socket_.reset();  // no new regions
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    // Backward streams take no new batch: those with none in flight end now (a client's idle
    // kept-open stream does not hold the shutdown), the others once their batches are answered.
    service_->streams().Drain();
    // Refuses new RPCs at once; running ones may finish until the deadline, then are cancelled.
    // Returns when every RPC is done (a Backward stream finishes only after its batches).
    server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(grace));
    server_->Wait();
  }
  core_.reset();  // drains and stops the workers
}

GradientServer::~GradientServer() {
  Shutdown(absl::ZeroDuration());
  region_socket_.reset();
  server_.reset();
  tls_reloader_.reset();  // gRPC reads its staged files until the server is gone
  service_.reset();
  metrics_http_.reset();
}

}  // namespace attngrad::server
