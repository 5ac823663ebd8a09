// Buffer pools of page-locked host memory (cudaHostAlloc, usable by every device): the GPU copies
// to and from it directly and asynchronously, so a batch's bytes need no further host copy between
// the wire and the GPU. Each buffer is allocated (and locked) once and reused (common::BufferPool).
#ifndef ATTNGRAD_SERVER_PINNED_POOL_H_
#define ATTNGRAD_SERVER_PINNED_POOL_H_

#include <cstddef>
#include <memory>

#include "attngrad/common/buffer_pool.h"

namespace attngrad::server {

// A pool keeping up to `max_cached_bytes` of page-locked buffers for reuse; a buffer it cannot
// allocate has data() null.
std::shared_ptr<common::BufferPool> MakePinnedBufferPool(std::size_t max_cached_bytes);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_PINNED_POOL_H_
