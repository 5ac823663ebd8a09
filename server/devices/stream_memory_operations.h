// The CUDA driver's stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32), which
// order a batch by a client's CUDA stream (BackwardRequest.stream_order): a stream waits until a
// 32-bit word in GPU memory reaches a value, or writes one after its earlier work. They are looked
// up through the runtime (cudaGetDriverEntryPointByVersion), so the server links no libcuda and
// still starts on a machine without a GPU driver.
#ifndef ATTNGRAD_SERVER_DEVICES_STREAM_MEMORY_OPERATIONS_H_
#define ATTNGRAD_SERVER_DEVICES_STREAM_MEMORY_OPERATIONS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace attngrad::server {

class StreamMemoryOperations {
 public:
  // Looks the two entry points up (on the calling thread's device); usable() says whether the
  // driver has them.
  StreamMemoryOperations();

  bool usable() const { return wait_value_ != nullptr && write_value_ != nullptr; }

  // Queues on `stream`: wait until the word at `address` reaches `value` in wrap-around order
  // ((int32_t)(word - value) >= 0, CU_STREAM_WAIT_VALUE_GEQ).
  absl::Status WaitUntilReached(cudaStream_t stream, const void* address,
                                std::uint32_t value) const;
  // Queues on `stream`: write `value` to the word at `address` once the stream's earlier work is
  // done and visible (the driver's default write is preceded by a memory fence).
  absl::Status Write(cudaStream_t stream, void* address, std::uint32_t value) const;

 private:
  // CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int), without including cuda.h.
  using ValueOperation = int (*)(cudaStream_t, unsigned long long, std::uint32_t, unsigned int);
  ValueOperation wait_value_ = nullptr;
  ValueOperation write_value_ = nullptr;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_DEVICES_STREAM_MEMORY_OPERATIONS_H_
