// MemoryBudget: counters under a mutex.
#include "scheduling/memory_budget.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace attngrad::server {
namespace {

std::int64_t PerClientLimit(std::int64_t limit_bytes, double share_per_client) {
  if (limit_bytes <= 0 || !(share_per_client > 0.0) || share_per_client >= 1.0) return limit_bytes;
  return std::max<std::int64_t>(
      1,
      static_cast<std::int64_t>(std::floor(static_cast<double>(limit_bytes) * share_per_client)));
}

}  // namespace

MemoryBudget::MemoryBudget(std::int64_t limit_bytes, double share_per_client)
    : limit_(limit_bytes), per_client_limit_(PerClientLimit(limit_bytes, share_per_client)) {}

MemoryBudget::Reservation& MemoryBudget::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = other.budget_;
    client_id_ = std::move(other.client_id_);
    bytes_ = other.bytes_;
    other.budget_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void MemoryBudget::Reservation::Release() {
  if (budget_ != nullptr && bytes_ != 0) budget_->Give(client_id_, bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

MemoryBudget::Reservation MemoryBudget::Reservation::Split(std::int64_t bytes) {
  bytes = std::min(bytes, bytes_);
  bytes_ -= bytes;
  return Reservation(budget_, client_id_, bytes);
}

absl::StatusOr<MemoryBudget::Reservation> MemoryBudget::Reserve(const std::string& client_id,
                                                                std::int64_t bytes,
                                                                absl::string_view what) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto mine = per_client_.find(client_id);
  const std::int64_t client_in_use = mine == per_client_.end() ? 0 : mine->second;
  if (per_client_limit_ > 0 && per_client_limit_ < limit_ && client_in_use > 0 &&
      client_in_use + bytes > per_client_limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", bytes, " bytes of host memory, but client '", client_id, "' holds ",
        client_in_use, " of its ", per_client_limit_,
        " bytes for data in flight (--max_inflight_share_per_client of --max_inflight_bytes) in "
        "requests and answers not yet read; read answers promptly, send smaller batches or fewer "
        "at once, then retry"));
  }
  if (limit_ > 0 && in_use_ > 0 && in_use_ + bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", bytes, " bytes of host memory, but ", in_use_, " of the server's ",
        limit_,
        " bytes for data in flight (--max_inflight_bytes) are taken by requests and answers not "
        "yet read; retry later, read answers promptly, send smaller batches or fewer at once, or "
        "raise --max_inflight_bytes"));
  }
  in_use_ += bytes;
  if (bytes != 0) per_client_[client_id] += bytes;
  return Reservation(this, client_id, bytes);
}

std::int64_t MemoryBudget::in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

std::int64_t MemoryBudget::in_use(const std::string& client_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto mine = per_client_.find(client_id);
  return mine == per_client_.end() ? 0 : mine->second;
}

void MemoryBudget::Give(const std::string& client_id, std::int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_ -= bytes;
  const auto mine = per_client_.find(client_id);
  if (mine != per_client_.end() && (mine->second -= bytes) <= 0) per_client_.erase(mine);
}

}  // namespace attngrad::server
