// The Backward streams open: counted server-wide and per client (RESOURCE_EXHAUSTED beyond
// either limit), and closed by a background thread once they have made no progress for the idle
// timeout, so that streams a client leaves open cannot hold the server's stream slots forever.
#ifndef ATTNGRAD_SERVER_RPC_STREAM_REGISTRY_H_
#define ATTNGRAD_SERVER_RPC_STREAM_REGISTRY_H_

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"

namespace attngrad::server {

// A stream the registry can close when idle (implemented by the Backward reactor).
class IdleStream {
 public:
  virtual ~IdleStream() = default;
  // True when the stream made no progress (no request read, no answer written) for `timeout` and
  // has no batch computing; it is then marked finished, so that nothing but FinishIdle ends it.
  // Called with the registry's lock held; must not call back into the registry.
  virtual bool ExpireIfIdle(std::chrono::steady_clock::time_point now,
                            std::chrono::steady_clock::duration timeout) = 0;
  // Ends a stream ExpireIfIdle marked (DEADLINE_EXCEEDED naming the idle timeout; a write stuck on
  // a client that does not read is cancelled first). Called without the registry's lock.
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

  // Counts the stream in (OK) or refuses it (RESOURCE_EXHAUSTED naming the limit reached).
  absl::Status Open(const std::string& client_id, IdleStream* stream);
  // Counts it out; does nothing when it is not counted in (refused, or already closed as idle).
  void Close(const std::string& client_id, IdleStream* stream);
  int open_streams() const;
  const StreamLimits& limits() const { return limits_; }

 private:
  void WatchIdleStreams();

  const StreamLimits limits_;
  mutable std::mutex mutex_;
  std::condition_variable stop_requested_;
  bool stopping_ = false;
  std::map<IdleStream*, std::string> streams_;  // open stream -> its client id
  std::map<std::string, int> per_client_;
  std::thread idle_thread_;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_STREAM_REGISTRY_H_
