// Forwards to attngrad/common/buffer_pool.h, where BufferPool lives, for code that still includes
// this path and names it wire::BufferPool.
#ifndef ATTNGRAD_WIRE_BUFFER_POOL_H_
#define ATTNGRAD_WIRE_BUFFER_POOL_H_

#include "attngrad/common/buffer_pool.h"

namespace attngrad::wire {
using common::BufferPool;
}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_BUFFER_POOL_H_
