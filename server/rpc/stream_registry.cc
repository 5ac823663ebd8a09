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
  std::lock_guard<std::mutex> lock(mutex_);
  if (draining_) return ShuttingDownError();
  if (static_cast<int>(streams_.size()) >= limits_.max_streams) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Backward: the server already has ", limits_.max_streams,
        " streams open (--max_concurrent_streams); retry later or send more batches per stream"));
  }
  int& mine = per_client_[client_id];
  if (mine >= limits_.max_streams_per_client) {
    if (mine == 0) per_client_.erase(client_id);
    return absl::ResourceExhaustedError(absl::StrCat(
        "Backward: client '", client_id, "' already has ", limits_.max_streams_per_client,
        " streams open (--max_streams_per_client); send more batches per stream or close some"));
  }
  ++mine;
  streams_.emplace(stream, client_id);
  return absl::OkStatus();
}

void StreamRegistry::Close(IdleStream* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto entry = streams_.find(stream);
  if (entry != streams_.end()) CountOutLocked(entry);
}

int StreamRegistry::open_streams() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(streams_.size());
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
  const auto count = per_client_.find(entry->second);
  if (count != per_client_.end() && --count->second <= 0) per_client_.erase(count);
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
