// The server-wide budget of in-flight host memory (--max_inflight_bytes): received batches, their
// answers until gRPC has sent them, LoadWeights staging and FetchGradients results. Memory is
// reserved when the data that needs it arrives (never ahead of it) and given back when its owner
// drops the Reservation; a reservation that does not fit is refused with RESOURCE_EXHAUSTED
// instead of growing the process. One reservation larger than the whole budget is admitted when
// nothing else is reserved, so that a batch up to --max_message_bytes can always be served alone.
#ifndef ATTNGRAD_SERVER_MEMORY_BUDGET_H_
#define ATTNGRAD_SERVER_MEMORY_BUDGET_H_

#include <cstdint>
#include <mutex>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attngrad::server {

class MemoryBudget {
 public:
  // limit_bytes <= 0: no limit (reservations are still counted).
  explicit MemoryBudget(std::int64_t limit_bytes) : limit_(limit_bytes) {}
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
    Reservation(MemoryBudget* budget, std::int64_t bytes) : budget_(budget), bytes_(bytes) {}
    MemoryBudget* budget_ = nullptr;
    std::int64_t bytes_ = 0;
  };

  // `bytes` for `what` (named in the refusal, e.g. "Backward batch 7"), or RESOURCE_EXHAUSTED
  // saying how much is in flight and what to do.
  absl::StatusOr<Reservation> Reserve(std::int64_t bytes, absl::string_view what);

  std::int64_t limit() const { return limit_; }
  std::int64_t in_use() const;

 private:
  void Give(std::int64_t bytes);

  const std::int64_t limit_;
  mutable std::mutex mutex_;
  std::int64_t in_use_ = 0;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_MEMORY_BUDGET_H_
