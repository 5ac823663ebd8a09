// Reusable host buffers for the big bytes that go on the wire (request payloads on the client,
// answers on the server). A fresh allocation of tens of MB is mapped page by page as it is first
// written (a page fault per 4 KiB, the kernel zeroing each page): for a 100 MB answer that costs
// more than copying it. A buffer given back to its pool is reused, already mapped. A pool may take
// its memory from another allocator (the GPU server's page-locked memory, which the GPU copies to
// and from directly: devices/pinned_pool.h), made once per buffer and reused the same way.
#ifndef ATTNGRAD_COMMON_BUFFER_POOL_H_
#define ATTNGRAD_COMMON_BUFFER_POOL_H_

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace attngrad::common {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Where a pool's memory comes from: `allocate` returns `size` bytes (null when it cannot) and
  // `free` gives back what it returned.
  struct Allocator {
    std::function<char*(std::size_t size)> allocate;
    std::function<void(char* data)> free;
  };

  // A buffer of the pool; gives its memory back to the pool (or frees it, when the pool already
  // keeps max_cached_bytes) when destroyed. Keeps the pool alive.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& other) { *this = std::move(other); }
    Buffer& operator=(Buffer&& other);
    ~Buffer();

    // Null only for a default-made buffer, or when the pool's allocator failed.
    char* data() const { return memory_; }
    std::size_t size() const { return size_; }

   private:
    friend class BufferPool;
    Buffer(std::shared_ptr<BufferPool> pool, char* memory, std::size_t capacity, std::size_t size);
    void Release();

    std::shared_ptr<BufferPool> pool_;
    char* memory_ = nullptr;
    std::size_t capacity_ = 0;
    std::size_t size_ = 0;
  };

  // A pool that keeps up to `max_cached_bytes` of given-back buffers for reuse; its memory is
  // ordinary heap memory advised to use huge pages (host_memory.h).
  static std::shared_ptr<BufferPool> Create(std::size_t max_cached_bytes);
  // The same with memory from `allocator`.
  static std::shared_ptr<BufferPool> Create(std::size_t max_cached_bytes, Allocator allocator);
  ~BufferPool();

  // A buffer of `size` bytes (contents unspecified): a kept one of at least that size and at most
  // twice it when there is one, else a new allocation (data() null when the allocator failed).
  Buffer Acquire(std::size_t size);

  std::size_t cached_bytes() const;

 private:
  BufferPool(std::size_t max_cached_bytes, Allocator allocator)
      : max_cached_bytes_(max_cached_bytes), allocator_(std::move(allocator)) {}
  void GiveBack(char* memory, std::size_t capacity);

  const std::size_t max_cached_bytes_;
  const Allocator allocator_;
  mutable absl::Mutex mu_;
  std::multimap<std::size_t, char*> free_ ABSL_GUARDED_BY(mu_);  // by capacity; allocator_'s
  std::size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attngrad::common

#endif  // ATTNGRAD_COMMON_BUFFER_POOL_H_
