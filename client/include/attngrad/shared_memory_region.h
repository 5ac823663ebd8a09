// attngrad::SharedMemoryRegion: host memory that a trainer on the server's host shares with the
// server, so that batches name tensors in it (BackwardRequest.hidden_states_region, ...) instead of
// carrying their bytes. It is a memfd sealed against shrinking and growing (F_SEAL_SHRINK,
// F_SEAL_GROW, F_SEAL_SEAL), mapped read-write here; Register passes its descriptor to the server
// over the server's region socket (a Unix socket, SCM_RIGHTS), which maps it too and answers the
// region id. The server unmaps it at UnregisterRegion (gRPC), when the registering process has
// exited, or at shutdown.
#ifndef ATTNGRAD_SHARED_MEMORY_REGION_H_
#define ATTNGRAD_SHARED_MEMORY_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace attngrad {

// Who registers: the same token (servers with --tokens_file) or client id (servers without) as
// the Client's calls carry, so that the region belongs to the caller's client id.
struct RegionCredentials {
  std::string token;      // empty: none
  std::string client_id;  // empty: none ("default" on a server without tokens)
};

class SharedMemoryRegion {
 public:
  // A new sealed memfd of `byte_size` bytes (zeros), mapped here.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(std::size_t byte_size);
  ~SharedMemoryRegion();  // this process's mapping and descriptor; the server's stay
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  char* data() const { return data_; }
  std::size_t size() const { return size_; }
  int fd() const { return fd_; }

  // Registers the whole region with the server listening on `socket_path`; the region id.
  absl::StatusOr<std::uint64_t> Register(const std::string& socket_path,
                                         const RegionCredentials& credentials) const;

 private:
  SharedMemoryRegion(int fd, char* data, std::size_t size) : fd_(fd), data_(data), size_(size) {}
  const int fd_;
  char* const data_;
  const std::size_t size_;
};

// Sends descriptor `fd` with a request for its first `byte_size` bytes to the region socket at
// `socket_path`; the region id, or the server's error (its gRPC code); UNAVAILABLE when no server
// answers there. SharedMemoryRegion::Register uses it; tests send other descriptors with it.
absl::StatusOr<std::uint64_t> RegisterRegionDescriptor(const std::string& socket_path, int fd,
                                                       std::int64_t byte_size,
                                                       const RegionCredentials& credentials);

// The region socket of a server reached at gRPC `target` ("host:port") that was started without
// --region_socket; empty when the target names no port (give the server's path then).
std::string DefaultRegionSocketPath(const std::string& target);

}  // namespace attngrad

#endif  // ATTNGRAD_SHARED_MEMORY_REGION_H_
