// MemoryBudget: a counter under a mutex.
#include "scheduling/memory_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace attngrad::server {

MemoryBudget::Reservation& MemoryBudget::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = other.budget_;
    bytes_ = other.bytes_;
    other.budget_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void MemoryBudget::Reservation::Release() {
  if (budget_ != nullptr && bytes_ != 0) budget_->Give(bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

MemoryBudget::Reservation MemoryBudget::Reservation::Split(std::int64_t bytes) {
  bytes = std::min(bytes, bytes_);
  bytes_ -= bytes;
  return Reservation(budget_, bytes);
}

absl::StatusOr<MemoryBudget::Reservation> MemoryBudget::Reserve(std::int64_t bytes,
                                                                absl::string_view what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (limit_ > 0 && in_use_ > 0 && in_use_ + bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", bytes, " bytes of host memory, but ", in_use_, " of the server's ",
        limit_,
        " bytes for data in flight (--max_inflight_bytes) are taken by requests and answers not "
        "yet read; retry later, read answers promptly, send smaller batches or fewer at once, or "
        "raise --max_inflight_bytes"));
  }
  in_use_ += bytes;
  return Reservation(this, bytes);
}

std::int64_t MemoryBudget::in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

void MemoryBudget::Give(std::int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_ -= bytes;
}

}  // namespace attngrad::server
