// attngrad::ShardedClient: one model whose decoder layers are spread over several attngrad servers
// (each started with --layers=A-B), addressed through a layer map such as
// "0-12=host-a:50051,13-25=host-b:50051". It holds one attngrad::Client per server and sends every
// layer-addressed call (Backward batches, fetches, zeroing, weight uploads) to the server of that
// layer; Info merges the layers of all servers after checking that they serve the same model. No
// coordination between the servers is needed: each layer's weights, versions and accumulation
// windows live on exactly one of them.
//
// A plain target ("host:50051", no '=') is a map of one server holding every layer, so a caller can
// take a ShardedClient whether the model is on one server or several.
//
// Thread safety: as attngrad::Client (a ShardedClient may be shared; a ShardedStream is used by one
// thread at a time, Submit and Next/Await possibly from two).
#ifndef ATTNGRAD_SHARDED_CLIENT_H_
#define ATTNGRAD_SHARDED_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attngrad/client.h"
#include "attngrad/wire/layer_range.h"

namespace attngrad {

// A layer map's entries and its parser are proto/'s (attngrad/wire/layer_range.h: the grammar the
// server's --layers and the Python client share): attngrad::LayerRange is wire::LayerRange.
using wire::LayerMapString;
using wire::LayerRange;
using wire::ParseLayerMap;

class ShardedClient;

// Backward batches of any layers on one stream per server (opened on first use). Next returns
// batches in the order they complete, whichever server answered.
class ShardedStream {
 public:
  ~ShardedStream();
  ShardedStream(const ShardedStream&) = delete;
  ShardedStream& operator=(const ShardedStream&) = delete;

  // Sends the batch to the server of batch.layer (unset: allowed only when the map has one
  // server). Returns the batch id (unique across the servers' streams).
  absl::StatusOr<uint64_t> Submit(const BackwardBatch& batch);
  // As BackwardStream::Next / Await.
  absl::StatusOr<BackwardResult> Next(absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<BackwardResult> Await(uint64_t batch_id,
                                       absl::Duration timeout = absl::InfiniteDuration());
  int64_t outstanding() const;
  // Finishes every server's stream; the first failure is returned.
  absl::Status Finish();
  void Cancel();

  class Impl;

 private:
  friend class ShardedClient;
  explicit ShardedStream(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class ShardedClient {
 public:
  // Connects to every server of `map` (with the same options) and reads and merges their model
  // info: FAILED_PRECONDITION when the servers disagree on the model (name, number of layers, layer
  // shape) or a server does not hold a layer the map sends it.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Connect(std::vector<LayerRange> map,
                                                                const ClientOptions& options = {});
  // ParseLayerMap(map) then Connect.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Connect(absl::string_view map,
                                                                const ClientOptions& options = {});
  ~ShardedClient();
  ShardedClient(const ShardedClient&) = delete;
  ShardedClient& operator=(const ShardedClient&) = delete;

  // Every server's GetModelInfo, merged: the first server's answer with `layers` holding every
  // mapped layer (sorted by index, each from the server that serves it), `devices` of all servers,
  // the smallest limits, and server_instance_id the servers' ids joined by ','. Checked as in
  // Connect.
  absl::StatusOr<v1::GetModelInfoResponse> Info();
  // The merged info read by Connect or the last Info().
  v1::GetModelInfoResponse cached_info() const;
  // SERVING when every server is; else the first other status (servers in map order).
  absl::StatusOr<HealthStatus> Health(const std::string& service = "");

  // The server of `layer` (unset: the only server; INVALID_ARGUMENT when there are several).
  // NOT_FOUND naming the map for a layer no range covers.
  absl::StatusOr<Client*> ForLayer(std::optional<int> layer) const;

  // Client's calls, each sent to the server of its layer.
  absl::StatusOr<BackwardResult> Backward(const BackwardBatch& batch);
  absl::StatusOr<std::unique_ptr<ShardedStream>> StartStream();
  absl::StatusOr<FetchedGradients> Fetch(bool zero_after, uint64_t expected_window_id = 0,
                                         std::optional<int> layer = std::nullopt);
  // One FetchGradients call per server for its layers; the answers in the order of `layers`.
  absl::StatusOr<std::vector<FetchedGradients>> FetchLayers(const std::vector<int>& layers,
                                                            bool zero_after);
  absl::StatusOr<v1::ZeroGradientsResponse> Zero(uint64_t expected_window_id = 0,
                                                 std::optional<int> layer = std::nullopt);
  absl::StatusOr<uint64_t> LoadWeights(const std::vector<WeightUpload>& weights,
                                       uint64_t expected_version = 0,
                                       std::optional<int> layer = std::nullopt);
  absl::StatusOr<uint64_t> LoadWeights(const WeightSet& weights, uint64_t expected_version = 0,
                                       std::optional<int> layer = std::nullopt);

  const std::vector<LayerRange>& map() const { return map_; }
  // The map as text (the plain target for a one-server map without ranges).
  std::string target() const { return LayerMapString(map_); }
  int server_count() const { return static_cast<int>(servers_.size()); }
  Client& server(int index) const { return *servers_[index]; }

 private:
  ShardedClient(std::vector<LayerRange> map, std::vector<std::unique_ptr<Client>> servers);
  // The index in map_/servers_ of the server of `layer` (see ForLayer).
  absl::StatusOr<int> ServerOf(std::optional<int> layer) const;

  const std::vector<LayerRange> map_;
  const std::vector<std::unique_ptr<Client>> servers_;  // servers_[i] serves map_[i]
  mutable absl::Mutex mu_;
  v1::GetModelInfoResponse info_ ABSL_GUARDED_BY(mu_);
};

// The merge of Info: `infos[i]` is the answer of the server of map[i]. Exposed for tests.
absl::StatusOr<v1::GetModelInfoResponse> MergeModelInfo(
    const std::vector<LayerRange>& map, const std::vector<v1::GetModelInfoResponse>& infos);

}  // namespace attngrad

#endif  // ATTNGRAD_SHARDED_CLIENT_H_
