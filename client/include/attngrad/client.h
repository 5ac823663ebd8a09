// attngrad::Client: the C++ client of the attngrad.v1.AttentionGradient service, for trainers
// written in C++. It hides the bidirectional Backward stream (batches are matched to responses by
// batch_id), splits a batch along B when it exceeds the server's limits (and reassembles the
// answer), assembles the chunked gradient and weight transfers, retries idempotent calls with
// backoff, puts a deadline on every call, and turns a server restart (a changed server_instance_id)
// into an ABORTED error instead of silently mixing two servers' state.
//
// Thread safety: a Client may be shared by any number of threads; a BackwardStream is used by one
// thread at a time (Submit and Next/Await may be called from two different threads).
//
// Memory: Submit encodes a batch's activations once, into a host buffer that gRPC sends as it is
// (the batch's spans are not read after Submit returns); sent buffers are kept for reuse by the
// next batches, up to 1 GiB per Client, and freed with it. With BackwardBatch::borrow_inputs
// (inputs already in the wire dtype: float32, or the 16-bit spans), gRPC sends them from the
// caller's memory instead, with no copy. Answers are decoded straight from the received bytes into
// the result's vectors, or into the caller's memory (BackwardBatch::grad_hidden_states_out,
// grad_hidden_states_16bit_out, weight_gradients_out; a float32 or 16-bit answer copied there with
// non-temporal stores), in 4 MiB parts on up to 4 decode threads that the Client keeps for all its
// streams (common::ParallelTasks).
#ifndef ATTNGRAD_CLIENT_H_
#define ATTNGRAD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attngrad/layer_weights.h"
#include "attngrad/v1/attngrad.pb.h"

namespace attngrad {

// How a Client talks to the server.
struct ClientOptions {
  // Deadline of each attempt of a unary call (GetModelInfo, health, ZeroGradients), of a whole
  // FetchGradients / LoadWeights stream, and of the one-batch Client::Backward.
  absl::Duration deadline = absl::Seconds(300);
  // How long Connect waits for the channel to become ready.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Deadline of a BackwardStream as a whole (infinite: a session may last a training run).
  absl::Duration stream_deadline = absl::InfiniteDuration();
  // Attempts of an idempotent call (GetModelInfo, health, FetchGradients without zeroing, and
  // Client::Backward, whose batch id makes a retried ACCUMULATE batch count once) on UNAVAILABLE or
  // DEADLINE_EXCEEDED; 1 = no retry. Exponential backoff with jitter.
  int max_attempts = 4;
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  // The client's own gRPC send/receive limit. Batches are split so that every request fits
  // min(this, the server's max_message_bytes).
  int64_t max_message_bytes = int64_t{1} << 30;
  // Chunk size of LoadWeights uploads and of FetchGradients downloads.
  int64_t chunk_bytes = int64_t{4} << 20;
  // Batches a BackwardStream keeps in flight before Submit blocks.
  int max_in_flight = 8;
  // Connections (gRPC channels with distinct arguments, so that gRPC does not share one TCP
  // connection between them). Each BackwardStream (and each one-batch Backward) takes the next
  // channel in turn; the unary calls use the first. A channel connects on its first call, so unused
  // ones cost nothing. The default, 8, gives each of up to 8 concurrent streams a connection of its
  // own: one HTTP/2 connection carries one TCP window and is served by one thread on each side, and
  // on one H200 host a bare gRPC stream of attngrad's bytes moved 62.7k tokens/s over 1 connection
  // and 255k over 8. 1 = everything on one connection.
  int channels = 8;
  // Null: insecure (plaintext) channel. TlsCredentialsFromFiles (below) makes TLS / mutual-TLS
  // credentials from a CA bundle and a client certificate and key.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // TLS only: the name the server's certificate must carry when it differs from the target's host
  // (connecting by IP address, say). Empty: the target's host.
  std::string tls_server_name;
  // Sent with every call as `authorization: Bearer <token>` (servers started with --tokens_file;
  // ReadTokenFile reads one). Empty: none.
  std::string token;
  // Servers without authentication scope accumulation windows, batch ids and stream limits to the
  // client id a client names (metadata attngrad-client-id); empty = the server's "default". With
  // authentication the token names the client and this is ignored by the server.
  std::string client_id;
  // Admins only: FetchGradients and ZeroGradients address this client's window instead of the
  // caller's own (metadata attngrad-for-client). Empty: the caller's own.
  std::string for_client;
  // The server's region socket, where RegisterRegion passes shared memory
  // (attngrad/shared_memory_region.h). Empty: the default path of the target's port (a server
  // started without --region_socket).
  std::string region_socket;
  // Connect reads GetModelInfo (and keeps it for splitting batches). False: Connect only waits for
  // the channel, for callers that ask for nothing but Health (the health service needs no token).
  bool read_info_on_connect = true;
};

// TLS channel credentials: the server is verified against the PEM CA bundle in `ca_file` (empty:
// the system's roots); with `certificate_file` and `key_file` (PEM) the client presents that
// certificate (mutual TLS). NOT_FOUND / INVALID_ARGUMENT naming the file otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentialsFromFiles(
    const std::string& ca_file, const std::string& certificate_file, const std::string& key_file);

// The bearer token in `path`: its first line, surrounding whitespace removed (a token is never a
// command-line argument, where other users of the machine could read it).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// A dense fp32 host tensor (row-major).
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t num_elements() const;
};

// The six weights, or weight gradients, of the layer, indexed by attngrad::Weight
// (attngrad/layer_weights.h: names q_proj ... k_norm and shapes).
using WeightSet = PerWeight<HostTensor>;

// One batch for the Backward stream. The spans are read during Submit/Backward only (the data is
// serialised before the call returns), so they may point into the caller's buffers; with
// borrow_inputs, hidden_states and grad_output are read until the batch's result is returned.
struct BackwardBatch {
  int64_t batch = 0;                      // B
  int64_t seq_len = 0;                    // S
  absl::Span<const float> hidden_states;  // [B,S,hidden]
  absl::Span<const float> grad_output;    // [B,S,hidden]
  // Rotary inputs: cos/sin tables [B,S,head_dim], or (when both are empty) position ids from which
  // the server builds them: B*S values, S values shared by every sequence, or none for 0..S-1.
  absl::Span<const float> cos;
  absl::Span<const float> sin;
  std::vector<int64_t> position_ids;
  double rope_theta = 0;  // 0 = the layer's RoPE base (10000 for the SPEC layer)
  // The decoder layer (GetModelInfo's layers); unset = the server's first layer.
  std::optional<int> layer;
  // Unset: the layer's defaults (the benchmark values of SPEC section 2 for the SPEC layer; the
  // checkpoint's config.json for a model). softcap <= 0: no soft-capping.
  std::optional<float> scaling;
  std::optional<float> softcap;
  std::optional<float> eps;
  std::optional<int> sliding_window;  // overrides the layer's window (0 = full causal)
  v1::GradientMode mode = v1::GRADIENT_MODE_RETURN;
  v1::Precision precision = v1::PRECISION_UNSPECIFIED;
  // 0: the client picks a unique id. Caller-chosen ids must be below 2^63 (ids with the top bit set
  // name the parts of a split batch). Reusing an id in ACCUMULATE mode within one window is a
  // retry: the server answers it again and does not add it twice.
  uint64_t batch_id = 0;
  uint64_t expected_weights_version = 0;  // 0 = any
  uint64_t accumulation_window_id = 0;    // ACCUMULATE: 0 = the current window
  // Wire dtype of the answer; results are fp32 (but grad_hidden_states_16bit_out).
  v1::DType response_dtype = v1::DTYPE_UNSPECIFIED;
  // Wire dtype of hidden_states and grad_output (float32 when unspecified; float16 / bfloat16 halve
  // the bytes, and the server computes from the rounded values: a different input, so compare with
  // the reference of the rounded input). cos/sin always travel as float32.
  v1::DType input_dtype = v1::DTYPE_UNSPECIFIED;
  // Where the answer's grad_hidden_states goes: empty = a vector of the result's own
  // (BackwardResult::grad_hidden_states); else B*S*hidden floats of the caller's, into which the
  // answer is decoded (the same values) and the result's vector stays empty. The memory must stay
  // valid, and be left alone, until the batch's result has been returned (by Next, Await or
  // Backward) or the stream is destroyed. For a caller that reuses its buffers (or decodes into
  // its own tensor): a fresh vector per batch costs its page faults and zeroing, more than the
  // decode itself.
  absl::Span<float> grad_hidden_states_out;
  // RETURN mode: where the six weight gradients go, the same way: all empty = the result's
  // WeightSet (fresh vectors); else each holds WeightElements(weight) floats of the caller's, into
  // which that weight's answer is decoded (summed over the parts of a split batch), and the
  // result's weight_gradients has each weight's shape with empty data. Set all six or none; the
  // same lifetime rule as grad_hidden_states_out. A RETURN answer of the SPEC layer carries ~100 MB
  // of weight gradients (fp32): fresh vectors cost their page faults on every answer.
  PerWeight<absl::Span<float>> weight_gradients_out;
  // 16-bit inputs and answer, for a trainer whose tensors are already float16 or bfloat16: nothing
  // is converted on the client. hidden_states_16bit and grad_output_16bit hold B*S*hidden elements
  // each of input_dtype (which must then be float16 or bfloat16) as their bit patterns (e.g. the
  // memory of a bf16 tensor), in place of the float spans above (set these two or those two); they
  // go on the wire as they are, copied once into a buffer of the client's, or with borrow_inputs
  // not at all.
  absl::Span<const uint16_t> hidden_states_16bit;
  absl::Span<const uint16_t> grad_output_16bit;
  // The answer's grad_hidden_states in response_dtype (which must then be float16 or bfloat16):
  // B*S*hidden elements of the caller's into which its bits are copied as they arrive (no
  // conversion); the result's vector stays empty. The same lifetime rule as
  // grad_hidden_states_out; set one or neither of the two.
  absl::Span<uint16_t> grad_hidden_states_16bit_out;
  // Inputs already in the wire dtype (float32 spans with float32 on the wire, or the 16-bit spans):
  // hidden_states and grad_output are sent from the caller's memory as they are, not copied (the
  // same bytes on the wire). The caller must then keep that memory valid and unchanged until the
  // batch's result has been returned (by Next, Await or Backward), which waits, if need be, until
  // gRPC has let go of it. Ignored for float spans with a 16-bit input_dtype (converted into a
  // buffer of the client's). False: the spans are read during Submit only (one copy).
  bool borrow_inputs = false;
};

// The answer to one batch (all parts of a split batch, reassembled).
struct BackwardResult {
  uint64_t batch_id = 0;
  // OK, or why this batch failed (the server's code and message). Only BackwardStream::Next returns
  // failed batches as results; every other call returns the failure as its status.
  absl::Status status;
  std::vector<int64_t> shape;             // [B,S,hidden]
  std::vector<float> grad_hidden_states;  // [B,S,hidden]; empty with grad_hidden_states_out
  // RETURN mode: summed over the parts (shapes only, empty data, with weight_gradients_out).
  std::optional<WeightSet> weight_gradients;
  uint64_t weights_version = 0;
  int layer = 0;                        // the decoder layer the server computed
  uint64_t accumulation_window_id = 0;  // ACCUMULATE mode
  bool duplicate = false;      // ACCUMULATE mode: some part was already accumulated in this window
  std::string device;          // the device(s) that computed it, e.g. "cpu" or "cuda:0,cuda:1"
  int parts = 1;               // how many requests the batch was split into
  v1::StageTimings timings;    // the server's stage times, summed over the parts
  absl::Duration latency;      // from Submit to the last part's answer, as the client saw it
  int64_t request_bytes = 0;   // serialised request sizes, summed over the parts
  int64_t response_bytes = 0;  // serialised response sizes, summed over the parts
};

// The accumulated gradients of one window (state.layer: of which layer).
struct FetchedGradients {
  v1::AccumulationState state;
  WeightSet gradients;
};

// One weight to upload, in any wire dtype the server supports; `data` holds the raw little-endian
// elements (product(shape) of them) and must outlive the LoadWeights call.
struct WeightUpload {
  Weight weight = Weight::kQProj;
  v1::DType dtype = v1::DTYPE_FLOAT32;
  std::vector<int64_t> shape;
  absl::string_view data;
};

// Result of the standard grpc.health.v1 check.
enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
absl::string_view HealthStatusName(HealthStatus status);

class Client;
class SharedMemoryRegion;  // attngrad/shared_memory_region.h

// A Backward session: one bidirectional stream with many batches in flight. Submit sends a batch
// (split as needed) and returns its id; Next returns batches in the order they complete; Await
// waits for one id. Destroying an unfinished stream cancels it.
class BackwardStream {
 public:
  ~BackwardStream();
  BackwardStream(const BackwardStream&) = delete;
  BackwardStream& operator=(const BackwardStream&) = delete;

  // Sends one batch; blocks while ClientOptions::max_in_flight batches are outstanding. Returns the
  // batch id. Fails when the stream is broken, the id is already in flight, or the batch cannot be
  // split to fit the server's limits.
  absl::StatusOr<uint64_t> Submit(const BackwardBatch& batch);

  // The next completed batch (a failed batch comes back with a non-OK `status`). Errors:
  // OUT_OF_RANGE when nothing is outstanding, DEADLINE_EXCEEDED after `timeout`.
  absl::StatusOr<BackwardResult> Next(absl::Duration timeout = absl::InfiniteDuration());

  // Waits for one batch; its failure is returned as the status.
  absl::StatusOr<BackwardResult> Await(uint64_t batch_id,
                                       absl::Duration timeout = absl::InfiniteDuration());

  // Batches submitted and not yet returned by Next/Await.
  int64_t outstanding() const;

  // Half-closes the stream and waits for the server to answer everything in flight (the answers
  // stay available to Next/Await). Returns the stream's final status.
  absl::Status Finish();

  // Cancels the stream: outstanding batches fail with CANCELLED.
  void Cancel();

  class Impl;

 private:
  friend class Client;
  explicit BackwardStream(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Client {
 public:
  // Opens a channel to `target` (e.g. "127.0.0.1:50051"), waits until it is ready and reads the
  // model info (limits, server instance id). UNAVAILABLE when the server cannot be reached in time.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         const ClientOptions& options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // GetModelInfo (retried). Refreshes the cached limits. Does not fail on a server restart, but
  // records it (see below).
  absl::StatusOr<v1::GetModelInfoResponse> Info();
  // The info read by Connect or the last Info().
  v1::GetModelInfoResponse cached_info() const;

  // grpc.health.v1.Health/Check for `service` ("" = the whole server) (retried).
  absl::StatusOr<HealthStatus> Health(const std::string& service = "");

  // One batch on a stream of its own (split as needed; retried on a broken transport with the same
  // batch id, so an ACCUMULATE batch is never counted twice).
  absl::StatusOr<BackwardResult> Backward(const BackwardBatch& batch);

  // A session for many batches in flight. `on_result`, when set, is called on the stream's reader
  // thread (with no lock held) each time a batch completes, for a caller that waits on several
  // streams at once (ShardedStream).
  absl::StatusOr<std::unique_ptr<BackwardStream>> StartStream(
      std::function<void()> on_result = nullptr);

  // The accumulated gradients, assembled from the chunks. zero_after: atomically start a new window
  // (not retried: not idempotent). expected_window_id != 0: FAILED_PRECONDITION if the server's
  // window differs.
  // Windows are per layer: `layer` unset = the server's first layer.
  absl::StatusOr<FetchedGradients> Fetch(bool zero_after, uint64_t expected_window_id = 0,
                                         std::optional<int> layer = std::nullopt);
  // Several layers in one call, in the order given (each layer's window fetched, and with
  // zero_after zeroed, when the server reaches it).
  absl::StatusOr<std::vector<FetchedGradients>> FetchLayers(const std::vector<int>& layers,
                                                            bool zero_after);

  // Zeroes the layer's accumulators and starts a new window (not retried).
  absl::StatusOr<v1::ZeroGradientsResponse> Zero(uint64_t expected_window_id = 0,
                                                 std::optional<int> layer = std::nullopt);

  // Replaces all six weights of a layer (unset: the server's first layer; streamed in chunks; not
  // retried). Returns the layer's new weights version. expected_version != 0: FAILED_PRECONDITION
  // if the layer's version differs.
  absl::StatusOr<uint64_t> LoadWeights(const std::vector<WeightUpload>& weights,
                                       uint64_t expected_version = 0,
                                       std::optional<int> layer = std::nullopt);
  absl::StatusOr<uint64_t> LoadWeights(const WeightSet& weights, uint64_t expected_version = 0,
                                       std::optional<int> layer = std::nullopt);

  // Server restart detection: the instance id read by Connect is compared with every id the server
  // reports. When it changes, every data call (Backward, streams, Fetch, Zero, LoadWeights) fails
  // with ABORTED naming both ids until AcceptServerRestart() adopts the new server (after which the
  // caller must assume its accumulated gradients and uploaded weights are gone).
  absl::Status AcceptServerRestart();
  std::string server_instance_id() const;
  const std::string& target() const;

  // Shares `memory` with the server (same host only): its descriptor goes over the server's region
  // socket (ClientOptions::region_socket) with this client's token or client id; the region id,
  // which BackwardRequest / LoadWeights / FetchGradients region slices name. The server unmaps it
  // at UnregisterRegion, once this process has exited, or at shutdown.
  absl::StatusOr<uint64_t> RegisterRegion(const SharedMemoryRegion& memory);
  // INVALID_ARGUMENT for a region that is not this client's.
  absl::Status UnregisterRegion(uint64_t region_id);
  const ClientOptions& options() const;
  // How many channels (connections) the client spreads its streams over (ClientOptions::channels).
  int channel_count() const;

  class Impl;

 private:
  explicit Client(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_H_
