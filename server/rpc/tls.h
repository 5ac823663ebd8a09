// The gRPC port's transport credentials: plaintext, TLS (--tls_cert, --tls_key) or mutual TLS
// (--tls_client_ca: client certificates required and verified against that CA bundle).
//
// The files are checked before gRPC sees them: every certificate must parse, the key must parse and
// match the chain's first certificate, the client CA bundle must hold certificates and nothing that
// does not parse. At start a bad file is an error naming its flag (the server does not start). The
// files are then checked for changes every --tls_reload_interval_seconds: a changed set that passes
// the checks is copied into a private staging directory that gRPC's FileWatcherCertificateProvider
// watches (new handshakes use it); one that fails is logged and counted, and the last good
// credentials stay in use. gRPC 1.51 has no C++ API to push certificates, hence the staging copies.
#ifndef ATTNGRAD_SERVER_RPC_TLS_H_
#define ATTNGRAD_SERVER_RPC_TLS_H_

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attngrad::server {

struct TlsFiles {
  std::string certificate;  // PEM certificate chain; empty = plaintext
  std::string private_key;  // PEM private key
  std::string client_ca;    // PEM CA bundle: mutual TLS; empty = no client certificates
  int reload_interval_seconds = 10;
};

// The contents of the TLS files.
struct TlsContents {
  std::string certificate;
  std::string private_key;
  std::string client_ca;  // empty without mutual TLS
};
bool operator==(const TlsContents& a, const TlsContents& b);

// INVALID_ARGUMENT naming the flag (and `files`' path) when a certificate of the chain or of the
// client CA bundle does not parse, either holds none, the key does not parse (or is encrypted) or
// does not belong to the chain's first certificate.
absl::Status ValidateTlsContents(const TlsContents& contents, const TlsFiles& files);

// Reads the files; NOT_FOUND naming the flag when one cannot be read.
absl::StatusOr<TlsContents> ReadTlsFiles(const TlsFiles& files);

// What a reload did: applied (a changed set that passed the checks) or rejected (a changed set
// that failed them; the last good credentials stay), with one line for the log.
using TlsReloadObserver = std::function<void(bool applied, const std::string& message)>;

// Watches the TLS files and copies each changed set that passes ValidateTlsContents into a
// private directory (mode 0700) that gRPC watches, swapped in at once (a symlink renamed over the
// last one). The directory is removed on destruction. Destroy it after the gRPC server.
class TlsReloader {
 public:
  // Validates and stages `files`, then starts watching them.
  static absl::StatusOr<std::unique_ptr<TlsReloader>> Start(const TlsFiles& files,
                                                            TlsReloadObserver observer);
  ~TlsReloader();
  TlsReloader(const TlsReloader&) = delete;
  TlsReloader& operator=(const TlsReloader&) = delete;

  // The staged copies gRPC reads.
  std::string certificate_path() const { return current_ + "/certificate.pem"; }
  std::string private_key_path() const { return current_ + "/private_key.pem"; }
  std::string client_ca_path() const { return current_ + "/client_ca.pem"; }

  // Reads the files now and applies or rejects a change (the watching thread calls it every
  // reload interval; tests may call it too).
  void CheckForChange();

 private:
  TlsReloader(TlsFiles files, TlsReloadObserver observer, std::string directory);
  absl::Status Stage(const TlsContents& contents);
  void Watch();

  const TlsFiles files_;
  const TlsReloadObserver observer_;
  const std::string directory_;  // the private staging directory
  const std::string current_;    // directory_/current, a symlink to the staged generation
  int generation_ = 0;
  long long last_mtime_ = 0;  // each generation's files get a later mtime than the last's
  TlsContents applied_;       // the set in use
  TlsContents rejected_;      // the last set refused (logged once, not at every check)
  std::mutex check_mutex_;    // one CheckForChange at a time (the thread's, or a caller's)
  std::mutex mutex_;          // guards stopping_
  std::condition_variable stop_requested_;
  bool stopping_ = false;
  std::thread watcher_;
};

// Removes every TlsReloader's staging directory now: for a process about to _exit() without
// running destructors (the copies hold the private key).
void RemoveTlsStagingDirectories();

// The credentials of the gRPC port, the start-up log's line about them, and (TLS only) what keeps
// them current: it must outlive the gRPC server.
struct ServerTransport {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::string description;
  std::unique_ptr<TlsReloader> reloader;
};

// Checks the flags and files (errors name the flag: INVALID_ARGUMENT, or NOT_FOUND for a file that
// cannot be read) and makes the credentials. `observer` hears about every reload after the start.
absl::StatusOr<ServerTransport> MakeServerTransport(const TlsFiles& files,
                                                    TlsReloadObserver observer);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_RPC_TLS_H_
