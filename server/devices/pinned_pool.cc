// MakePinnedBufferPool: common::BufferPool over cudaHostAlloc / cudaFreeHost.
#include "devices/pinned_pool.h"

#include <cuda_runtime_api.h>

namespace attngrad::server {

std::shared_ptr<common::BufferPool> MakePinnedBufferPool(std::size_t max_cached_bytes) {
  common::BufferPool::Allocator pinned;
  pinned.allocate = [](std::size_t size) -> char* {
    void* memory = nullptr;
    if (cudaHostAlloc(&memory, size == 0 ? 1 : size, cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it so that no later call reports it
      return nullptr;
    }
    return static_cast<char*>(memory);
  };
  pinned.free = [](char* memory) { cudaFreeHost(memory); };
  return common::BufferPool::Create(max_cached_bytes, std::move(pinned));
}

}  // namespace attngrad::server
