// The region socket (attngrad/wire/region_socket.h): a Unix socket on which clients of this host
// register host memory by passing the descriptor of a memfd sealed against shrinking. One thread
// accepts and answers each connection's one request in turn (a connection gets
// kRegionRequestTimeout to send it). The socket file is made mode 0600 in a directory only the
// server's user may enter (the default one) or wherever --region_socket names, and a peer whose
// uid (SO_PEERCRED) is neither the server's nor root is refused.
#ifndef ATTNGRAD_SERVER_RPC_REGION_SOCKET_LISTENER_H_
#define ATTNGRAD_SERVER_RPC_REGION_SOCKET_LISTENER_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attngrad/wire/region_socket.h"

namespace attngrad::server {

class Authenticator;
class RegionRegistry;

// An owned file descriptor, closed when destroyed.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  ~UniqueFd();
  int get() const { return fd_; }
  int release();
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Who is on the other end of a region socket connection (SO_PEERCRED).
struct RegionPeer {
  pid_t pid = 0;  // 0 when the peer is in a PID namespace the server cannot see
  uid_t uid = 0;
};

inline constexpr absl::Duration kRegionRequestTimeout = absl::Seconds(2);

// Registers the memory of one request: its descriptor (the only one the message carried) and peer.
using RegionRequestHandler = std::function<absl::StatusOr<std::uint64_t>(
    const wire::RegionSocketRequest& request, const UniqueFd& memory, const RegionPeer& peer)>;

class RegionSocketListener {
 public:
  // Binds `path` (its directory is created mode 0700 when it does not exist; a stale socket file
  // of a server that is gone is replaced; FAILED_PRECONDITION when a server still answers there,
  // or the default directory is not the server user's own) and starts answering.
  static absl::StatusOr<std::unique_ptr<RegionSocketListener>> Start(const std::string& path,
                                                                     RegionRequestHandler handler);
  ~RegionSocketListener();  // stops the thread, closes and removes the socket file
  RegionSocketListener(const RegionSocketListener&) = delete;
  RegionSocketListener& operator=(const RegionSocketListener&) = delete;

  const std::string& path() const { return path_; }

 private:
  RegionSocketListener(std::string path, UniqueFd listen_fd, UniqueFd wake_read,
                       UniqueFd wake_write, RegionRequestHandler handler);
  void Serve();
  // Reads one request from `connection` and sends its answer.
  void Answer(const UniqueFd& connection) const;

  const std::string path_;
  UniqueFd listen_fd_;
  UniqueFd wake_read_;  // the destructor closes the write end to stop Serve()
  UniqueFd wake_write_;
  const RegionRequestHandler handler_;
  std::thread thread_;
};

// The handler the server uses: authenticates the request's token (or client id, authentication
// off) as RegisterRegion would its metadata, refuses a peer that is neither the server's user nor
// root, and registers the memory for the caller's client id with the peer as its owner process.
RegionRequestHandler RegisterFromSocket(const Authenticator& authenticator,
                                        RegionRegistry& regions);

// The socket path of --region_socket: "" = wire::DefaultRegionSocketPath(port), "off" = none.
std::string RegionSocketPath(const std::string& flag, int port);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_REGION_SOCKET_LISTENER_H_
