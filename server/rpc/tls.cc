// TLS and mutual-TLS server credentials from watched files (see tls.h).
#include "rpc/tls.h"

#include <fstream>
#include <sstream>

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attngrad/wire/status_macros.h"

namespace attngrad::server {
namespace {

// The file exists, is readable and holds a PEM block of `kind` ("CERTIFICATE", "PRIVATE KEY").
absl::Status CheckPemFile(const std::string& path, const char* flag, const char* kind) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::ostringstream text;
  text << file.rdbuf();
  const std::string contents = text.str();
  if (!absl::StrContains(contents, "-----BEGIN ") || !absl::StrContains(contents, kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM ", kind, " block"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, std::string* description) {
  if (files.certificate.empty() && files.private_key.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is TLS with client "
          "certificates)");
    }
    if (description != nullptr) *description = "gRPC transport: plaintext (no --tls_cert)";
    return grpc::InsecureServerCredentials();
  }
  if (files.certificate.empty() || files.private_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (files.reload_interval_seconds < 1) {
    return absl::InvalidArgumentError("--tls_reload_interval_seconds must be >= 1");
  }
  ATTNGRAD_RETURN_IF_ERROR(CheckPemFile(files.certificate, "--tls_cert", "CERTIFICATE"));
  ATTNGRAD_RETURN_IF_ERROR(CheckPemFile(files.private_key, "--tls_key", "PRIVATE KEY"));
  if (!files.client_ca.empty()) {
    ATTNGRAD_RETURN_IF_ERROR(CheckPemFile(files.client_ca, "--tls_client_ca", "CERTIFICATE"));
  }
  const unsigned int interval = static_cast<unsigned int>(files.reload_interval_seconds);
  auto provider = files.client_ca.empty()
                      ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            files.private_key, files.certificate, interval)
                      : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            files.private_key, files.certificate, files.client_ca, interval);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  std::shared_ptr<grpc::ServerCredentials> credentials =
      grpc::experimental::TlsServerCredentials(options);
  if (credentials == nullptr) {
    return absl::InternalError("gRPC could not make TLS server credentials");
  }
  if (description != nullptr) {
    *description = absl::StrCat(
        "gRPC transport: ",
        files.client_ca.empty() ? "TLS"
                                : "mutual TLS (client certificates "
                                  "required, verified against ",
        files.client_ca.empty() ? "" : files.client_ca, files.client_ca.empty() ? "" : ")",
        "; certificate ", files.certificate, ", reloaded when the files change (checked every ",
        files.reload_interval_seconds, " s)");
  }
  return credentials;
}

}  // namespace attngrad::server
