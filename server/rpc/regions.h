// Same-host regions: memory of same-host clients that batches name tensors in
// (BackwardRequest.*_region) instead of carrying their bytes. Host memory is a client's memfd
// sealed against shrinking, whose descriptor the client passed over the region socket
// (rpc/region_socket.h), mapped read-write into the server; GPU memory is a CUDA IPC memory handle,
// opened on the server's GPU (DeviceMemoryOpener), which the GPU worker of that device computes
// from and into directly. Each region belongs to the client id that registered it; a batch may only
// name its own client's regions, and only bytes inside them. A region stays mapped (open) while a
// batch that uses it is in flight, even after it is unregistered; the registry unmaps (closes) the
// rest when it is destroyed (server shutdown).
#ifndef ATTNGRAD_SERVER_REGIONS_H_
#define ATTNGRAD_SERVER_REGIONS_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attngrad/v1/attngrad.pb.h"
#include "rpc/backward_request.h"

namespace attngrad::server {

// The memory of one region; unmapped (closed) when destroyed.
class RegionMemory {
 public:
  virtual ~RegionMemory() = default;
  // The region's first byte: host memory, or a device pointer on cuda_device().
  virtual char* data() const = 0;
  virtual std::size_t size() const = 0;
  // The CUDA device of GPU memory; -1 for host memory.
  virtual int cuda_device() const { return -1; }
};

// One mapping of a client's memfd; unmapped when destroyed.
class MappedRegion final : public RegionMemory {
 public:
  // Maps the first `byte_size` bytes of `fd` read-write. The descriptor must be a memfd (a file of
  // the kernel's internal tmpfs) sealed against shrinking (F_SEAL_SHRINK) and at least that large:
  // then no access to the mapping can fault, whatever its owner does to the file afterwards (a
  // file that shrinks under a mapping makes the next access past its end raise SIGBUS). Nothing
  // else is mapped. INVALID_ARGUMENT naming `fd` or `byte_size` when it cannot; `fd` stays the
  // caller's (the mapping keeps the memory).
  static absl::StatusOr<std::unique_ptr<MappedRegion>> MapSealed(int fd, std::int64_t byte_size);
  ~MappedRegion() override;
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  char* data() const override { return data_; }
  std::size_t size() const override { return size_; }

 private:
  MappedRegion(char* data, std::size_t size) : data_(data), size_(size) {}
  char* const data_;
  const std::size_t size_;
};

// Opens clients' CUDA IPC memory handles on the server's GPUs (devices/cuda_ipc_memory.h).
class DeviceMemoryOpener {
 public:
  virtual ~DeviceMemoryOpener() = default;
  // Bytes [memory.offset, memory.offset + byte_size) of the allocation memory.handle names, open
  // on GPU memory.device until the result is destroyed. FAILED_PRECONDITION naming
  // cuda_ipc.device when this server does not compute on that GPU; INVALID_ARGUMENT naming the
  // field for a handle that does not open or bytes outside the allocation.
  virtual absl::StatusOr<std::unique_ptr<RegionMemory>> Open(const v1::CudaIpcMemory& memory,
                                                             std::int64_t byte_size) = 0;
};

// Bytes of a region that a batch uses; `region` keeps them mapped (open).
struct RegionBytes {
  std::shared_ptr<const RegionMemory> region;
  char* data = nullptr;  // a device pointer when cuda_device() >= 0
  std::size_t size = 0;
  int cuda_device() const { return region == nullptr ? -1 : region->cuda_device(); }
};

// Slices of a CUDA IPC region: their offset (and address) must be a multiple of this (the
// kernels read fp32 tensors with 16-byte vector loads).
inline constexpr std::size_t kDeviceRegionAlignment = 16;

// OK when `peer` (grpc::ServerContext::peer()) is a caller on the server's own host (loopback or a
// Unix socket); else PERMISSION_DENIED: a region is memory of a process on this host, so a caller
// from elsewhere can only name other programs' objects.
absl::Status CheckRegionCaller(absl::string_view peer);

class RegionRegistry {
 public:
  // `device_memory`: opens CUDA IPC regions; null on a server without GPUs (such a region is then
  // FAILED_PRECONDITION).
  explicit RegionRegistry(std::shared_ptr<DeviceMemoryOpener> device_memory = nullptr)
      : device_memory_(std::move(device_memory)) {}

  // Opens request.cuda_ipc (GPU memory) for `client_id`; the new region's id (never 0).
  // INVALID_ARGUMENT naming the field for a bad request. Host memory is not registered by name
  // (FAILED_PRECONDITION naming `name`, before anything is opened, so the answer does not tell
  // whether such an object exists): a name reaches any object the server's user may open.
  absl::StatusOr<std::uint64_t> Register(const std::string& client_id,
                                         const v1::RegisterRegionRequest& request);
  // Maps the memfd `fd` (MappedRegion::MapSealed) for `client_id`, owned by process `owner_pid`
  // (the region is removed once it has exited; 0: no owner). The new region's id (never 0).
  absl::StatusOr<std::uint64_t> RegisterSharedMemory(const std::string& client_id, int fd,
                                                     std::int64_t byte_size,
                                                     std::int64_t owner_pid);
  // INVALID_ARGUMENT for an unknown region or another client's.
  absl::Status Unregister(const std::string& client_id, std::uint64_t region_id);
  // Removes the regions whose owner process (RegisterRegionRequest.owner_pid) has exited (or whose
  // id now names another process); Register and Unregister do it too.
  void ForgetExitedOwners() const;

  // The bytes `slice` names, checked: a region of `client_id`, offset aligned to `alignment`
  // (kDeviceRegionAlignment at least in GPU memory), inside the region, and byte_size ==
  // `expected_bytes`; INVALID_ARGUMENT naming `field` (e.g. "hidden_states_region") otherwise.
  absl::StatusOr<RegionBytes> Resolve(const std::string& client_id, const v1::RegionSlice& slice,
                                      std::size_t alignment, std::size_t expected_bytes,
                                      absl::string_view field) const;

  std::size_t size() const;

 private:
  struct Entry {
    std::string client_id;
    std::shared_ptr<const RegionMemory> region;
    std::int64_t owner_pid = 0;  // 0: none
    std::string owner_start;     // the owner's start time (/proc/<pid>/stat), against pid reuse
  };
  // Stores a new region; its id.
  std::uint64_t Add(const std::string& client_id, std::unique_ptr<RegionMemory> memory,
                    std::int64_t owner_pid, std::string owner_start);

  const std::shared_ptr<DeviceMemoryOpener> device_memory_;
  mutable std::mutex mutex_;
  std::uint64_t next_id_ = 1;
  // Mutable: ForgetExitedOwners (const, called through the service's const accessor) prunes it.
  mutable std::map<std::uint64_t, Entry> regions_;
};

// Replaces the activations of a request that names hidden_states_region / grad_output_region with
// views of those bytes (WireTensors that keep the region mapped; WireTensor::OnDevice for GPU
// memory), checked against the tensor's dtype and shape. A tensor whose dtype or shape is itself
// wrong is left for ParseBackwardRequest to refuse. INVALID_ARGUMENT naming the field for any bad
// reference, for raw_data given too, or for GPU memory of two different devices.
absl::Status ReadActivationsFromRegions(const RegionRegistry& regions, const std::string& client_id,
                                        ReceivedBackwardRequest* request);

// The output slices a request names (unset: not asked), kept apart from the request, which moves
// into the job before they are resolved.
struct OutputSlices {
  std::optional<v1::RegionSlice> grad_hidden_states;  // grad_hidden_states_region
  std::optional<v1::RegionSlice> weight_gradients;    // weight_gradients_region
  std::optional<v1::RegionSlice> output;              // output_region (FORWARD batches)
  static OutputSlices Of(const v1::BackwardRequest& request);
};

// Where a batch's outputs go when its request names grad_hidden_states_region /
// weight_gradients_region / output_region: host memory, copied there from the answer buffer once
// the batch is done (CopyOutputsToRegions), or GPU memory, which the job's destinations
// (BatchJob::Request::DeviceDestination) name for the GPU worker to write. A FORWARD batch's output
// takes grad_hidden_states' place (the answer buffer's [B,S,hidden] tensor).
struct OutputRegions {
  std::optional<RegionBytes> grad_hidden_states;  // host memory (FORWARD: the output)
  std::optional<RegionBytes> weight_gradients;    // host memory
  bool grad_hidden_states_elsewhere = false;      // not in the response: in a region
  bool weight_gradients_elsewhere = false;
};

// Resolves the output slices of a parsed batch against the job's shapes and response dtype:
// INVALID_ARGUMENT naming the field for a bad reference, for weight_gradients_region with
// ACCUMULATE, for output_region in a backward batch (ParseBackwardRequest refuses it first), or
// for GPU memory of another GPU than the job's.
absl::StatusOr<OutputRegions> ResolveOutputRegions(const RegionRegistry& regions,
                                                   const std::string& client_id,
                                                   const OutputSlices& slices, BatchJob* job);

// Resolves a parsed batch's stream_order into job->stream_gate (its deadline `timeout` from now):
// both words 4 bytes of the client's GPU memory on the batch's GPU, which must itself read or write
// GPU memory (CUDA IPC). INVALID_ARGUMENT naming the field otherwise.
absl::Status ResolveStreamOrder(const RegionRegistry& regions, const std::string& client_id,
                                const v1::StreamOrder& order, std::chrono::seconds timeout,
                                BatchJob* job);

// Copies a finished job's outputs that go to host-memory regions out of its answer buffer.
void CopyOutputsToRegions(const OutputRegions& outputs, const BatchJob& job);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_REGIONS_H_
