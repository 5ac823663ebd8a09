// The budget of in-flight host memory (--max_inflight_bytes): received batches, their answers
// until gRPC has sent them, LoadWeights staging and FetchGradients results. Memory is reserved
// when the data that needs it arrives (never ahead of it) and given back when its owner drops the
// Reservation; a reservation that does not fit is refused with RESOURCE_EXHAUSTED instead of
// growing the process.
//
// Two limits apply to every reservation: the whole budget, and each client id's share of it
// (--max_inflight_share_per_client, a fraction of the budget), so that one client's batches,
// unread answers or unread fetches cannot take all of it and refuse everyone else. One
// reservation larger than a limit is admitted when nothing else is reserved under that limit, so
// that a batch up to --max_message_bytes can always be served alone.
#ifndef ATTNGRAD_SERVER_MEMORY_BUDGET_H_
#define ATTNGRAD_SERVER_MEMORY_BUDGET_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attngrad::server {

class MemoryBudget {
 public:
  // limit_bytes <= 0: no limit (reservations are still counted). share_per_client in (0, 1]:
  // the fraction of limit_bytes one client id may hold at once (1: no per-client limit).
  explicit MemoryBudget(std::int64_t limit_bytes, double share_per_client = 1.0);
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Bytes held until destroyed (or moved from).
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept { *this = std::move(other); }
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation() { Release(); }
    std::int64_t bytes() const { return bytes_; }
    void Release();
    // A reservation of `bytes` (at most bytes()) moved out of this one, to be given back apart.
    Reservation Split(std::int64_t bytes);

   private:
    friend class MemoryBudget;
    Reservation(MemoryBudget* budget, std::string client_id, std::int64_t bytes)
        : budget_(budget), client_id_(std::move(client_id)), bytes_(bytes) {}
    MemoryBudget* budget_ = nullptr;
    std::string client_id_;
    std::int64_t bytes_ = 0;
  };

  // `bytes` for client `client_id`'s `what` (named in the refusal, e.g. "Backward batch 7"), or
  // RESOURCE_EXHAUSTED saying which limit is reached, how much is in flight and what to do.
  absl::StatusOr<Reservation> Reserve(const std::string& client_id, std::int64_t bytes,
                                      absl::string_view what);

  std::int64_t limit() const { return limit_; }
  // The most one client id may hold (<= 0: no limit).
  std::int64_t per_client_limit() const { return per_client_limit_; }
  std::int64_t in_use() const;
  std::int64_t in_use(const std::string& client_id) const;

 private:
  void Give(const std::string& client_id, std::int64_t bytes);

  const std::int64_t limit_;
  const std::int64_t per_client_limit_;
  mutable std::mutex mutex_;
  std::int64_t in_use_ = 0;
  std::map<std::string, std::int64_t> per_client_;  // clients holding bytes only
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_MEMORY_BUDGET_H_
