// The region socket: how a client on the server's host registers host memory with the server. The
// client creates a memfd, seals it against shrinking (F_SEAL_SHRINK) and sends its descriptor over
// a Unix socket (SOCK_SEQPACKET, SCM_RIGHTS) with one request message; the server checks the seals
// and size, maps it, and answers with the region id or an error. Passing the descriptor proves that
// the client holds the memory, and a sealed memfd cannot shrink under the server's mapping (a read
// past a shrunk object's end would fault).
//
// Request (one message, at most kMaxRegionMessageBytes, lines ending in '\n'):
//   attngrad-region-v1
//   byte_size <decimal bytes, > 0>
//   token <bearer token>        (optional: servers with --tokens_file)
//   client_id <client id>       (optional: servers without tokens)
// Reply (one message): the same first line, then `ok <region id>` or `error <code> <message>`
// (code: the gRPC status number; the message one line).
#ifndef ATTNGRAD_WIRE_REGION_SOCKET_H_
#define ATTNGRAD_WIRE_REGION_SOCKET_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attngrad::wire {

inline constexpr char kRegionProtocolLine[] = "attngrad-region-v1";
inline constexpr std::size_t kMaxRegionMessageBytes = 4096;

struct RegionSocketRequest {
  std::int64_t byte_size = 0;
  std::optional<std::string> token;
  std::optional<std::string> client_id;
};

// The request's bytes. Values must be non-empty printable ASCII without spaces.
std::string FormatRegionRequest(const RegionSocketRequest& request);
// INVALID_ARGUMENT naming the line or field for anything but a request FormatRegionRequest makes:
// a missing or other first line, an unknown or repeated key, byte_size not a positive decimal, a
// value with spaces or control characters, a message larger than kMaxRegionMessageBytes.
absl::StatusOr<RegionSocketRequest> ParseRegionRequest(absl::string_view message);

// The reply's bytes: `ok <id>` when `region_id` holds one, else `error <code> <message>`.
std::string FormatRegionReply(const absl::StatusOr<std::uint64_t>& region_id);
// The region id, or the server's error as an absl::Status of its code; DATA_LOSS for bytes that
// are no reply.
absl::StatusOr<std::uint64_t> ParseRegionReply(absl::string_view message);

// Where a server whose gRPC port is `port` listens for regions when --region_socket is not given:
// $XDG_RUNTIME_DIR/attngrad/regions-<port>.sock when XDG_RUNTIME_DIR is an absolute path, else
// /tmp/attngrad-<effective uid>/regions-<port>.sock. Clients compute the same from the port of
// their target.
std::string DefaultRegionSocketPath(int port);

// The port of a gRPC target ("host:port", "ipv4:1.2.3.4:5", "[::1]:5", "dns:///host:5"); nullopt
// when it names none (a unix: target, or no port).
std::optional<int> TargetPort(absl::string_view target);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_REGION_SOCKET_H_
