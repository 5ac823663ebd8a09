// Bearer tokens, roles and client ids (see auth.h).
#include "rpc/auth.h"

#include <algorithm>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "attngrad/common/read_file.h"
#include "attngrad/common/status_macros.h"

namespace attngrad::server {
namespace {

constexpr std::size_t kMinTokenLength = 16;
constexpr std::size_t kMaxClientIdLength = 128;
constexpr absl::string_view kBearerPrefix = "Bearer ";

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  if (name == "trainer") return Role::kTrainer;
  if (name == "admin") return Role::kAdmin;
  return absl::InvalidArgumentError(absl::StrCat("role '", name, "' is not one of trainer, admin"));
}

// Where a client id of the tokens file comes from: its line, and whether the line names it.
struct ClientIdSource {
  int line_number = 0;
  bool explicit_id = false;
};

// A default id ("<role>-line<N>") that another line names explicitly would make two tokens that
// were meant to be two clients share one window, stream limit and batch ids: refused. Lines that
// both name the same id explicitly share it on purpose (two tokens of one client).
absl::Status CheckClientIdCollision(std::map<std::string, ClientIdSource>& sources,
                                    const std::string& client_id, ClientIdSource source,
                                    absl::string_view origin) {
  const auto [it, inserted] = sources.emplace(client_id, source);
  if (inserted || (it->second.explicit_id && source.explicit_id)) return absl::OkStatus();
  const ClientIdSource& named = source.explicit_id ? source : it->second;
  const ClientIdSource& defaulted = source.explicit_id ? it->second : source;
  return absl::InvalidArgumentError(absl::StrCat(
      "--tokens_file ", origin, " line ", named.line_number, ": the client id '", client_id,
      "' is also the default client id of line ", defaulted.line_number,
      " (a line without a client id is named <role>-line<N>): the two tokens would share one "
      "window; give line ",
      defaulted.line_number, " a client id or rename this one"));
}

}  // namespace

absl::StatusOr<std::string> SingleMetadataValue(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, absl::string_view key) {
  auto [begin, end] = metadata.equal_range(grpc::string_ref(key.data(), key.size()));
  if (begin == end) return std::string();
  const std::string value(begin->second.data(), begin->second.size());
  if (std::next(begin) != end) {
    return absl::InvalidArgumentError(absl::StrCat("metadata '", key, "' is sent more than once"));
  }
  return value;
}

const char* RoleName(Role role) { return role == Role::kAdmin ? "admin" : "trainer"; }

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char difference = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    difference |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return difference == 0;
}

absl::Status CheckClientId(absl::string_view client_id, absl::string_view what) {
  if (client_id.empty() || client_id.size() > kMaxClientIdLength) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": a client id has 1 to ",
                                                   kMaxClientIdLength, " characters, got ",
                                                   client_id.size()));
  }
  for (char c : client_id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != ':' &&
        c != '@' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": '", client_id, "' has a character outside [A-Za-z0-9._:@-]"));
    }
  }
  return absl::OkStatus();
}

Authenticator Authenticator::Open(bool loopback_only) {
  Authenticator authenticator;
  authenticator.loopback_only_ = loopback_only;
  return authenticator;
}

bool IsLoopbackPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  if (absl::ConsumePrefix(&peer, "ipv4:")) return absl::StartsWith(peer, "127.");
  if (!absl::ConsumePrefix(&peer, "ipv6:")) return false;
  // "[::1]:port", or percent-encoded brackets "%5B::1%5D:port" (newer gRPC releases).
  if (!absl::ConsumePrefix(&peer, "[") && !absl::ConsumePrefix(&peer, "%5B") &&
      !absl::ConsumePrefix(&peer, "%5b")) {
    return false;
  }
  const std::size_t end = std::min(peer.find(']'), peer.find('%'));
  const absl::string_view address = peer.substr(0, end);
  return address == "::1" || absl::StartsWith(address, "::ffff:127.");
}

absl::Status Authenticator::CheckPeer(absl::string_view peer) const {
  if (!loopback_only() || IsLoopbackPeer(peer)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "this server runs without authentication (no --tokens_file) and therefore serves only "
      "clients on its own host; this call came from ",
      peer,
      ". Start the server with --tokens_file=FILE (bearer tokens), or with "
      "--allow_unauthenticated to serve every client that reaches its port"));
}

absl::StatusOr<Authenticator> Authenticator::FromFile(const std::string& path) {
  ATTNGRAD_ASSIGN_OR_RETURN(const std::string text,
                            common::ReadFileToString(path, "--tokens_file"));
  return FromText(text, path);
}

absl::StatusOr<Authenticator> Authenticator::FromText(absl::string_view text,
                                                      absl::string_view origin) {
  Authenticator authenticator;
  authenticator.enabled_ = true;
  std::set<std::string> tokens;
  std::map<std::string, ClientIdSource> client_id_sources;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat("--tokens_file ", origin, " line ", line_number);
    if (fields.size() < 2 || fields.size() > 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": expected \"token role [client_id]\" (", fields.size(), " fields)"));
    }
    if (fields[0].size() < kMinTokenLength) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token is shorter than ", kMinTokenLength, " characters"));
    }
    for (char c : fields[0]) {
      if (static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": the token has a character outside printable ASCII"));
      }
    }
    if (!tokens.insert(std::string(fields[0])).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token is listed twice (each token names one client)"));
    }
    Entry entry;
    entry.token = std::string(fields[0]);
    absl::StatusOr<Role> role = ParseRole(fields[1]);
    if (!role.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", role.status().message()));
    entry.caller.role = *role;
    const bool explicit_id = fields.size() == 3;
    entry.caller.client_id =
        explicit_id ? std::string(fields[2]) : absl::StrCat(RoleName(*role), "-line", line_number);
    ATTNGRAD_RETURN_IF_ERROR(CheckClientId(entry.caller.client_id, where));
    ATTNGRAD_RETURN_IF_ERROR(CheckClientIdCollision(client_id_sources, entry.caller.client_id,
                                                    {line_number, explicit_id}, origin));
    authenticator.entries_.push_back(std::move(entry));
  }
  if (authenticator.entries_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens_file ", origin,
                     ": no tokens (an empty file would lock every client out; leave "
                     "--tokens_file out to run without authentication)"));
  }
  return authenticator;
}

absl::StatusOr<Caller> Authenticator::Authenticate(const grpc::ServerContextBase& context) const {
  ATTNGRAD_RETURN_IF_ERROR(CheckPeer(context.peer()));
  return AuthenticateMetadata(context.client_metadata());
}

absl::StatusOr<Caller> Authenticator::AuthenticateMetadata(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  if (!enabled_) {
    ATTNGRAD_ASSIGN_OR_RETURN(std::string client_id,
                              SingleMetadataValue(metadata, kClientIdMetadata));
    Caller caller;
    caller.role = Role::kAdmin;
    if (!client_id.empty()) {
      ATTNGRAD_RETURN_IF_ERROR(CheckClientId(client_id, kClientIdMetadata));
      caller.client_id = std::move(client_id);
    }
    return caller;
  }
  absl::StatusOr<std::string> authorization = SingleMetadataValue(metadata, kAuthorizationMetadata);
  if (!authorization.ok()) return absl::UnauthenticatedError(authorization.status().message());
  if (authorization->empty()) {
    return absl::UnauthenticatedError(
        "this server requires a bearer token: send the metadata 'authorization: Bearer <token>' "
        "(attngrad-cli --token_file, ClientOptions::token, Client(token=...))");
  }
  if (!absl::StartsWith(*authorization, kBearerPrefix)) {
    return absl::UnauthenticatedError("authorization: expected 'Bearer <token>'");
  }
  const absl::string_view presented =
      absl::string_view(*authorization).substr(kBearerPrefix.size());
  // Every entry is compared (no early exit), each in time independent of the contents.
  const Entry* match = nullptr;
  for (const Entry& entry : entries_) {
    if (ConstantTimeEquals(presented, entry.token)) match = &entry;
  }
  if (match == nullptr) return absl::UnauthenticatedError("authorization: unknown bearer token");
  return match->caller;
}

absl::Status Authorize(const Caller& caller, Operation operation, absl::string_view method) {
  if (caller.role == Role::kAdmin) return absl::OkStatus();
  switch (operation) {
    case Operation::kInfo:
    case Operation::kBackward:
    case Operation::kFetchOwn: return absl::OkStatus();
    case Operation::kAddressOtherClient:
    case Operation::kZero:
    case Operation::kLoadWeights: break;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      method, ": client '", caller.client_id, "' has the role ", RoleName(caller.role),
      ", which may call Backward, GetModelInfo, health and FetchGradients of its own window; ",
      operation == Operation::kAddressOtherClient ? "another client's window" : method,
      " needs the role admin"));
}

absl::StatusOr<std::string> WindowOwner(const Caller& caller,
                                        const grpc::ServerContextBase& context,
                                        absl::string_view method) {
  ATTNGRAD_ASSIGN_OR_RETURN(std::string owner,
                            SingleMetadataValue(context.client_metadata(), kForClientMetadata));
  if (owner.empty() || owner == caller.client_id) return caller.client_id;
  ATTNGRAD_RETURN_IF_ERROR(CheckClientId(owner, kForClientMetadata));
  ATTNGRAD_RETURN_IF_ERROR(Authorize(caller, Operation::kAddressOtherClient, method));
  return owner;
}

}  // namespace attngrad::server
