// CUDA resources owned by types (header-only, CUDA runtime only): a typed device buffer, a pinned
// host buffer, a stream and an event. Each is move-only and releases what it owns in its destructor
// and nowhere else (cudaFree, cudaFreeHost, cudaStreamDestroy, cudaEventDestroy), the way CUTLASS's
// DeviceAllocation does. Creation reports the CUDA error: `static cudaError_t Create(..., T* out)`
// replaces *out (whatever it held is released) only on success.
//
//   attngrad::cuda::DeviceBuffer<float> weights;
//   if (cudaError_t error = attngrad::cuda::DeviceBuffer<float>::Create(count, &weights)) ...
//   kernel<<<blocks, threads, 0, stream.get()>>>(weights.get());
//
// The library's own pipeline never allocates (its memory is the caller's workspace); these are for
// its callers: the server, the tests and the benchmarks.
#ifndef ATTNGRAD_CUDA_RESOURCES_H_
#define ATTNGRAD_CUDA_RESOURCES_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>
#include <utility>

namespace attngrad::cuda {

// Where a buffer lives.
enum class MemoryKind { kDevice, kPinnedHost };

// `size()` elements of T in memory of `kKind`, released in the destructor.
template <typename T, MemoryKind kKind>
class OwnedBuffer {
 public:
  OwnedBuffer() = default;
  OwnedBuffer(const OwnedBuffer&) = delete;
  OwnedBuffer& operator=(const OwnedBuffer&) = delete;
  OwnedBuffer(OwnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  OwnedBuffer& operator=(OwnedBuffer&& other) noexcept {
    std::swap(data_, other.data_);  // what this held is released with `other`
    std::swap(size_, other.size_);
    return *this;
  }
  ~OwnedBuffer() {
    if (data_ == nullptr) return;
    if constexpr (kKind == MemoryKind::kDevice) {
      cudaFree(data_);
    } else {
      cudaFreeHost(data_);
    }
  }

  // `count` elements (at least one is allocated, so that the pointer is never null), contents
  // undefined. On failure *buffer is left as it was.
  static cudaError_t Create(std::size_t count, OwnedBuffer* buffer) {
    void* pointer = nullptr;
    const std::size_t bytes = (count > 0 ? count : 1) * sizeof(T);
    const cudaError_t error = kKind == MemoryKind::kDevice ? cudaMalloc(&pointer, bytes)
                                                           : cudaMallocHost(&pointer, bytes);
    if (error != cudaSuccess) return error;
    OwnedBuffer created;
    created.data_ = static_cast<T*>(pointer);
    created.size_ = count;
    *buffer = std::move(created);
    return cudaSuccess;
  }

  T* get() const { return data_; }
  T* data() const { return data_; }
  std::size_t size() const { return size_; }  // elements
  std::size_t bytes() const { return size_ * sizeof(T); }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// Device memory of the current device (cudaMalloc / cudaFree).
template <typename T>
using DeviceBuffer = OwnedBuffer<T, MemoryKind::kDevice>;

// Page-locked host memory (cudaMallocHost / cudaFreeHost): what asynchronous copies need.
template <typename T>
using PinnedBuffer = OwnedBuffer<T, MemoryKind::kPinnedHost>;

// The common part of a stream and an event: one CUDA handle, released in the destructor.
template <typename Handle>
class OwnedHandle {
 public:
  OwnedHandle() = default;
  OwnedHandle(const OwnedHandle&) = delete;
  OwnedHandle& operator=(const OwnedHandle&) = delete;
  OwnedHandle(OwnedHandle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  OwnedHandle& operator=(OwnedHandle&& other) noexcept {
    std::swap(handle_, other.handle_);  // what this held is released with `other`
    return *this;
  }
  ~OwnedHandle() {
    if (handle_ == nullptr) return;
    if constexpr (std::is_same_v<Handle, cudaStream_t>) {
      cudaStreamDestroy(handle_);
    } else {
      cudaEventDestroy(handle_);
    }
  }
  Handle get() const { return handle_; }

 protected:
  // Takes ownership of a handle just created (or reports `error`, leaving *owner as it was). The
  // creation must have run before: `handle` is taken by value.
  static cudaError_t Adopt(cudaError_t error, Handle handle, OwnedHandle* owner) {
    if (error != cudaSuccess) return error;
    OwnedHandle created;
    created.handle_ = handle;
    *owner = std::move(created);
    return cudaSuccess;
  }

 private:
  Handle handle_ = nullptr;
};

// A CUDA stream of the current device (non-blocking by default, so that it does not wait for the
// legacy default stream).
class Stream : public OwnedHandle<cudaStream_t> {
 public:
  static cudaError_t Create(Stream* stream, unsigned int flags = cudaStreamNonBlocking) {
    cudaStream_t handle = nullptr;
    const cudaError_t error = cudaStreamCreateWithFlags(&handle, flags);
    return Adopt(error, handle, stream);
  }
  // With a scheduling priority (lower numbers are greater priorities:
  // cudaDeviceGetStreamPriorityRange).
  static cudaError_t CreateWithPriority(Stream* stream, int priority,
                                        unsigned int flags = cudaStreamNonBlocking) {
    cudaStream_t handle = nullptr;
    const cudaError_t error = cudaStreamCreateWithPriority(&handle, flags, priority);
    return Adopt(error, handle, stream);
  }
};

// A CUDA event (timing by default; cudaEventDisableTiming for pure ordering).
class Event : public OwnedHandle<cudaEvent_t> {
 public:
  static cudaError_t Create(Event* event, unsigned int flags = cudaEventDefault) {
    cudaEvent_t handle = nullptr;
    const cudaError_t error = cudaEventCreateWithFlags(&handle, flags);
    return Adopt(error, handle, event);
  }
};

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_CUDA_RESOURCES_H_
