// The host staging of a batch's inputs for a GPU: the activations as received (fp32, fp16 or
// bf16; each value checked to be finite on the way) and the fp32 rotary tables, copied into one
// buffer laid out as the GPU copies it in, in floats: hidden_states | grad_output (a fp16/bf16
// tensor fills the first half of its part; a FORWARD batch has no grad_output part) | cos | sin.
// The GPU worker stages there itself (into its slots' page-locked buffers, on its copy threads), or
// a GPU server's receiving thread has done it on arrival (StageOnArrival, into
// BatchJob::Arrival::staged_inputs), so that the copies of several streams run at once, beside the
// worker instead of in front of it.
#ifndef ATTNGRAD_SERVER_STAGING_H_
#define ATTNGRAD_SERVER_STAGING_H_

#include <cstddef>

#include "absl/status/status.h"
#include "attngrad/common/buffer_pool.h"
#include "attngrad/common/parallel_tasks.h"
#include "scheduling/device_worker.h"

namespace attngrad::server {

// Activation tensors of the staging layout of `job`: 2 (hidden_states, grad_output), or 1 for a
// FORWARD batch (hidden_states); the rotary tables start at this many times job.activations().
std::size_t StagedActivationTensors(const BatchJob& job);
// Floats of the staging layout of `job`.
std::size_t StagingElements(const BatchJob& job);

// Copies the job's host inputs into `staging` (StagingElements floats), in parts of `part_bytes`
// on `threads` (null: on the calling thread). An activation tensor in GPU memory (CUDA IPC) is
// left out (its part of `staging` is not written). INVALID_ARGUMENT naming the first element that
// is not finite (the first failing part in order).
absl::Status CopyToStaging(const BatchJob& job, float* staging, common::ParallelTasks* threads,
                           std::size_t part_bytes);

// The job's inputs copied into a buffer of `pool` (page-locked memory) as
// BatchJob::Arrival::staged_inputs, in parts on `threads` (shared by the receiving threads: each
// takes part in its own copy), the received bytes let go, and the seconds it took in
// job.result.stages.copy_in. Nothing is done for a job with an activation in GPU memory, or when
// the pool cannot allocate the buffer (the worker stages such a job). Errors as CopyToStaging's.
absl::Status StageOnArrival(common::BufferPool& pool, common::ParallelTasks& threads,
                            BatchJob& job);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_STAGING_H_
