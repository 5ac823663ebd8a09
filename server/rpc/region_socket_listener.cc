// RegionSocketListener: the Unix socket on which clients pass sealed memfds (rpc/region_socket.h).
#include "rpc/region_socket_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"
#include "rpc/auth.h"
#include "rpc/regions.h"

namespace attngrad::server {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) close(fd_);
}

int UniqueFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

namespace {

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int error = errno;
  return absl::FailedPreconditionError(
      absl::StrCat("--region_socket: ", what, " ", path, ": ", std::strerror(error)));
}

std::string DirectoryOf(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Creates the socket's directory (mode 0700) when it is missing. The default directory must be
// the server user's own and closed to everyone else: a socket in a directory another user controls
// could be replaced by theirs.
absl::Status PrepareDirectory(const std::string& path) {
  const std::string directory = DirectoryOf(path);
  if (mkdir(directory.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoError("cannot create the directory", directory);
  }
  if (directory != DirectoryOf(wire::DefaultRegionSocketPath(0))) return absl::OkStatus();
  struct stat status {};
  if (lstat(directory.c_str(), &status) != 0) return ErrnoError("cannot stat", directory);
  if (!S_ISDIR(status.st_mode) || status.st_uid != geteuid() || (status.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--region_socket: ", directory,
        " is not a directory of the server's user closed to others (mode 0700); remove it or give "
        "--region_socket=PATH"));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> NewSocket() {
  UniqueFd socket_fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!socket_fd.valid()) return ErrnoError("cannot create a socket for", "");
  return socket_fd;
}

absl::StatusOr<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--region_socket: \"", path,
                                                   "\" is empty or longer than ",
                                                   sizeof(address.sun_path) - 1, " bytes"));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return address;
}

// Removes a socket file that no server answers on any more (left by one that was killed).
absl::Status RemoveStaleSocket(const std::string& path, const sockaddr_un& address) {
  struct stat status {};
  if (lstat(path.c_str(), &status) != 0) return absl::OkStatus();  // nothing there
  if (!S_ISSOCK(status.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--region_socket: ", path, " exists and is not a socket"));
  }
  ATTNGRAD_ASSIGN_OR_RETURN(UniqueFd probe, NewSocket());
  if (connect(probe.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--region_socket: another server answers on ", path, "; give another path"));
  }
  if (unlink(path.c_str()) != 0) return ErrnoError("cannot remove the stale socket", path);
  return absl::OkStatus();
}

struct ReceivedRequest {
  std::string message;
  UniqueFd memory;
};

// One request message and its one descriptor; every descriptor received is closed unless kept.
absl::StatusOr<ReceivedRequest> ReceiveRequest(const UniqueFd& connection) {
  constexpr std::size_t kMaxDescriptors = 4;
  std::vector<char> data(wire::kMaxRegionMessageBytes + 1);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)];
  iovec vector{data.data(), data.size()};
  msghdr message{};
  message.msg_iov = &vector;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const ssize_t received = recvmsg(connection.get(), &message, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  std::vector<UniqueFd> descriptors;
  if (received >= 0) {
    for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
         header = CMSG_NXTHDR(&message, header)) {
      if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t index = 0; index < count; ++index) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(header) + index * sizeof(int), sizeof(int));
        descriptors.emplace_back(fd);
      }
    }
  }
  if (received <= 0) return absl::InvalidArgumentError("request: no message before the timeout");
  if ((message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: larger than ", wire::kMaxRegionMessageBytes,
        " bytes or carrying more than one descriptor; expected one request and one memfd"));
  }
  if (descriptors.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("fd: ", descriptors.size(),
                     " descriptors came with the request (SCM_RIGHTS); expected one memfd"));
  }
  return ReceivedRequest{std::string(data.data(), static_cast<std::size_t>(received)),
                         std::move(descriptors.front())};
}

absl::StatusOr<RegionPeer> PeerOf(const UniqueFd& connection) {
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (getsockopt(connection.get(), SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    return absl::InternalError("region socket: cannot read the peer's credentials");
  }
  return RegionPeer{credentials.pid, credentials.uid};
}

// Waits until `fd` is readable or `wake` closes (or the timeout passes); true when readable.
bool WaitReadable(int fd, int wake, int timeout_ms) {
  pollfd watched[2] = {{fd, POLLIN, 0}, {wake, POLLIN, 0}};
  while (true) {
    const int ready = poll(watched, 2, timeout_ms);
    if (ready < 0 && errno == EINTR) continue;
    return ready > 0 && watched[1].revents == 0 && (watched[0].revents & POLLIN) != 0;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionSocketListener>> RegionSocketListener::Start(
    const std::string& path, RegionRequestHandler handler) {
  ATTNGRAD_ASSIGN_OR_RETURN(const sockaddr_un address, SocketAddress(path));
  ATTNGRAD_RETURN_IF_ERROR(PrepareDirectory(path));
  ATTNGRAD_RETURN_IF_ERROR(RemoveStaleSocket(path, address));
  ATTNGRAD_ASSIGN_OR_RETURN(UniqueFd listen_fd, NewSocket());
  if (bind(listen_fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    return ErrnoError("cannot bind", path);
  }
  // Owner only, before anyone may connect (connecting needs write permission on the file).
  if (chmod(path.c_str(), 0600) != 0 || listen(listen_fd.get(), 16) != 0) {
    const absl::Status error = ErrnoError("cannot listen on", path);
    unlink(path.c_str());
    return error;
  }
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    const absl::Status error = ErrnoError("cannot create a pipe for", path);
    unlink(path.c_str());
    return error;
  }
  return std::unique_ptr<RegionSocketListener>(new RegionSocketListener(
      path, std::move(listen_fd), UniqueFd(wake[0]), UniqueFd(wake[1]), std::move(handler)));
}

RegionSocketListener::RegionSocketListener(std::string path, UniqueFd listen_fd, UniqueFd wake_read,
                                           UniqueFd wake_write, RegionRequestHandler handler)
    : path_(std::move(path)),
      listen_fd_(std::move(listen_fd)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)),
      handler_(std::move(handler)),
      thread_([this] { Serve(); }) {}

RegionSocketListener::~RegionSocketListener() {
  wake_write_ = UniqueFd();  // end of file on wake_read_: Serve() returns
  thread_.join();
  unlink(path_.c_str());
}

void RegionSocketListener::Serve() {
  while (WaitReadable(listen_fd_.get(), wake_read_.get(), -1)) {
    UniqueFd connection(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (connection.valid()) {
      Answer(connection);
    } else {
      // Out of descriptors, say: wait a moment rather than spin on the pending connection.
      pollfd wake{wake_read_.get(), POLLIN, 0};
      poll(&wake, 1, 100);
    }
  }
}

void RegionSocketListener::Answer(const UniqueFd& connection) const {
  absl::StatusOr<std::uint64_t> region_id = [&]() -> absl::StatusOr<std::uint64_t> {
    ATTNGRAD_ASSIGN_OR_RETURN(const RegionPeer peer, PeerOf(connection));
    const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(kRegionRequestTimeout));
    if (!WaitReadable(connection.get(), wake_read_.get(), timeout_ms)) {
      return absl::DeadlineExceededError(
          absl::StrCat("request: none within ", absl::FormatDuration(kRegionRequestTimeout)));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(ReceivedRequest received, ReceiveRequest(connection));
    ATTNGRAD_ASSIGN_OR_RETURN(const wire::RegionSocketRequest request,
                              wire::ParseRegionRequest(received.message));
    return handler_(request, received.memory, peer);
  }();
  const std::string reply = wire::FormatRegionReply(region_id);
  // The reply fits the socket's buffer: a peer that never reads does not block the thread.
  send(connection.get(), reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

RegionRequestHandler RegisterFromSocket(const Authenticator& authenticator,
                                        RegionRegistry& regions) {
  return [&authenticator, &regions](const wire::RegionSocketRequest& request,
                                    const UniqueFd& memory,
                                    const RegionPeer& peer) -> absl::StatusOr<std::uint64_t> {
    if (peer.uid != geteuid() && peer.uid != 0) {
      return absl::PermissionDeniedError(absl::StrCat("region socket: the peer's uid ", peer.uid,
                                                      " is neither the server's user's (",
                                                      geteuid(), ") nor root's"));
    }
    const std::string bearer = absl::StrCat("Bearer ", request.token.value_or(""));
    std::multimap<grpc::string_ref, grpc::string_ref> metadata;
    if (request.token.has_value()) metadata.emplace(kAuthorizationMetadata, bearer);
    if (request.client_id.has_value()) metadata.emplace(kClientIdMetadata, *request.client_id);
    ATTNGRAD_ASSIGN_OR_RETURN(const Caller caller, authenticator.AuthenticateMetadata(metadata));
    ATTNGRAD_RETURN_IF_ERROR(Authorize(caller, Operation::kBackward, "RegisterRegion"));
    return regions.RegisterSharedMemory(caller.client_id, memory.get(), request.byte_size,
                                        peer.pid);
  };
}

std::string RegionSocketPath(const std::string& flag, int port) {
  if (flag == "off") return "";
  return flag.empty() ? wire::DefaultRegionSocketPath(port) : flag;
}

}  // namespace attngrad::server
