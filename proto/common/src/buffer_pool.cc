// BufferPool: given-back buffers kept by capacity, up to a byte limit.
#include "attngrad/common/buffer_pool.h"

#include <utility>

#include "attngrad/common/host_memory.h"

namespace attngrad::common {

BufferPool::Buffer::Buffer(std::shared_ptr<BufferPool> pool, char* memory, std::size_t capacity,
                           std::size_t size)
    : pool_(std::move(pool)), memory_(memory), capacity_(capacity), size_(size) {}

BufferPool::Buffer& BufferPool::Buffer::operator=(Buffer&& other) {
  if (this != &other) {
    Release();
    pool_ = std::move(other.pool_);
    memory_ = other.memory_;
    other.memory_ = nullptr;
    capacity_ = other.capacity_;
    size_ = other.size_;
  }
  return *this;
}

BufferPool::Buffer::~Buffer() { Release(); }

void BufferPool::Buffer::Release() {
  if (pool_ != nullptr && memory_ != nullptr) pool_->GiveBack(memory_, capacity_);
  memory_ = nullptr;
  pool_.reset();
  capacity_ = size_ = 0;
}

std::shared_ptr<BufferPool> BufferPool::Create(std::size_t max_cached_bytes) {
  Allocator heap;
  heap.allocate = [](std::size_t size) {
    char* memory = new char[size == 0 ? 1 : size];
    AdviseHugePages(memory, size);
    return memory;
  };
  heap.free = [](char* memory) { delete[] memory; };
  return Create(max_cached_bytes, std::move(heap));
}

std::shared_ptr<BufferPool> BufferPool::Create(std::size_t max_cached_bytes, Allocator allocator) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes, std::move(allocator)));
}

BufferPool::~BufferPool() {
  // Every buffer holds the pool: only the kept ones are left.
  for (auto& [capacity, memory] : free_) allocator_.free(memory);
}

BufferPool::Buffer BufferPool::Acquire(std::size_t size) {
  {
    absl::MutexLock lock(&mu_);
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= 2 * size) {
      const std::size_t capacity = it->first;
      char* memory = it->second;
      free_.erase(it);
      cached_bytes_ -= capacity;
      return Buffer(shared_from_this(), memory, capacity, size);
    }
  }
  char* memory = allocator_.allocate(size);
  if (memory == nullptr) return Buffer();
  return Buffer(shared_from_this(), memory, size, size);
}

std::size_t BufferPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

void BufferPool::GiveBack(char* memory, std::size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    if (cached_bytes_ + capacity <= max_cached_bytes_) {
      cached_bytes_ += capacity;
      free_.emplace(capacity, memory);
      return;
    }
  }
  allocator_.free(memory);
}

}  // namespace attngrad::common
