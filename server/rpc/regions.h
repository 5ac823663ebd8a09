// Shared-memory regions: POSIX shared-memory objects of same-host clients, mapped read-write into
// the server (RegisterRegion), that batches name tensors in (BackwardRequest.*_region) instead of
// carrying their bytes. Each region belongs to the client id that registered it; a batch may only
// name its own client's regions, and only bytes inside them. A region stays mapped while a batch
// that uses it is in flight, even after it is unregistered; the registry unmaps the rest when it is
// destroyed (server shutdown).
#ifndef ATTNGRAD_SERVER_REGIONS_H_
#define ATTNGRAD_SERVER_REGIONS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attngrad/v1/attngrad.pb.h"
#include "rpc/backward_request.h"

namespace attngrad::server {

// One mapping of a shared-memory object; unmapped when destroyed.
class MappedRegion {
 public:
  // Opens the object `name` ("/x" or "x") and maps its first `byte_size` bytes read-write;
  // INVALID_ARGUMENT naming `name` / `byte_size` when it cannot.
  static absl::StatusOr<std::unique_ptr<MappedRegion>> Map(const std::string& name,
                                                           std::int64_t byte_size);
  ~MappedRegion();
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  char* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  MappedRegion(char* data, std::size_t size) : data_(data), size_(size) {}
  char* const data_;
  const std::size_t size_;
};

// Bytes of a region that a batch uses; `region` keeps them mapped.
struct RegionBytes {
  std::shared_ptr<const MappedRegion> region;
  char* data = nullptr;
  std::size_t size = 0;
};

class RegionRegistry {
 public:
  // Maps `name` for `client_id`; the new region's id (never 0).
  absl::StatusOr<std::uint64_t> Register(const std::string& client_id, const std::string& name,
                                         std::int64_t byte_size);
  // INVALID_ARGUMENT for an unknown region or another client's.
  absl::Status Unregister(const std::string& client_id, std::uint64_t region_id);

  // The bytes `slice` names, checked: a region of `client_id`, offset aligned to `alignment`,
  // inside the region, and byte_size == `expected_bytes`; INVALID_ARGUMENT naming `field`
  // (e.g. "hidden_states_region") otherwise.
  absl::StatusOr<RegionBytes> Resolve(const std::string& client_id, const v1::RegionSlice& slice,
                                      std::size_t alignment, std::size_t expected_bytes,
                                      absl::string_view field) const;

  std::size_t size() const;

 private:
  struct Entry {
    std::string client_id;
    std::string name;
    std::shared_ptr<const MappedRegion> region;
  };
  mutable std::mutex mutex_;
  std::uint64_t next_id_ = 1;
  std::map<std::uint64_t, Entry> regions_;
};

// Replaces the activations of a request that names hidden_states_region / grad_output_region with
// views of those bytes (WireTensors that keep the region mapped), checked against the tensor's
// dtype and shape. A tensor whose dtype or shape is itself wrong is left for ParseBackwardRequest
// to refuse. INVALID_ARGUMENT naming the field for any bad reference, or for raw_data given too.
absl::Status ReadActivationsFromRegions(const RegionRegistry& regions, const std::string& client_id,
                                        ReceivedBackwardRequest* request);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_REGIONS_H_
