// Reusable host buffers for the big bytes that go on the wire (request payloads on the client,
// answers on the server). A fresh allocation of tens of MB is mapped page by page as it is first
// written (a page fault per 4 KiB, the kernel zeroing each page): for a 100 MB answer that costs
// more than copying it. A buffer given back to its pool is reused, already mapped.
#ifndef ATTNGRAD_WIRE_BUFFER_POOL_H_
#define ATTNGRAD_WIRE_BUFFER_POOL_H_

#include <cstddef>
#include <map>
#include <memory>

#include "absl/synchronization/mutex.h"

namespace attngrad::wire {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // A buffer of the pool; gives its memory back to the pool (or frees it, when the pool already
  // keeps max_cached_bytes) when destroyed. Keeps the pool alive.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&&) = default;
    Buffer& operator=(Buffer&& other);
    ~Buffer();

    char* data() const { return memory_.get(); }
    std::size_t size() const { return size_; }

   private:
    friend class BufferPool;
    Buffer(std::shared_ptr<BufferPool> pool, std::unique_ptr<char[]> memory, std::size_t capacity,
           std::size_t size);
    void Release();

    std::shared_ptr<BufferPool> pool_;
    std::unique_ptr<char[]> memory_;
    std::size_t capacity_ = 0;
    std::size_t size_ = 0;
  };

  // A pool that keeps up to `max_cached_bytes` of given-back buffers for reuse.
  static std::shared_ptr<BufferPool> Create(std::size_t max_cached_bytes);

  // A buffer of `size` bytes (contents unspecified): a kept one of at least that size and at most
  // twice it when there is one, else a new allocation.
  Buffer Acquire(std::size_t size);

  std::size_t cached_bytes() const;

 private:
  explicit BufferPool(std::size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
  void GiveBack(std::unique_ptr<char[]> memory, std::size_t capacity);

  const std::size_t max_cached_bytes_;
  mutable absl::Mutex mu_;
  std::multimap<std::size_t, std::unique_ptr<char[]>> free_ ABSL_GUARDED_BY(mu_);  // by capacity
  std::size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_BUFFER_POOL_H_
