// Replay of a repeated backward call as one CUDA graph. Internal to kernels/.
//
// A training loop or a server worker calls attngrad_backward again and again with the same buffers.
// Enqueued kernel by kernel, each of the pipeline's ~16 dependent launches costs the GPU ~2 µs of
// launch gap; replayed from an instantiated CUDA graph, ~1 µs (measured on the H200,
// bench/history/RESULTS-log.md). So the first time a call's arguments (every pointer, shape, mode
// and scalar) are seen the pipeline is enqueued directly; the second time it is captured once on a
// private stream, instantiated, and launched as a graph on the caller's stream; later calls with
// the same arguments launch that graph. Inputs are read at replay time, so new contents in the same
// buffers are used as they should be. A call whose stream is itself being captured never comes here
// (the caller's graph already has the kernels). Capture or instantiation failures fall back to the
// direct path for that key, for good.
#ifndef ATTNGRAD_KERNELS_CUDA_PIPELINE_GRAPH_H_
#define ATTNGRAD_KERNELS_CUDA_PIPELINE_GRAPH_H_

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "attngrad/attngrad.h"

namespace attngrad::cuda {

class DeviceContext;
class SideStream;

// Every argument of one call, as 64-bit words (pointers, ints, float bits).
inline constexpr int kPipelineKeyWords = 36;
using PipelineKey = std::array<std::uint64_t, kPipelineKeyWords>;

// Enqueues the whole pipeline on `stream`; `side`, when not null, is the second stream it must use
// (held by the caller for the whole capture).
using PipelineEnqueue = std::function<attngrad_status(cudaStream_t stream, SideStream* side)>;

class PipelineGraphCache {
 public:
  PipelineGraphCache() = default;
  PipelineGraphCache(const PipelineGraphCache&) = delete;
  PipelineGraphCache& operator=(const PipelineGraphCache&) = delete;
  ~PipelineGraphCache();

  // Runs the call identified by `key` on `stream`: directly (enqueue(stream, nullptr)) the first
  // time, from a graph after that, as the header comment says.
  // `context` lends the two pooled streams a capture needs.
  attngrad_status Run(const PipelineKey& key, const PipelineEnqueue& enqueue, cudaStream_t stream,
                      DeviceContext* context);

  // Entries kept (least recently used dropped first; a dropped graph still in flight finishes).
  static constexpr int kMaxEntries = 16;

 private:
  struct Entry {
    PipelineKey key{};
    cudaGraphExec_t exec = nullptr;
    bool direct_only = false;  // capture failed once: always enqueue directly
    std::uint64_t last_use = 0;
  };
  Entry* Find(const PipelineKey& key);    // with mutex_ held
  Entry* Insert(const PipelineKey& key);  // with mutex_ held; may evict
  // Captures and instantiates the pipeline; nullptr on any failure (errors cleared).
  cudaGraphExec_t Build(const PipelineEnqueue& enqueue, DeviceContext* context);

  std::mutex mutex_;
  std::vector<Entry> entries_;
  std::uint64_t clock_ = 0;
};

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_PIPELINE_GRAPH_H_
