// CudaIpcMemoryOpener: cudaIpcOpenMemHandle on the region's GPU, the allocation's size from the
// driver (cuMemGetAddressRange, through the runtime's driver entry point: libcuda is not linked)
// for the bounds check, and one opening per handle shared by the regions that name it.
#include "devices/cuda_ipc_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attngrad::server {
namespace {

std::string CudaErrorText(cudaError_t error) {
  return absl::StrCat(cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

// One cudaIpcOpenMemHandle of one handle on one device; closed when destroyed.
class OpenedAllocation {
 public:
  OpenedAllocation(char* base, std::size_t size, int cuda_device)
      : base_(base), size_(size), cuda_device_(cuda_device) {}
  ~OpenedAllocation() {
    // The calling thread (a gRPC or worker thread, or the main thread at shutdown) may have
    // another current device.
    if (cudaSetDevice(cuda_device_) == cudaSuccess) cudaIpcCloseMemHandle(base_);
  }
  OpenedAllocation(const OpenedAllocation&) = delete;
  OpenedAllocation& operator=(const OpenedAllocation&) = delete;

  char* base() const { return base_; }
  std::size_t size() const { return size_; }
  int cuda_device() const { return cuda_device_; }

 private:
  char* const base_;
  const std::size_t size_;
  const int cuda_device_;
};

// A region: bytes [offset, offset + size) of an opened allocation.
class IpcRegion final : public RegionMemory {
 public:
  IpcRegion(std::shared_ptr<const OpenedAllocation> allocation, std::size_t offset,
            std::size_t size)
      : allocation_(std::move(allocation)), offset_(offset), size_(size) {}
  char* data() const override { return allocation_->base() + offset_; }
  std::size_t size() const override { return size_; }
  int cuda_device() const override { return allocation_->cuda_device(); }

 private:
  const std::shared_ptr<const OpenedAllocation> allocation_;
  const std::size_t offset_;
  const std::size_t size_;
};

// cuMemGetAddressRange: the base and size of the allocation holding a device pointer.
using GetAddressRange = CUresult (*)(CUdeviceptr* base, std::size_t* size, CUdeviceptr pointer);

class CudaIpcMemoryOpener final : public DeviceMemoryOpener {
 public:
  explicit CudaIpcMemoryOpener(std::vector<int> devices) : devices_(std::move(devices)) {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &function, 12000,
                                         cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      get_address_range_ = reinterpret_cast<GetAddressRange>(function);
    }
  }

  absl::StatusOr<std::unique_ptr<RegionMemory>> Open(const v1::CudaIpcMemory& memory,
                                                     std::int64_t byte_size) override {
    const int device = memory.device();
    if (std::find(devices_.begin(), devices_.end(), device) == devices_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda_ipc.device: ", device, " is not a GPU this server computes on (cuda:",
                       absl::StrJoin(devices_, ", cuda:"), "; --devices)"));
    }
    if (memory.handle().size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc.handle: ", memory.handle().size(), " bytes; expected ",
                       sizeof(cudaIpcMemHandle_t), " (a cudaIpcMemHandle_t)"));
    }
    if (memory.offset() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc.offset: ", memory.offset(), "; expected >= 0"));
    }
    std::shared_ptr<const OpenedAllocation> allocation;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = opened_.find(memory.handle());
      if (found != opened_.end()) allocation = found->second.lock();
      if (allocation == nullptr) {
        absl::StatusOr<std::shared_ptr<const OpenedAllocation>> opened =
            OpenHandle(memory.handle(), device);
        if (!opened.ok()) return opened.status();
        allocation = *std::move(opened);
        opened_[memory.handle()] = allocation;
        // Forget handles whose allocations were closed.
        for (auto entry = opened_.begin(); entry != opened_.end();) {
          entry = entry->second.expired() ? opened_.erase(entry) : std::next(entry);
        }
      }
    }
    if (allocation->cuda_device() != device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc.device: ", device, " but the memory is on cuda:", allocation->cuda_device(),
          " (as this server numbers its GPUs)"));
    }
    const std::uint64_t offset = static_cast<std::uint64_t>(memory.offset());
    const std::uint64_t size = static_cast<std::uint64_t>(byte_size);
    if (offset > allocation->size() || size > allocation->size() - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("byte_size: bytes [", offset, ", ", offset, " + ", size,
                       ") (cuda_ipc.offset, byte_size) are outside the GPU allocation of ",
                       allocation->size(), " bytes that cuda_ipc.handle names"));
    }
    return std::unique_ptr<RegionMemory>(new IpcRegion(
        std::move(allocation), static_cast<std::size_t>(offset), static_cast<std::size_t>(size)));
  }

 private:
  // Opens `handle` on `device` (caller holds mutex_).
  absl::StatusOr<std::shared_ptr<const OpenedAllocation>> OpenHandle(const std::string& handle,
                                                                     int device) {
    if (get_address_range_ == nullptr) {
      return absl::FailedPreconditionError(
          "cuda_ipc: the CUDA driver has no cuMemGetAddressRange, so the region's bounds cannot "
          "be checked");
    }
    cudaError_t error = cudaSetDevice(device);
    if (error != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("cudaSetDevice(", device, "): ", CudaErrorText(error)));
    }
    cudaIpcMemHandle_t ipc_handle;
    std::memcpy(&ipc_handle, handle.data(), sizeof(ipc_handle));
    void* base = nullptr;
    error = cudaIpcOpenMemHandle(&base, ipc_handle, cudaIpcMemLazyEnablePeerAccess);
    if (error != cudaSuccess) {
      cudaGetLastError();  // not a sticky error: clear it for the next call on this thread
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc.handle: cudaIpcOpenMemHandle failed: ", CudaErrorText(error),
          " (a handle of another process's live cudaMalloc allocation on the same host, from "
          "cudaIpcGetMemHandle or torch's storage._share_cuda_(), is expected)"));
    }
    CUdeviceptr range_base = 0;
    std::size_t range_size = 0;
    const CUresult range =
        get_address_range_(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base));
    cudaPointerAttributes attributes{};
    error = cudaPointerGetAttributes(&attributes, base);
    if (range != CUDA_SUCCESS || error != cudaSuccess ||
        range_base != reinterpret_cast<CUdeviceptr>(base)) {
      cudaGetLastError();
      cudaIpcCloseMemHandle(base);
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc.handle: the opened memory's extent or device is unknown "
          "(cuMemGetAddressRange ",
          static_cast<int>(range), ", cudaPointerGetAttributes ", CudaErrorText(error), ")"));
    }
    return std::make_shared<const OpenedAllocation>(static_cast<char*>(base), range_size,
                                                    attributes.device);
  }

  const std::vector<int> devices_;
  GetAddressRange get_address_range_ = nullptr;
  std::mutex mutex_;
  std::map<std::string, std::weak_ptr<const OpenedAllocation>> opened_;  // by handle bytes
};

}  // namespace

std::shared_ptr<DeviceMemoryOpener> MakeCudaIpcMemoryOpener(std::vector<int> devices) {
  return std::make_shared<CudaIpcMemoryOpener>(std::move(devices));
}

}  // namespace attngrad::server
