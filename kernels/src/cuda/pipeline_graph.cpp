// Replay of a repeated backward call as one CUDA graph (see pipeline_graph.h).
#include "cuda/pipeline_graph.h"

#include "cuda/device_context.h"

namespace attngrad::cuda {

PipelineGraphCache::~PipelineGraphCache() {
  for (Entry& entry : entries_) {
    if (entry.exec != nullptr) cudaGraphExecDestroy(entry.exec);
  }
}

PipelineGraphCache::Entry* PipelineGraphCache::Find(const PipelineKey& key) {
  for (Entry& entry : entries_) {
    if (entry.key == key) return &entry;
  }
  return nullptr;
}

PipelineGraphCache::Entry* PipelineGraphCache::Insert(const PipelineKey& key) {
  if (entries_.size() >= static_cast<std::size_t>(kMaxEntries)) {
    auto oldest = entries_.begin();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->last_use < oldest->last_use) oldest = it;
    }
    // A graph still running finishes; the driver frees it afterwards.
    if (oldest->exec != nullptr) cudaGraphExecDestroy(oldest->exec);
    entries_.erase(oldest);
  }
  entries_.push_back(Entry{});
  entries_.back().key = key;
  return &entries_.back();
}

cudaGraphExec_t PipelineGraphCache::Build(const PipelineEnqueue& enqueue, DeviceContext* context) {
  // Both streams stay leased until the capture has ended, so no other call enqueues on them while
  // they are part of it.
  SideStreamLease capture_lease(context), side_lease(context);
  if (capture_lease.Acquire() != ATTNGRAD_OK || side_lease.Acquire() != ATTNGRAD_OK) {
    return nullptr;
  }
  const cudaStream_t capture = capture_lease.get()->stream();
  if (cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  const attngrad_status enqueued = enqueue(capture, side_lease.get());
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(capture, &graph);
  cudaGraphExec_t exec = nullptr;
  if (enqueued == ATTNGRAD_OK && ended == cudaSuccess && graph != nullptr &&
      cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority) != cudaSuccess) {
    exec = nullptr;
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();  // a failed capture must not leave an error for the direct path to see
  return exec;
}

attngrad_status PipelineGraphCache::Run(const PipelineKey& key, const PipelineEnqueue& enqueue,
                                        cudaStream_t stream, DeviceContext* context) {
  auto launch = [stream](cudaGraphExec_t exec) {
    return cudaGraphLaunch(exec, stream) == cudaSuccess ? ATTNGRAD_OK : ATTNGRAD_CUDA_ERROR;
  };
  bool build = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry* entry = Find(key);
    if (entry == nullptr) {
      Insert(key)->last_use = ++clock_;  // first sight: remembered, run directly
    } else {
      entry->last_use = ++clock_;
      // Launched under the lock so that no other thread can evict (destroy) it meanwhile.
      if (entry->exec != nullptr) return launch(entry->exec);
      build = !entry->direct_only;
    }
  }
  if (build) {
    // Captured outside the lock (it takes a while and runs nothing).
    cudaGraphExec_t exec = Build(enqueue, context);
    std::lock_guard<std::mutex> lock(mutex_);
    Entry* entry = Find(key);
    if (entry == nullptr) entry = Insert(key);
    entry->last_use = ++clock_;
    if (exec == nullptr) {
      entry->direct_only = entry->exec == nullptr;
    } else if (entry->exec == nullptr) {
      entry->exec = exec;
    } else {
      cudaGraphExecDestroy(exec);  // another thread built it first
    }
    if (entry->exec != nullptr) return launch(entry->exec);
  }
  return enqueue(stream, nullptr);
}

}  // namespace attngrad::cuda
