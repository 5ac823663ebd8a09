// Stream counting and the idle-stream thread (see stream_registry.h).
#include "rpc/stream_registry.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attngrad::server {

absl::Status ShuttingDownError() {
  return absl::UnavailableError(
      "Backward: the server is shutting down; send the batches it did not answer again, with the "
      "same batch ids, once it (or another server) is serving");
}

StreamRegistry::StreamRegistry(StreamLimits limits) : limits_(limits) {
  if (limits_.idle_timeout > std::chrono::steady_clock::duration::zero()) {
    idle_thread_ = std::thread(&StreamRegistry::WatchIdleStreams, this);
  }
}

StreamRegistry::~StreamRegistry() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_requested_.notify_all();
  if (idle_thread_.joinable()) idle_thread_.join();
}

absl::Status StreamRegistry::Open(const std::string& client_id, IdleStream* stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (draining_) return ShuttingDownError();
  const auto mine = per_client_.find(client_id);
  const int held = mine == per_client_.end() ? 0 : mine->second;
  if (held >= limits_.max_streams_per_client) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Backward: client '", client_id, "' already has ", limits_.max_streams_per_client,
        " streams open (--max_streams_per_client); send more batches per stream or close some"));
  }
  IdleStream* evicted = nullptr;
  if (counted_streams_ >= limits_.max_streams) {
    evicted = EvictableLocked(client_id);
    if (evicted == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "Backward: the server already has ", limits_.max_streams,
          " streams open (--max_concurrent_streams), none of them idle and held by a client with "
          "more streams than '",
          client_id, "'; retry later or send more batches per stream"));
    }
    CountOutLocked(streams_.find(evicted));
  }
  ++per_client_[client_id];
  ++counted_streams_;
  streams_.emplace(stream, Entry{client_id, /*counted=*/true});
  lock.unlock();
  if (evicted != nullptr) evicted->FinishIdle();  // out of the registry: only this ends it
  return absl::OkStatus();
}

IdleStream* StreamRegistry::EvictableLocked(const std::string& client_id) {
  const auto mine = per_client_.find(client_id);
  const int held = mine == per_client_.end() ? 0 : mine->second;
  IdleStream* victim = nullptr;
  int victim_client_streams = held;
  std::chrono::steady_clock::time_point victim_idle_since;
  for (const auto& [candidate, entry] : streams_) {
    if (!entry.counted) continue;
    const int streams = per_client_[entry.client_id];
    // Only from a client that would still hold as many as this one: no stream goes back and
    // forth between two clients.
    if (streams < victim_client_streams || streams < held + 2) continue;
    const std::optional<std::chrono::steady_clock::time_point> idle_since = candidate->IdleSince();
    if (!idle_since.has_value()) continue;
    if (victim != nullptr && streams == victim_client_streams && *idle_since >= victim_idle_since) {
      continue;
    }
    victim = candidate;
    victim_client_streams = streams;
    victim_idle_since = *idle_since;
  }
  if (victim != nullptr && !victim->EvictIfIdle()) return nullptr;
  return victim;
}

void StreamRegistry::Watch(IdleStream* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  streams_.emplace(stream, Entry{std::string(), /*counted=*/false});
}

void StreamRegistry::Close(IdleStream* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto entry = streams_.find(stream);
  if (entry != streams_.end()) CountOutLocked(entry);
}

int StreamRegistry::open_streams() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counted_streams_;
}

void StreamRegistry::WatchIdleStreams() {
  // Checks a few times per timeout (at most once a second), so a stream ends between timeout and
  // timeout + the period.
  const auto period = std::min<std::chrono::steady_clock::duration>(limits_.idle_timeout / 4,
                                                                    std::chrono::seconds(1));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    stop_requested_.wait_for(lock, period, [this] { return stopping_; });
    if (stopping_) break;
    const auto now = std::chrono::steady_clock::now();
    EndMarkedStreams(lock, [this, now](IdleStream* stream) {
      return stream->ExpireIfIdle(now, limits_.idle_timeout);
    });
  }
}

StreamRegistry::Streams::iterator StreamRegistry::CountOutLocked(Streams::iterator entry) {
  if (entry->second.counted) {
    --counted_streams_;
    const auto count = per_client_.find(entry->second.client_id);
    if (count != per_client_.end() && --count->second <= 0) per_client_.erase(count);
  }
  return streams_.erase(entry);
}

void StreamRegistry::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  draining_ = true;
  EndMarkedStreams(lock, [](IdleStream* stream) { return stream->Drain(); });
}

void StreamRegistry::EndMarkedStreams(std::unique_lock<std::mutex>& lock,
                                      absl::FunctionRef<bool(IdleStream*)> mark) {
  std::vector<IdleStream*> marked;
  for (auto entry = streams_.begin(); entry != streams_.end();) {
    if (!mark(entry->first)) {
      ++entry;
      continue;
    }
    marked.push_back(entry->first);
    entry = CountOutLocked(entry);
  }
  // Out of the registry now: nothing but this thread ends them (their reactors stay alive until
  // they are finished), and finishing may call Close, which takes the lock.
  lock.unlock();
  for (IdleStream* stream : marked) stream->FinishIdle();
  lock.lock();
}

}  // namespace attngrad::server
