// ShardedClient and ShardedStream: a layer map's servers behind one client (see
// attngrad/sharded_client.h).
#include "attngrad/sharded_client.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attngrad/common/status_macros.h"
#include "client_impl.h"

namespace attngrad {

// ---------------------------------------------------------------------------------------------
// Merging the servers' model info

namespace {

std::string ShapeOf(const v1::LayerConfig& c) {
  return absl::StrCat("hidden ", c.hidden_size(), ", ", c.num_heads(), " heads, ", c.num_kv_heads(),
                      " kv heads, head_dim ", c.head_dim());
}

bool SameShape(const v1::LayerConfig& a, const v1::LayerConfig& b) {
  return a.hidden_size() == b.hidden_size() && a.num_heads() == b.num_heads() &&
         a.num_kv_heads() == b.num_kv_heads() && a.head_dim() == b.head_dim();
}

std::string HeldLayers(const v1::GetModelInfoResponse& info) {
  std::vector<int> held;
  for (const v1::LayerInfo& layer : info.layers()) held.push_back(layer.index());
  if (held.empty()) return "no layers";
  std::sort(held.begin(), held.end());
  const bool contiguous = held.back() - held.front() + 1 == static_cast<int>(held.size());
  if (contiguous) return absl::StrCat("layers ", held.front(), "-", held.back());
  return absl::StrCat("layers ", absl::StrJoin(held, ","));
}

}  // namespace

absl::StatusOr<v1::GetModelInfoResponse> MergeModelInfo(
    const std::vector<LayerRange>& map, const std::vector<v1::GetModelInfoResponse>& infos) {
  if (map.empty() || map.size() != infos.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MergeModelInfo: ", map.size(), " ranges and ", infos.size(), " answers"));
  }
  v1::GetModelInfoResponse merged = infos.front();
  merged.clear_layers();
  merged.clear_devices();
  std::vector<std::string> instances;
  for (size_t i = 0; i < infos.size(); ++i) {
    const v1::GetModelInfoResponse& info = infos[i];
    const LayerRange& range = map[i];
    auto disagree = [&](absl::string_view what, const std::string& first, const std::string& here) {
      return absl::FailedPreconditionError(
          absl::StrCat("the layer map's servers serve different models: ", map.front().target,
                       " has ", what, " ", first, ", ", range.target, " has ", here));
    };
    if (info.model_name() != merged.model_name()) {
      return disagree("model", absl::StrCat("\"", merged.model_name(), "\""),
                      absl::StrCat("\"", info.model_name(), "\""));
    }
    if (info.num_hidden_layers() != merged.num_hidden_layers()) {
      return disagree("decoder layers", absl::StrCat(merged.num_hidden_layers()),
                      absl::StrCat(info.num_hidden_layers()));
    }
    if (!SameShape(info.config(), merged.config())) {
      return disagree("layer shape", ShapeOf(merged.config()), ShapeOf(info.config()));
    }
    std::set<int> held;
    for (const v1::LayerInfo& layer : info.layers()) {
      held.insert(layer.index());
      if (!SameShape(layer.config(), merged.config())) {
        return disagree(absl::StrCat("(layer ", layer.index(), ") layer shape"),
                        ShapeOf(merged.config()), ShapeOf(layer.config()));
      }
      if (range.Contains(layer.index())) *merged.add_layers() = layer;
    }
    if (!range.all_layers()) {
      for (int layer = range.first; layer <= range.last; ++layer) {
        if (held.count(layer)) continue;
        return absl::FailedPreconditionError(
            absl::StrCat("the layer map sends layer ", layer, " (", range.ToString(), ") to ",
                         range.target, ", which holds ", HeldLayers(info),
                         " (start it with --layers=", range.first, "-", range.last, ")"));
      }
    }
    for (const v1::DeviceInfo& device : info.devices()) *merged.add_devices() = device;
    instances.push_back(info.server_instance_id());
    auto smallest = [](int64_t a, int64_t b) {
      if (a <= 0) return b;
      if (b <= 0) return a;
      return std::min(a, b);
    };
    merged.set_max_message_bytes(smallest(merged.max_message_bytes(), info.max_message_bytes()));
    merged.set_max_batch_tokens(smallest(merged.max_batch_tokens(), info.max_batch_tokens()));
  }
  std::sort(merged.mutable_layers()->begin(), merged.mutable_layers()->end(),
            [](const v1::LayerInfo& a, const v1::LayerInfo& b) { return a.index() < b.index(); });
  merged.set_server_instance_id(absl::StrJoin(instances, ","));
  return merged;
}

// ---------------------------------------------------------------------------------------------
// ShardedClient

ShardedClient::ShardedClient(std::vector<LayerRange> map,
                             std::vector<std::unique_ptr<Client>> servers)
    : map_(std::move(map)), servers_(std::move(servers)) {}

ShardedClient::~ShardedClient() = default;

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Connect(
    absl::string_view map, const ClientOptions& options) {
  ATTNGRAD_ASSIGN_OR_RETURN(std::vector<LayerRange> ranges, ParseLayerMap(map));
  return Connect(std::move(ranges), options);
}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Connect(
    std::vector<LayerRange> map, const ClientOptions& options) {
  if (map.empty()) return absl::InvalidArgumentError("ShardedClient: an empty layer map");
  if (map.size() > 1) {
    for (const LayerRange& range : map) {
      if (range.all_layers()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ShardedClient: ", range.target, " has no layer range in a map of several servers"));
      }
    }
  }
  std::vector<std::unique_ptr<Client>> servers;
  for (const LayerRange& range : map) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(range.target, options);
    if (!client.ok()) {
      return absl::Status(client.status().code(), absl::StrCat("layers ", range.ToString(), ": ",
                                                               client.status().message()));
    }
    servers.push_back(*std::move(client));
  }
  std::unique_ptr<ShardedClient> sharded(new ShardedClient(std::move(map), std::move(servers)));
  if (options.read_info_on_connect) {
    std::vector<v1::GetModelInfoResponse> infos;
    for (const std::unique_ptr<Client>& server : sharded->servers_) {
      infos.push_back(server->cached_info());
    }
    ATTNGRAD_ASSIGN_OR_RETURN(v1::GetModelInfoResponse merged,
                              MergeModelInfo(sharded->map_, infos));
    absl::MutexLock lock(&sharded->mu_);
    sharded->info_ = std::move(merged);
  }
  return sharded;
}

absl::StatusOr<v1::GetModelInfoResponse> ShardedClient::Info() {
  std::vector<v1::GetModelInfoResponse> infos;
  for (const std::unique_ptr<Client>& server : servers_) {
    ATTNGRAD_ASSIGN_OR_RETURN(v1::GetModelInfoResponse info, server->Info());
    infos.push_back(std::move(info));
  }
  ATTNGRAD_ASSIGN_OR_RETURN(v1::GetModelInfoResponse merged, MergeModelInfo(map_, infos));
  absl::MutexLock lock(&mu_);
  info_ = merged;
  return merged;
}

v1::GetModelInfoResponse ShardedClient::cached_info() const {
  absl::MutexLock lock(&mu_);
  return info_;
}

absl::StatusOr<HealthStatus> ShardedClient::Health(const std::string& service) {
  for (const std::unique_ptr<Client>& server : servers_) {
    ATTNGRAD_ASSIGN_OR_RETURN(const HealthStatus status, server->Health(service));
    if (status != HealthStatus::kServing) return status;
  }
  return HealthStatus::kServing;
}

absl::StatusOr<int> ShardedClient::ServerOf(std::optional<int> layer) const {
  if (!layer.has_value()) {
    if (servers_.size() == 1) return 0;
    return absl::InvalidArgumentError(absl::StrCat("the layer map ", LayerMapString(map_),
                                                   " has several servers: name the layer"));
  }
  for (size_t i = 0; i < map_.size(); ++i) {
    if (map_[i].Contains(*layer)) return static_cast<int>(i);
  }
  return absl::NotFoundError(
      absl::StrCat("layer ", *layer, " is not in the layer map ", LayerMapString(map_)));
}

absl::StatusOr<Client*> ShardedClient::ForLayer(std::optional<int> layer) const {
  ATTNGRAD_ASSIGN_OR_RETURN(const int index, ServerOf(layer));
  return servers_[index].get();
}

absl::StatusOr<BackwardResult> ShardedClient::Backward(const BackwardBatch& batch) {
  ATTNGRAD_ASSIGN_OR_RETURN(Client* const server, ForLayer(batch.layer));
  return server->Backward(batch);
}

absl::StatusOr<FetchedGradients> ShardedClient::Fetch(bool zero_after, uint64_t expected_window_id,
                                                      std::optional<int> layer) {
  ATTNGRAD_ASSIGN_OR_RETURN(Client* const server, ForLayer(layer));
  return server->Fetch(zero_after, expected_window_id, layer);
}

absl::StatusOr<std::vector<FetchedGradients>> ShardedClient::FetchLayers(
    const std::vector<int>& layers, bool zero_after) {
  // Group the layers by server (keeping their order within each), fetch, then put the answers
  // back in the order asked.
  std::map<int, std::vector<int>> by_server;
  std::vector<std::pair<int, int>> place;  // (server, position in its list) per requested layer
  for (int layer : layers) {
    ATTNGRAD_ASSIGN_OR_RETURN(const int index, ServerOf(layer));
    place.emplace_back(index, static_cast<int>(by_server[index].size()));
    by_server[index].push_back(layer);
  }
  std::map<int, std::vector<FetchedGradients>> fetched;
  for (const auto& [index, server_layers] : by_server) {
    absl::StatusOr<std::vector<FetchedGradients>> answer =
        servers_[index]->FetchLayers(server_layers, zero_after);
    if (!answer.ok()) {
      return absl::Status(answer.status().code(),
                          absl::StrCat(map_[index].target, ": ", answer.status().message()));
    }
    fetched[index] = *std::move(answer);
  }
  std::vector<FetchedGradients> ordered;
  for (const auto& [index, position] : place) {
    ordered.push_back(std::move(fetched[index][position]));
  }
  return ordered;
}

absl::StatusOr<v1::ZeroGradientsResponse> ShardedClient::Zero(uint64_t expected_window_id,
                                                              std::optional<int> layer) {
  ATTNGRAD_ASSIGN_OR_RETURN(Client* const server, ForLayer(layer));
  return server->Zero(expected_window_id, layer);
}

absl::StatusOr<uint64_t> ShardedClient::LoadWeights(const std::vector<WeightUpload>& weights,
                                                    uint64_t expected_version,
                                                    std::optional<int> layer) {
  ATTNGRAD_ASSIGN_OR_RETURN(Client* const server, ForLayer(layer));
  return server->LoadWeights(weights, expected_version, layer);
}

absl::StatusOr<uint64_t> ShardedClient::LoadWeights(const WeightSet& weights,
                                                    uint64_t expected_version,
                                                    std::optional<int> layer) {
  ATTNGRAD_ASSIGN_OR_RETURN(Client* const server, ForLayer(layer));
  return server->LoadWeights(weights, expected_version, layer);
}

// ---------------------------------------------------------------------------------------------
// ShardedStream

class ShardedStream::Impl {
 public:
  Impl(const ShardedClient* owner, std::vector<Client*> servers)
      : owner_(owner), servers_(std::move(servers)), streams_(servers_.size()) {}

  absl::StatusOr<uint64_t> Submit(const BackwardBatch& batch) {
    absl::StatusOr<Client*> server = owner_->ForLayer(batch.layer);
    if (!server.ok()) return server.status();
    const size_t index = static_cast<size_t>(std::find(servers_.begin(), servers_.end(), *server) -
                                             servers_.begin());
    BackwardStream* stream = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return absl::FailedPreconditionError("ShardedStream: Submit after Finish");
      if (streams_[index] == nullptr) {
        // The server's own stream, which tells this one when a batch completes.
        absl::StatusOr<std::unique_ptr<BackwardStream>> opened = (*server)->StartStream([this]() {
          absl::MutexLock notify_lock(&mu_);
          ++completions_;
          changed_.SignalAll();
        });
        if (!opened.ok()) return opened.status();
        streams_[index] = *std::move(opened);
      }
      stream = streams_[index].get();
    }
    absl::StatusOr<uint64_t> id = stream->Submit(batch);
    if (!id.ok()) return id;
    absl::MutexLock lock(&mu_);
    stream_of_[*id] = index;
    return id;
  }

  absl::StatusOr<BackwardResult> Next(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    absl::MutexLock lock(&mu_);
    while (true) {
      const uint64_t seen = completions_;
      bool any_outstanding = false;
      for (const std::unique_ptr<BackwardStream>& stream : streams_) {
        if (stream == nullptr) continue;
        absl::StatusOr<BackwardResult> result = stream->Next(absl::ZeroDuration());
        if (result.ok()) {
          stream_of_.erase(result->batch_id);
          return result;
        }
        if (!absl::IsOutOfRange(result.status())) any_outstanding = true;
      }
      if (!any_outstanding) return absl::OutOfRangeError("ShardedStream: no batches outstanding");
      while (completions_ == seen) {
        if (changed_.WaitWithDeadline(&mu_, deadline) && completions_ == seen) {
          return absl::DeadlineExceededError(absl::StrCat(
              "ShardedStream: no batch completed within ", absl::FormatDuration(timeout)));
        }
      }
    }
  }

  absl::StatusOr<BackwardResult> Await(uint64_t batch_id, absl::Duration timeout) {
    BackwardStream* stream = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto it = stream_of_.find(batch_id);
      if (it == stream_of_.end()) {
        return absl::NotFoundError(
            absl::StrCat("ShardedStream: batch ", batch_id, " is not outstanding"));
      }
      stream = streams_[it->second].get();
    }
    absl::StatusOr<BackwardResult> result = stream->Await(batch_id, timeout);
    if (!absl::IsDeadlineExceeded(result.status())) {
      absl::MutexLock lock(&mu_);
      stream_of_.erase(batch_id);
    }
    return result;
  }

  int64_t outstanding() const {
    absl::MutexLock lock(&mu_);
    int64_t total = 0;
    for (const std::unique_ptr<BackwardStream>& stream : streams_) {
      if (stream != nullptr) total += stream->outstanding();
    }
    return total;
  }

  absl::Status Finish() {
    std::vector<BackwardStream*> open;
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
      for (const std::unique_ptr<BackwardStream>& stream : streams_) {
        if (stream != nullptr) open.push_back(stream.get());
      }
    }
    absl::Status first;
    for (BackwardStream* stream : open) first.Update(stream->Finish());
    return first;
  }

  void Cancel() {
    absl::MutexLock lock(&mu_);
    for (const std::unique_ptr<BackwardStream>& stream : streams_) {
      if (stream != nullptr) stream->Cancel();
    }
  }

  ~Impl() {
    // The streams call back into this object until their reader threads end: end them first.
    std::vector<std::unique_ptr<BackwardStream>> streams;
    {
      absl::MutexLock lock(&mu_);
      streams.swap(streams_);
    }
    streams.clear();
  }

 private:
  const ShardedClient* const owner_;
  const std::vector<Client*> servers_;  // index = the map's
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::vector<std::unique_ptr<BackwardStream>> streams_ ABSL_GUARDED_BY(mu_);  // opened on demand
  std::unordered_map<uint64_t, size_t> stream_of_ ABSL_GUARDED_BY(mu_);        // batch id -> server
  uint64_t completions_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

ShardedStream::ShardedStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardedStream::~ShardedStream() = default;
absl::StatusOr<uint64_t> ShardedStream::Submit(const BackwardBatch& batch) {
  return impl_->Submit(batch);
}
absl::StatusOr<BackwardResult> ShardedStream::Next(absl::Duration timeout) {
  return impl_->Next(timeout);
}
absl::StatusOr<BackwardResult> ShardedStream::Await(uint64_t batch_id, absl::Duration timeout) {
  return impl_->Await(batch_id, timeout);
}
int64_t ShardedStream::outstanding() const { return impl_->outstanding(); }
absl::Status ShardedStream::Finish() { return impl_->Finish(); }
void ShardedStream::Cancel() { impl_->Cancel(); }

absl::StatusOr<std::unique_ptr<ShardedStream>> ShardedClient::StartStream() {
  std::vector<Client*> servers;
  for (const std::unique_ptr<Client>& server : servers_) servers.push_back(server.get());
  return std::unique_ptr<ShardedStream>(
      new ShardedStream(std::make_unique<ShardedStream::Impl>(this, std::move(servers))));
}

}  // namespace attngrad
