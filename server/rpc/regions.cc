// RegionRegistry: shm_open + mmap of the clients' shared-memory objects, and the checks of every
// reference into them.
#include "rpc/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/status_macros.h"

namespace attngrad::server {

absl::StatusOr<std::unique_ptr<MappedRegion>> MappedRegion::Map(const std::string& name,
                                                                std::int64_t byte_size) {
  const std::string path = absl::StartsWith(name, "/") ? name : absl::StrCat("/", name);
  if (path.size() < 2 || path.find('/', 1) != std::string::npos || path.size() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: \"", name,
                     "\" is not a POSIX shared-memory object name; expected \"/name\" or \"name\" "
                     "with no other '/'"));
  }
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: ", byte_size, "; expected > 0 bytes"));
  }
  const int fd = shm_open(path.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int error = errno;
    return absl::InvalidArgumentError(absl::StrCat("name: cannot open shared-memory object \"",
                                                   path, "\": ", std::strerror(error)));
  }
  struct stat stat_buffer {};
  if (fstat(fd, &stat_buffer) != 0 || stat_buffer.st_size < byte_size) {
    const std::int64_t object_size = static_cast<std::int64_t>(stat_buffer.st_size);
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("byte_size: ", byte_size,
                                                   " bytes exceed the shared-memory object \"",
                                                   path, "\" of ", object_size, " bytes"));
  }
  void* data =
      mmap(nullptr, static_cast<std::size_t>(byte_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);  // the mapping keeps the object
  if (data == MAP_FAILED) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: cannot map \"", path, "\": ", std::strerror(error)));
  }
  return std::unique_ptr<MappedRegion>(
      new MappedRegion(static_cast<char*>(data), static_cast<std::size_t>(byte_size)));
}

MappedRegion::~MappedRegion() { munmap(data_, size_); }

absl::StatusOr<std::uint64_t> RegionRegistry::Register(const std::string& client_id,
                                                       const std::string& name,
                                                       std::int64_t byte_size) {
  absl::StatusOr<std::unique_ptr<MappedRegion>> region = MappedRegion::Map(name, byte_size);
  if (!region.ok()) return region.status();
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t id = next_id_++;
  regions_.emplace(id,
                   Entry{client_id, name, std::shared_ptr<const MappedRegion>(std::move(*region))});
  return id;
}

absl::Status RegionRegistry::Unregister(const std::string& client_id, std::uint64_t region_id) {
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
  std::shared_ptr<const MappedRegion> region;
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
  *bytes = WireTensor(tensor.dtype(), {absl::string_view(region.data, region.size)},
                      std::move(region.region));
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
  return absl::OkStatus();
}

}  // namespace attngrad::server
