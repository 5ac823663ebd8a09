// RegionRegistry: mmap of the clients' sealed memfds, CUDA IPC memory through
// the DeviceMemoryOpener, and the checks of every reference into them.
#include "rpc/regions.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attngrad/common/read_file.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "rpc/auth.h"

namespace attngrad::server {

namespace {

// The start time of process `pid` (field 22 of /proc/<pid>/stat, in clock ticks since boot);
// NOT_FOUND when there is no such process.
absl::StatusOr<std::string> ProcessStartTime(std::int64_t pid) {
  if (pid <= 0) return absl::NotFoundError("no process");
  const absl::StatusOr<std::string> text =
      common::ReadFileToString(absl::StrCat("/proc/", pid, "/stat"));
  if (!text.ok()) return absl::NotFoundError("no process");
  const std::size_t name_end = text->rfind(')');  // the command name may hold spaces
  if (name_end == std::string::npos) return absl::NotFoundError("no process");
  const std::vector<std::string> fields =
      absl::StrSplit(text->substr(name_end + 1), ' ', absl::SkipEmpty());
  constexpr std::size_t kStartTime = 22 - 3;  // fields after the name start at field 3 (state)
  if (fields.size() <= kStartTime) return absl::NotFoundError("no process");
  return fields[kStartTime];
}

}  // namespace

absl::Status CheckRegionCaller(absl::string_view peer) {
  if (IsLoopbackPeer(peer)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "RegisterRegion: regions are memory of processes on the server's own host, and this call "
      "came from ",
      peer, "; send the tensors' bytes instead (transport \"bytes\")"));
}

absl::StatusOr<std::unique_ptr<MappedRegion>> MappedRegion::MapSealed(int fd,
                                                                      std::int64_t byte_size) {
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: ", byte_size, "; expected > 0 bytes"));
  }
  struct stat file {};
  struct statfs file_system {};
  if (fstat(fd, &file) != 0 || !S_ISREG(file.st_mode) || fstatfs(fd, &file_system) != 0 ||
      file_system.f_type != TMPFS_MAGIC) {
    return absl::InvalidArgumentError(
        "fd: not a memfd; expected the descriptor of memfd_create(MFD_ALLOW_SEALING) memory "
        "sealed with F_SEAL_SHRINK");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "fd: the memfd is not sealed against shrinking; add F_SEAL_SHRINK (fcntl F_ADD_SEALS) "
        "before passing it: memory that can shrink under the server's mapping would make its "
        "reads fault");
  }
  // Sealed: the size read now can only grow.
  if (fstat(fd, &file) != 0 || file.st_size < byte_size) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: ", byte_size,
                                                   " bytes exceed the memfd's ",
                                                   static_cast<std::int64_t>(file.st_size)));
  }
  void* data =
      mmap(nullptr, static_cast<std::size_t>(byte_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    return absl::InvalidArgumentError(
        absl::StrCat("fd: cannot map the memfd read-write (", std::strerror(error),
                     "); pass a descriptor opened read-write and not sealed against writing"));
  }
  return std::unique_ptr<MappedRegion>(
      new MappedRegion(static_cast<char*>(data), static_cast<std::size_t>(byte_size)));
}

MappedRegion::~MappedRegion() { munmap(data_, size_); }

absl::StatusOr<std::uint64_t> RegionRegistry::Register(const std::string& client_id,
                                                       const v1::RegisterRegionRequest& request) {
  ForgetExitedOwners();
  absl::StatusOr<std::string> owner_start = std::string();
  if (request.owner_pid() != 0) {
    owner_start = ProcessStartTime(request.owner_pid());
    if (!owner_start.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "owner_pid: ", request.owner_pid(),
          " is no process this server can see (same host and PID namespace); leave it 0"));
    }
  }
  std::unique_ptr<RegionMemory> memory;
  if (request.has_cuda_ipc()) {
    if (!request.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "name: \"", request.name(),
          "\" given together with cuda_ipc; expected one of them (host or GPU memory)"));
    }
    if (device_memory_ == nullptr) {
      return absl::FailedPreconditionError(
          "cuda_ipc: this server computes on the CPU (--devices=cpu), so it cannot open GPU "
          "memory; register host memory (name) instead, or use a server on the GPU");
    }
    if (request.byte_size() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("byte_size: ", request.byte_size(), "; expected > 0 bytes"));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(memory,
                              device_memory_->Open(request.cuda_ipc(), request.byte_size()));
  } else {
    return absl::FailedPreconditionError(
        "name: host memory is not registered by name (a name could reach any shared-memory "
        "object of the server's user, and such an object can shrink under the server's "
        "mapping); create a memfd, seal it against shrinking and pass its descriptor over the "
        "server's region socket (--region_socket; the Python client's register_region and "
        "attngrad::SharedMemoryRegion do)");
  }
  return Add(client_id, std::move(memory), request.owner_pid(), *std::move(owner_start));
}

absl::StatusOr<std::uint64_t> RegionRegistry::RegisterSharedMemory(const std::string& client_id,
                                                                   int fd, std::int64_t byte_size,
                                                                   std::int64_t owner_pid) {
  ForgetExitedOwners();
  // An owner the server cannot see (another PID namespace) is not tracked.
  absl::StatusOr<std::string> owner_start = ProcessStartTime(owner_pid);
  ATTNGRAD_ASSIGN_OR_RETURN(std::unique_ptr<MappedRegion> memory,
                            MappedRegion::MapSealed(fd, byte_size));
  return Add(client_id, std::move(memory), owner_start.ok() ? owner_pid : 0,
             owner_start.ok() ? *std::move(owner_start) : std::string());
}

std::uint64_t RegionRegistry::Add(const std::string& client_id,
                                  std::unique_ptr<RegionMemory> memory, std::int64_t owner_pid,
                                  std::string owner_start) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t id = next_id_++;
  regions_.emplace(id, Entry{client_id, std::shared_ptr<const RegionMemory>(std::move(memory)),
                             owner_pid, std::move(owner_start)});
  return id;
}

void RegionRegistry::ForgetExitedOwners() const {
  std::vector<std::shared_ptr<const RegionMemory>> gone;  // unmapped (closed) after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto entry = regions_.begin(); entry != regions_.end();) {
    const bool exited = [&] {
      if (entry->second.owner_pid == 0) return false;
      const absl::StatusOr<std::string> start = ProcessStartTime(entry->second.owner_pid);
      return !start.ok() || *start != entry->second.owner_start;
    }();
    if (exited) {
      gone.push_back(std::move(entry->second.region));
      entry = regions_.erase(entry);
    } else {
      ++entry;
    }
  }
}

absl::Status RegionRegistry::Unregister(const std::string& client_id, std::uint64_t region_id) {
  ForgetExitedOwners();
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = regions_.find(region_id);
  if (found == regions_.end() || found->second.client_id != client_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("region_id: ", region_id, " is not a region of this client (RegisterRegion)"));
  }
  regions_.erase(found);  // unmapped once no batch in flight uses it
  return absl::OkStatus();
}

absl::StatusOr<RegionBytes> RegionRegistry::Resolve(const std::string& client_id,
                                                    const v1::RegionSlice& slice,
                                                    std::size_t alignment,
                                                    std::size_t expected_bytes,
                                                    absl::string_view field) const {
  std::shared_ptr<const RegionMemory> region;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = regions_.find(slice.region_id());
    if (found == regions_.end() || found->second.client_id != client_id) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".region_id: ", slice.region_id(),
                       " is not a region of this client (RegisterRegion)"));
    }
    region = found->second.region;
  }
  const std::int64_t offset = slice.offset();
  const std::int64_t size = slice.byte_size();
  if (size < 0 || static_cast<std::uint64_t>(size) != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size: ", size, "; expected ",
                                                   expected_bytes, " (the tensor's bytes)"));
  }
  const std::uint64_t region_size = region->size();
  if (offset < 0 || static_cast<std::uint64_t>(offset) > region_size ||
      static_cast<std::uint64_t>(size) > region_size - static_cast<std::uint64_t>(offset)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": bytes [", offset, ", ", offset, " + ",
                                                   size, ") are outside the region of ",
                                                   region_size, " bytes"));
  }
  if (alignment > 1 && static_cast<std::uint64_t>(offset) % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".offset: ", offset, " is not a multiple of the element size ", alignment));
  }
  if (region->cuda_device() >= 0 &&
      reinterpret_cast<std::uintptr_t>(region->data() + offset) % kDeviceRegionAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".offset: ", offset, " makes a GPU address that is not a multiple of ",
                     kDeviceRegionAlignment, " bytes (CUDA IPC regions: the region's start, ",
                     "cuda_ipc.offset, and the slice's offset together must be)"));
  }
  RegionBytes bytes;
  bytes.data = region->data() + offset;
  bytes.size = static_cast<std::size_t>(size);
  bytes.region = std::move(region);
  return bytes;
}

std::size_t RegionRegistry::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return regions_.size();
}

namespace {

// The bytes of a tensor of `dtype` and `shape`; 0 when the dtype or shape is not a valid one.
std::size_t TensorBytes(int dtype, const google::protobuf::RepeatedField<std::int64_t>& shape) {
  if (!wire::IsSupportedDType(dtype)) return 0;
  std::uint64_t bytes = wire::DTypeSize(dtype);
  constexpr std::uint64_t kLimit = std::uint64_t{1} << 48;
  for (std::int64_t dim : shape) {
    if (dim < 0 || (dim > 0 && bytes > kLimit / static_cast<std::uint64_t>(dim))) return 0;
    bytes *= static_cast<std::uint64_t>(dim);
  }
  return static_cast<std::size_t>(bytes);
}

absl::Status ReadFromRegion(const RegionRegistry& regions, const std::string& client_id,
                            const v1::Tensor& tensor, const v1::RegionSlice& slice,
                            absl::string_view tensor_field, WireTensor* bytes) {
  const std::string field = absl::StrCat(tensor_field, "_region");
  if (bytes->size_bytes() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(tensor_field, ".raw_data: ", bytes->size_bytes(),
                                                   " bytes given together with ", field,
                                                   "; expected one of them"));
  }
  const std::size_t expected = TensorBytes(tensor.dtype(), tensor.shape());
  if (expected == 0) return absl::OkStatus();  // ParseBackwardRequest names what is wrong
  ATTNGRAD_ASSIGN_OR_RETURN(
      RegionBytes region,
      regions.Resolve(client_id, slice, wire::DTypeSize(tensor.dtype()), expected, field));
  if (region.cuda_device() >= 0) {
    const int device = region.cuda_device();
    *bytes = WireTensor::OnDevice(tensor.dtype(), region.data, region.size, device,
                                  std::move(region.region));
  } else {
    *bytes = WireTensor(tensor.dtype(), {absl::string_view(region.data, region.size)},
                        std::move(region.region));
  }
  return absl::OkStatus();
}

// cos_region / sin_region: both or neither, with rotary_tables naming the tables, in GPU memory.
absl::Status ReadRotaryTablesFromRegions(const RegionRegistry& regions,
                                         const std::string& client_id,
                                         ReceivedBackwardRequest* request) {
  const v1::BackwardRequest& message = request->message;
  if (!message.has_cos_region() && !message.has_sin_region()) return absl::OkStatus();
  if (!message.has_cos_region() || !message.has_sin_region() || !message.has_rotary_tables()) {
    return absl::InvalidArgumentError(
        "cos_region / sin_region: give both, together with rotary_tables naming the tables' "
        "dtype and shape (their raw_data empty)");
  }
  struct Table {
    const v1::Tensor& tensor;
    const v1::RegionSlice& slice;
    const char* name;
    WireTensor* into;
  };
  const Table tables[] = {
      {message.rotary_tables().cos(), message.cos_region(), "cos", &request->cos},
      {message.rotary_tables().sin(), message.sin_region(), "sin", &request->sin}};
  for (const Table& table : tables) {
    if (!table.tensor.raw_data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rotary_tables.", table.name, ".raw_data: ", table.tensor.raw_data().size(),
                       " bytes given together with ", table.name, "_region; expected one of them"));
    }
    ATTNGRAD_RETURN_IF_ERROR(
        ReadFromRegion(regions, client_id, table.tensor, table.slice, table.name, table.into));
    // A bad dtype or shape leaves the table empty, for ParseBackwardRequest to name.
    if (table.into->size_bytes() == 0) continue;
    if (table.into->cuda_device() < 0 || table.into->dtype() != v1::DTYPE_FLOAT32) {
      return absl::InvalidArgumentError(
          absl::StrCat(table.name,
                       "_region: rotary tables are read from regions only as float32 in GPU "
                       "memory (CUDA IPC); send them in rotary_tables otherwise"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadActivationsFromRegions(const RegionRegistry& regions, const std::string& client_id,
                                        ReceivedBackwardRequest* request) {
  const v1::BackwardRequest& message = request->message;
  if (message.has_hidden_states_region()) {
    ATTNGRAD_RETURN_IF_ERROR(ReadFromRegion(regions, client_id, message.hidden_states(),
                                            message.hidden_states_region(), "hidden_states",
                                            &request->hidden_states));
  }
  if (message.has_grad_output_region()) {
    ATTNGRAD_RETURN_IF_ERROR(ReadFromRegion(regions, client_id, message.grad_output(),
                                            message.grad_output_region(), "grad_output",
                                            &request->grad_output));
  }
  ATTNGRAD_RETURN_IF_ERROR(ReadRotaryTablesFromRegions(regions, client_id, request));
  // Every slice in GPU memory must be on one GPU: the first one's.
  const std::pair<const WireTensor*, const char*> inputs[] = {
      {&request->hidden_states, "hidden_states_region"},
      {&request->grad_output, "grad_output_region"},
      {&request->cos, "cos_region"},
      {&request->sin, "sin_region"}};
  int device = -1;
  const char* first = nullptr;
  for (const auto& [tensor, field] : inputs) {
    if (tensor->cuda_device() < 0) continue;
    if (device < 0) {
      device = tensor->cuda_device();
      first = field;
    } else if (tensor->cuda_device() != device) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": GPU memory of cuda:", tensor->cuda_device(), " but ", first,
                       " is on cuda:", device, "; a batch's CUDA IPC regions must be on one GPU"));
    }
  }
  return absl::OkStatus();
}

namespace {

// One output slice resolved for `job`: host memory into *host; GPU memory into *destination.
absl::Status ResolveOutput(const RegionRegistry& regions, const std::string& client_id,
                           const v1::RegionSlice& slice, std::size_t elements, const char* field,
                           const BatchJob& job, std::optional<RegionBytes>* host,
                           BatchJob::Request::DeviceDestination* destination) {
  const std::size_t element_size = wire::DTypeSize(job.request.response_dtype);
  ATTNGRAD_ASSIGN_OR_RETURN(RegionBytes region, regions.Resolve(client_id, slice, element_size,
                                                                elements * element_size, field));
  const int device = region.cuda_device();
  if (device < 0) {
    *host = std::move(region);
    return absl::OkStatus();
  }
  if (job.cuda_device() >= 0 && device != job.cuda_device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": GPU memory of cuda:", device, " but the batch's other slices are on",
        " cuda:", job.cuda_device(), "; a batch's CUDA IPC regions must be on one GPU"));
  }
  destination->data = region.data;
  destination->size = region.size;
  destination->cuda_device = device;
  destination->owner = std::move(region.region);
  return absl::OkStatus();
}

}  // namespace

OutputSlices OutputSlices::Of(const v1::BackwardRequest& request) {
  OutputSlices slices;
  if (request.has_grad_hidden_states_region()) {
    slices.grad_hidden_states = request.grad_hidden_states_region();
  }
  if (request.has_weight_gradients_region()) {
    slices.weight_gradients = request.weight_gradients_region();
  }
  if (request.has_output_region()) slices.output = request.output_region();
  return slices;
}

absl::StatusOr<OutputRegions> ResolveOutputRegions(const RegionRegistry& regions,
                                                   const std::string& client_id,
                                                   const OutputSlices& slices, BatchJob* job) {
  OutputRegions outputs;
  if (slices.output.has_value() && !job->forward()) {
    return absl::InvalidArgumentError(
        "output_region: only for FORWARD batches (computation = COMPUTATION_FORWARD)");
  }
  // The answer's [B,S,hidden] tensor: grad_hidden_states, or a FORWARD batch's output.
  const std::optional<v1::RegionSlice>& activations_slice =
      job->forward() ? slices.output : slices.grad_hidden_states;
  if (activations_slice.has_value()) {
    ATTNGRAD_RETURN_IF_ERROR(
        ResolveOutput(regions, client_id, *activations_slice, job->activations(),
                      job->forward() ? "output_region" : "grad_hidden_states_region", *job,
                      &outputs.grad_hidden_states, &job->request.grad_hidden_states_destination));
    outputs.grad_hidden_states_elsewhere = true;
  }
  if (slices.weight_gradients.has_value()) {
    if (!job->request.return_weight_gradients) {
      return absl::InvalidArgumentError(
          "weight_gradients_region: only with mode GRADIENT_MODE_RETURN (ACCUMULATE adds the "
          "weight gradients on the server)");
    }
    ATTNGRAD_RETURN_IF_ERROR(ResolveOutput(
        regions, client_id, *slices.weight_gradients,
        PackedWeightLayout(job->request.config).total_elements, "weight_gradients_region", *job,
        &outputs.weight_gradients, &job->request.weight_gradients_destination));
    outputs.weight_gradients_elsewhere = true;
  }
  return outputs;
}

namespace {

// One word of a stream order: 4 bytes of the client's GPU memory on the batch's GPU.
absl::StatusOr<RegionBytes> ResolveOrderWord(const RegionRegistry& regions,
                                             const std::string& client_id,
                                             const v1::RegionSlice& slice, const char* field,
                                             const BatchJob& job) {
  ATTNGRAD_ASSIGN_OR_RETURN(
      RegionBytes word,
      regions.Resolve(client_id, slice, kDeviceRegionAlignment, sizeof(std::uint32_t), field));
  if (word.cuda_device() != job.cuda_device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field,
        ": must be GPU memory (a CUDA IPC region) of the batch's GPU cuda:", job.cuda_device()));
  }
  return word;
}

}  // namespace

absl::Status ResolveStreamOrder(const RegionRegistry& regions, const std::string& client_id,
                                const v1::StreamOrder& order, std::chrono::seconds timeout,
                                BatchJob* job) {
  if (job->cuda_device() < 0) {
    return absl::InvalidArgumentError(
        "stream_order: only for batches that name CUDA IPC regions (hidden_states_region, "
        "grad_output_region, grad_hidden_states_region or output_region in GPU memory)");
  }
  ATTNGRAD_ASSIGN_OR_RETURN(RegionBytes ready, ResolveOrderWord(regions, client_id, order.ready(),
                                                                "stream_order.ready", *job));
  ATTNGRAD_ASSIGN_OR_RETURN(RegionBytes done, ResolveOrderWord(regions, client_id, order.done(),
                                                               "stream_order.done", *job));
  BatchJob::Request::StreamGate& gate = job->request.stream_gate;
  gate.ready = ready.data;
  gate.done = done.data;
  gate.value = order.value();
  gate.deadline = std::chrono::steady_clock::now() + timeout;
  gate.ready_owner = std::move(ready.region);
  gate.done_owner = std::move(done.region);
  return absl::OkStatus();
}

void CopyOutputsToRegions(const OutputRegions& outputs, const BatchJob& job) {
  // The answer buffer: grad_hidden_states, then the weight gradients (BatchJob::Result::answer).
  const std::size_t grad_bytes = job.activations() * wire::DTypeSize(job.request.response_dtype);
  if (outputs.grad_hidden_states.has_value()) {
    std::memcpy(outputs.grad_hidden_states->data, job.result.answer.bytes.data(),
                outputs.grad_hidden_states->size);
  }
  if (outputs.weight_gradients.has_value()) {
    std::memcpy(outputs.weight_gradients->data, job.result.answer.bytes.data() + grad_bytes,
                outputs.weight_gradients->size);
  }
}

}  // namespace attngrad::server
