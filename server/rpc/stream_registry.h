// The streaming calls open: Backward streams are counted server-wide and per client
// (RESOURCE_EXHAUSTED beyond either limit); every streaming call (Backward, LoadWeights,
// FetchGradients) is closed by a background thread once it has made no progress for the idle
// timeout, so that calls a client leaves open cannot hold the server's stream slots or in-flight
// memory forever. At shutdown they are drained: a Backward stream with no batch in flight ends at
// once, the others once their batches are answered, so that streams a client keeps open do not
// hold the shutdown.
#ifndef ATTNGRAD_SERVER_RPC_STREAM_REGISTRY_H_
#define ATTNGRAD_SERVER_RPC_STREAM_REGISTRY_H_

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace attngrad::server {

// UNAVAILABLE: the server is shutting down (a stream opened or a batch sent after the shutdown
// began, and the end of a stream it drained), saying that unanswered batches may be sent again.
absl::Status ShuttingDownError();

// A stream the registry can close when idle or at shutdown (implemented by the Backward reactor).
class IdleStream {
 public:
  virtual ~IdleStream() = default;
  // True when the stream made no progress (no request read, no answer written) for `timeout` and
  // has no batch computing; it is then marked finished, so that nothing but FinishIdle ends it.
  // Called with the registry's lock held; must not call back into the registry.
  virtual bool ExpireIfIdle(std::chrono::steady_clock::time_point now,
                            std::chrono::steady_clock::duration timeout) = 0;
  // The shutdown began: the stream computes no new batch (one that arrives is answered with
  // ShuttingDownError) and ends once the batches it has are answered and their answers written.
  // True when it has none: it is then marked finished, so that nothing but FinishIdle ends it.
  // Called with the registry's lock held; must not call back into the registry.
  virtual bool Drain() = 0;
  // When the stream has no batch computing and no answer to write: the last time it made progress
  // (the server may close it to make room, below); nullopt when it is busy. Called with the
  // registry's lock held; must not call back into the registry.
  virtual std::optional<std::chrono::steady_clock::time_point> IdleSince() { return std::nullopt; }
  // Marks the stream finished, to be ended by FinishIdle with UNAVAILABLE saying that the server
  // closed it to make room for another client's stream, when it is still idle (IdleSince); false
  // otherwise. Called with the registry's lock held; must not call back into the registry.
  virtual bool EvictIfIdle() { return false; }
  // Ends a stream ExpireIfIdle or Drain marked: DEADLINE_EXCEEDED naming the idle timeout (a write
  // stuck on a client that does not read is cancelled first), or ShuttingDownError. Called without
  // the registry's lock.
  virtual void FinishIdle() = 0;
};

struct StreamLimits {
  int max_streams = 64;                                                          // server-wide
  int max_streams_per_client = 16;                                               // per client id
  std::chrono::steady_clock::duration idle_timeout = std::chrono::seconds(300);  // zero = none
};

class StreamRegistry {
 public:
  explicit StreamRegistry(StreamLimits limits);
  ~StreamRegistry();  // stops the idle thread
  StreamRegistry(const StreamRegistry&) = delete;
  StreamRegistry& operator=(const StreamRegistry&) = delete;

  // Counts the stream in (OK) or refuses it (RESOURCE_EXHAUSTED naming the limit reached, or
  // ShuttingDownError after Drain). When the server-wide limit is reached, an idle stream of the
  // client holding the most streams, if it holds at least two more than this client, is closed to
  // make room (the longest idle first): clients that open many streams, under as many client ids as
  // they like, cannot lock out a client that holds fewer.
  absl::Status Open(const std::string& client_id, IdleStream* stream);
  // Watches a call that the stream limits do not count (LoadWeights, FetchGradients) for the idle
  // timeout and the shutdown's drain.
  void Watch(IdleStream* stream);
  // Counts it out or stops watching it; does nothing when it is not counted in (refused, or
  // already ended as idle or at shutdown).
  void Close(IdleStream* stream);
  int open_streams() const;
  const StreamLimits& limits() const { return limits_; }
  // The shutdown began: refuses new streams and drains the open ones (IdleStream::Drain), ending
  // at once those with nothing in flight. Returns without waiting for the others.
  void Drain();

 private:
  struct Entry {
    std::string client_id;
    bool counted = true;  // a Backward stream (Open), not a watched call (Watch)
  };
  using Streams = std::map<IdleStream*, Entry>;  // open stream -> its client id

  void WatchIdleStreams();
  // The idle stream Open may close to make room for a stream of `client_id` (see Open); null when
  // none may be.
  IdleStream* EvictableLocked(const std::string& client_id);
  // Removes the stream from streams_ and per_client_; returns the entry after it.
  Streams::iterator CountOutLocked(Streams::iterator entry);
  // Counts out every stream that `mark` marks (called with the lock held) and ends them with
  // FinishIdle, without the lock (finishing may call Close). Returns with the lock held again.
  void EndMarkedStreams(std::unique_lock<std::mutex>& lock,
                        absl::FunctionRef<bool(IdleStream*)> mark);

  const StreamLimits limits_;
  mutable std::mutex mutex_;
  std::condition_variable stop_requested_;
  bool stopping_ = false;
  bool draining_ = false;  // the shutdown began: Open refuses
  Streams streams_;
  int counted_streams_ = 0;  // Backward streams in streams_
  std::map<std::string, int> per_client_;
  std::thread idle_thread_;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_STREAM_REGISTRY_H_
