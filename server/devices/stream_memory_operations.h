// The CUDA driver's stream memory write (cuStreamWriteValue32), with which the server tells a
// client's CUDA stream that a stream-ordered batch (BackwardRequest.stream_order) is done: a stream
// writes a 32-bit word in GPU memory after its earlier work. It is looked up through the runtime
// (cudaGetDriverEntryPointByVersion), so the server links no libcuda and still starts on a machine
// without a GPU driver. (The server never waits on a client's word on the GPU: it polls it, see
// GpuWorker's gates.)
#ifndef ATTNGRAD_SERVER_DEVICES_STREAM_MEMORY_OPERATIONS_H_
#define ATTNGRAD_SERVER_DEVICES_STREAM_MEMORY_OPERATIONS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace attngrad::server {

class StreamMemoryOperations {
 public:
  // Looks the entry point up (on the calling thread's device); usable() says whether the driver
  // has it.
  StreamMemoryOperations();

  bool usable() const { return write_value_ != nullptr; }

  // Queues on `stream`: write `value` to the word at `address` once the stream's earlier work is
  // done and visible (the driver's default write is preceded by a memory fence).
  absl::Status Write(cudaStream_t stream, void* address, std::uint32_t value) const;

 private:
  // CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int), without including cuda.h.
  using ValueOperation = int (*)(cudaStream_t, unsigned long long, std::uint32_t, unsigned int);
  ValueOperation write_value_ = nullptr;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_DEVICES_STREAM_MEMORY_OPERATIONS_H_
