// Who is calling and what they may do: bearer tokens read from --tokens_file (lines
// "token role [client_id]") mapped to the roles trainer and admin, checked against the
// `authorization: Bearer <token>` metadata of every call (constant-time comparison), and the
// client id that scopes accumulation windows, batch-id deduplication and stream limits. With no
// tokens file authentication is off: every caller is an admin and names itself with the
// `attngrad-client-id` metadata ("default" when absent).
#ifndef ATTNGRAD_SERVER_RPC_AUTH_H_
#define ATTNGRAD_SERVER_RPC_AUTH_H_

#include <map>
#include <string>
#include <vector>

#include <grpcpp/server_context.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attngrad::server {

enum class Role { kTrainer, kAdmin };
const char* RoleName(Role role);

// What a call may ask for; Authorize maps it to the roles allowed.
enum class Operation {
  kInfo,                // GetModelInfo
  kBackward,            // Backward (its batches go to the caller's own window)
  kFetchOwn,            // FetchGradients of the caller's own window, zeroing it or not
  kAddressOtherClient,  // FetchGradients / ZeroGradients of another client's window
  kZero,                // ZeroGradients
  kLoadWeights,         // LoadWeights
};

// The authenticated caller.
struct Caller {
  Role role = Role::kAdmin;
  std::string client_id = "default";
};

// Metadata keys (lower case, as gRPC requires).
inline constexpr char kAuthorizationMetadata[] = "authorization";
inline constexpr char kClientIdMetadata[] = "attngrad-client-id";    // authentication off only
inline constexpr char kForClientMetadata[] = "attngrad-for-client";  // admin: another's window

// The single value of `key` in a call's `metadata`; empty when absent, INVALID_ARGUMENT naming the
// key when it is sent more than once.
absl::StatusOr<std::string> SingleMetadataValue(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, absl::string_view key);

// Whether a gRPC peer string names a caller on this host: an IPv4 address in 127.0.0.0/8, the
// IPv6 loopback ::1 (or an IPv4-mapped loopback address), or a Unix socket.
bool IsLoopbackPeer(absl::string_view peer);

// Client ids: 1 to 128 characters of [A-Za-z0-9._:@-].
absl::Status CheckClientId(absl::string_view client_id, absl::string_view what);

class Authenticator {
 public:
  // Authentication off: every caller is an admin, named by its attngrad-client-id metadata.
  // loopback_only (the default, "protected mode"): only callers on the server's own host
  // (loopback or a Unix socket) are served; the others get PERMISSION_DENIED.
  static Authenticator Open(bool loopback_only = true);
  // Reads a tokens file: one "token role [client_id]" per line (blank lines and lines starting
  // with '#' are skipped). Tokens must be at least 16 characters and unique; role is trainer or
  // admin; client_id defaults to "<role>-line<N>" (N = the line number), and a line may not name
  // another line's default id (the two tokens would share one window). Errors name the line,
  // never the token.
  static absl::StatusOr<Authenticator> FromFile(const std::string& path);
  static absl::StatusOr<Authenticator> FromText(absl::string_view text, absl::string_view origin);

  bool enabled() const { return enabled_; }
  bool loopback_only() const { return !enabled_ && loopback_only_; }
  std::size_t token_count() const { return entries_.size(); }

  // The caller of `context`: UNAUTHENTICATED without or with an unknown bearer token (when
  // enabled), PERMISSION_DENIED for a caller from another host in protected mode,
  // INVALID_ARGUMENT for a malformed attngrad-client-id.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& context) const;
  // PERMISSION_DENIED naming the two ways out when the server is in protected mode and `peer`
  // (grpc::ServerContext::peer(): "ipv4:1.2.3.4:5", "ipv6:[::1]:5", "unix:/path") is not on
  // this host; OK otherwise.
  absl::Status CheckPeer(absl::string_view peer) const;
  // The same from a metadata multimap's values (for tests and for Authenticate).
  absl::StatusOr<Caller> AuthenticateMetadata(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

 private:
  struct Entry {
    std::string token;
    Caller caller;
  };
  bool enabled_ = false;
  bool loopback_only_ = true;
  std::vector<Entry> entries_;
};

// OK when `caller` may perform `operation`; PERMISSION_DENIED (naming the role and what it may do)
// otherwise. `method` names the RPC in the message.
absl::Status Authorize(const Caller& caller, Operation operation, absl::string_view method);

// The window a FetchGradients / ZeroGradients addresses: the caller's own, or (admin only, the
// attngrad-for-client metadata) another client's.
absl::StatusOr<std::string> WindowOwner(const Caller& caller,
                                        const grpc::ServerContextBase& context,
                                        absl::string_view method);

// Equal contents, in time that depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_AUTH_H_
