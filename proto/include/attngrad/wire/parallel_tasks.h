// Forwards to attngrad/common/parallel_tasks.h, where ParallelTasks lives, for code that still
// includes this path and names it wire::ParallelTasks.
#ifndef ATTNGRAD_WIRE_PARALLEL_TASKS_H_
#define ATTNGRAD_WIRE_PARALLEL_TASKS_H_

#include "attngrad/common/parallel_tasks.h"

namespace attngrad::wire {
using common::ParallelTasks;
}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_PARALLEL_TASKS_H_
