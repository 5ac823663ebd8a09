// The gRPC port's transport credentials: plaintext, TLS (--tls_cert, --tls_key) or mutual TLS
// (--tls_client_ca: client certificates required and verified against that CA bundle). The files
// are watched by gRPC's FileWatcherCertificateProvider and reloaded when they change (checked
// every --tls_reload_interval_seconds); a replacement must be atomic (a rename, or the symlink swap
// Kubernetes does for mounted secrets) so that key and certificate always match.
#ifndef ATTNGRAD_SERVER_RPC_TLS_H_
#define ATTNGRAD_SERVER_RPC_TLS_H_

#include <memory>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"

namespace attngrad::server {

struct TlsFiles {
  std::string certificate;  // PEM certificate chain; empty = plaintext
  std::string private_key;  // PEM private key
  std::string client_ca;    // PEM CA bundle: mutual TLS; empty = no client certificates
  int reload_interval_seconds = 10;
};

// Checks the files (readable, PEM) and makes the credentials; INVALID_ARGUMENT / NOT_FOUND
// naming the flag otherwise. `description` (when not null) gets one line for the start-up log.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, std::string* description);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_TLS_H_
