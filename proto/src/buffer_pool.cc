// BufferPool: given-back buffers kept by capacity, up to a byte limit.
#include "attngrad/wire/buffer_pool.h"

#include <utility>

#include "attngrad/wire/host_memory.h"

namespace attngrad::wire {

BufferPool::Buffer::Buffer(std::shared_ptr<BufferPool> pool, std::unique_ptr<char[]> memory,
                           std::size_t capacity, std::size_t size)
    : pool_(std::move(pool)), memory_(std::move(memory)), capacity_(capacity), size_(size) {}

BufferPool::Buffer& BufferPool::Buffer::operator=(Buffer&& other) {
  if (this != &other) {
    Release();
    pool_ = std::move(other.pool_);
    memory_ = std::move(other.memory_);
    capacity_ = other.capacity_;
    size_ = other.size_;
  }
  return *this;
}

BufferPool::Buffer::~Buffer() { Release(); }

void BufferPool::Buffer::Release() {
  if (pool_ != nullptr && memory_ != nullptr) pool_->GiveBack(std::move(memory_), capacity_);
  memory_.reset();
  pool_.reset();
  capacity_ = size_ = 0;
}

std::shared_ptr<BufferPool> BufferPool::Create(std::size_t max_cached_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes));
}

BufferPool::Buffer BufferPool::Acquire(std::size_t size) {
  {
    absl::MutexLock lock(&mu_);
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= 2 * size) {
      const std::size_t capacity = it->first;
      std::unique_ptr<char[]> memory = std::move(it->second);
      free_.erase(it);
      cached_bytes_ -= capacity;
      return Buffer(shared_from_this(), std::move(memory), capacity, size);
    }
  }
  std::unique_ptr<char[]> memory(new char[size == 0 ? 1 : size]);
  AdviseHugePages(memory.get(), size);
  return Buffer(shared_from_this(), std::move(memory), size, size);
}

std::size_t BufferPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

void BufferPool::GiveBack(std::unique_ptr<char[]> memory, std::size_t capacity) {
  absl::MutexLock lock(&mu_);
  if (cached_bytes_ + capacity > max_cached_bytes_) return;  // freed
  cached_bytes_ += capacity;
  free_.emplace(capacity, std::move(memory));
}

}  // namespace attngrad::wire
