// SharedMemoryRegion: a sealed memfd and the client's side of the region socket
// (attngrad/wire/region_socket.h); Client::RegisterRegion and UnregisterRegion.
#include "attngrad/shared_memory_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/client.h"
#include "attngrad/wire/region_socket.h"
#include "client_impl.h"

namespace attngrad {

namespace {

// A descriptor closed when the scope ends, unless released.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view what) {
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(errno)));
}

// Sends the request with `fd` attached (SCM_RIGHTS) as one message.
absl::Status SendWithDescriptor(int socket_fd, const std::string& message, int fd) {
  iovec vector{const_cast<char*>(message.data()), message.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr header{};
  header.msg_iov = &vector;
  header.msg_iovlen = 1;
  header.msg_control = control;
  header.msg_controllen = sizeof(control);
  cmsghdr* rights = CMSG_FIRSTHDR(&header);
  rights->cmsg_level = SOL_SOCKET;
  rights->cmsg_type = SCM_RIGHTS;
  rights->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(rights), &fd, sizeof(int));
  if (sendmsg(socket_fd, &header, MSG_NOSIGNAL) != static_cast<ssize_t>(message.size())) {
    return ErrnoStatus(absl::StatusCode::kUnavailable, "region socket: sendmsg");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(
    std::size_t byte_size) {
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: expected > 0 bytes");
  ScopedFd fd(memfd_create("attngrad-region", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd.get() < 0) return ErrnoStatus(absl::StatusCode::kInternal, "memfd_create");
  if (ftruncate(fd.get(), static_cast<off_t>(byte_size)) != 0) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, "ftruncate of the memfd");
  }
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, "sealing the memfd");
  }
  void* data = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (data == MAP_FAILED) return ErrnoStatus(absl::StatusCode::kResourceExhausted, "mmap");
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(fd.release(), static_cast<char*>(data), byte_size));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(data_, size_);
  close(fd_);
}

absl::StatusOr<std::uint64_t> SharedMemoryRegion::Register(
    const std::string& socket_path, const RegionCredentials& credentials) const {
  return RegisterRegionDescriptor(socket_path, fd_, static_cast<std::int64_t>(size_), credentials);
}

absl::StatusOr<std::uint64_t> RegisterRegionDescriptor(const std::string& socket_path, int fd,
                                                       std::int64_t byte_size,
                                                       const RegionCredentials& credentials) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket_path: \"", socket_path, "\" is empty or too long"));
  }
  std::memcpy(address.sun_path, socket_path.c_str(), socket_path.size() + 1);
  ScopedFd socket_fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (socket_fd.get() < 0) return ErrnoStatus(absl::StatusCode::kInternal, "socket");
  if (connect(socket_fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    return ErrnoStatus(absl::StatusCode::kUnavailable,
                       absl::StrCat("region socket: cannot connect to ", socket_path));
  }
  const timeval timeout{30, 0};
  setsockopt(socket_fd.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  wire::RegionSocketRequest request;
  request.byte_size = byte_size;
  if (!credentials.token.empty()) request.token = credentials.token;
  if (!credentials.client_id.empty()) request.client_id = credentials.client_id;
  const absl::Status sent =
      SendWithDescriptor(socket_fd.get(), wire::FormatRegionRequest(request), fd);
  if (!sent.ok()) return sent;
  std::vector<char> reply(wire::kMaxRegionMessageBytes);
  const ssize_t received = recv(socket_fd.get(), reply.data(), reply.size(), 0);
  if (received <= 0) {
    return ErrnoStatus(absl::StatusCode::kUnavailable, "region socket: no reply");
  }
  return wire::ParseRegionReply(
      absl::string_view(reply.data(), static_cast<std::size_t>(received)));
}

absl::StatusOr<uint64_t> Client::RegisterRegion(const SharedMemoryRegion& memory) {
  const ClientOptions& options = impl_->options();
  const std::string socket_path = options.region_socket.empty()
                                      ? DefaultRegionSocketPath(impl_->target())
                                      : options.region_socket;
  if (socket_path.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("region_socket: the target ", impl_->target(),
                     " names no port to find the server's region socket by; set "
                     "ClientOptions::region_socket"));
  }
  RegionCredentials credentials;
  credentials.token = options.token;
  credentials.client_id = options.client_id;
  return memory.Register(socket_path, credentials);
}

absl::Status Client::UnregisterRegion(uint64_t region_id) {
  grpc::ClientContext context;
  PrepareContext(&context, impl_->options(), impl_->options().deadline);
  v1::UnregisterRegionRequest request;
  request.set_region_id(region_id);
  v1::UnregisterRegionResponse response;
  return FromGrpc(impl_->stub().UnregisterRegion(&context, request, &response), "UnregisterRegion");
}

std::string DefaultRegionSocketPath(const std::string& target) {
  const std::optional<int> port = wire::TargetPort(target);
  return port.has_value() ? wire::DefaultRegionSocketPath(*port) : std::string();
}

}  // namespace attngrad
