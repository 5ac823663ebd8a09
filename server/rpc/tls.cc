// TLS and mutual-TLS server credentials from checked, staged copies of the files (see tls.h).
#include "rpc/tls.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <set>

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/str_cat.h"
#include "attngrad/common/read_file.h"
#include "attngrad/common/status_macros.h"

namespace attngrad::server {
namespace {

// How often gRPC re-reads the staged copies (local files that change only when a checked set is
// staged: a new set is in use within this of being staged).
constexpr unsigned int kStagedReloadSeconds = 1;

// OpenSSL's reason for the last error (cleared), for messages.
std::string OpenSslReason() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no PEM data";
  char text[256];
  ERR_error_string_n(code, text, sizeof text);
  return text;
}

using Bio = std::unique_ptr<BIO, decltype(&BIO_free)>;
using Certificate = std::unique_ptr<X509, decltype(&X509_free)>;
using PrivateKey = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;

Bio MemoryBio(const std::string& text) {
  return Bio(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())), &BIO_free);
}

// Every PEM certificate of `pem`, parsed in order; an error (naming `flag` and `path`) when there
// is none or one does not parse.
absl::StatusOr<std::vector<Certificate>> ParseCertificates(const std::string& pem, const char* flag,
                                                           const std::string& path) {
  ERR_clear_error();
  Bio bio = MemoryBio(pem);
  std::vector<Certificate> certificates;
  while (true) {
    X509* parsed = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (parsed == nullptr) break;
    certificates.emplace_back(parsed, &X509_free);
  }
  // The loop ends at the end of the data (no further PEM block), or at a block that does not parse.
  const unsigned long last = ERR_peek_last_error();
  const bool at_end =
      ERR_GET_LIB(last) == ERR_LIB_PEM && ERR_GET_REASON(last) == PEM_R_NO_START_LINE;
  if (certificates.empty() || !at_end) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path,
                     certificates.empty() ? " holds no certificate that parses ("
                                          : " holds a certificate that does not parse (after ",
                     certificates.empty() ? "" : absl::StrCat(certificates.size(), " that do: "),
                     OpenSslReason(), ")"));
  }
  ERR_clear_error();
  return certificates;
}

// Answers OpenSSL's passphrase prompt with no passphrase: an encrypted key does not load (gRPC
// could not use it either) instead of waiting for a terminal.
int NoPassphrase(char*, int, int, void*) { return 0; }

absl::StatusOr<PrivateKey> ParsePrivateKey(const std::string& pem, const std::string& path) {
  ERR_clear_error();
  Bio bio = MemoryBio(pem);
  PrivateKey key(PEM_read_bio_PrivateKey(bio.get(), nullptr, &NoPassphrase, nullptr),
                 &EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key: ", path,
        " holds no private key that parses (unencrypted PEM expected: ", OpenSslReason(), ")"));
  }
  ERR_clear_error();
  return key;
}

absl::Status WriteStagedFile(const std::string& path, const std::string& contents,
                             long long mtime) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", path));
  std::size_t written = 0;
  while (written < contents.size()) {
    const ssize_t n = write(fd, contents.data() + written, contents.size() - written);
    if (n <= 0) break;
    written += static_cast<std::size_t>(n);
  }
  // gRPC's watcher re-reads a pair whose mtimes changed while it read them: each generation's
  // files get a later mtime than the last's, so a swap in the middle of a read is noticed.
  const timespec times[2] = {{static_cast<time_t>(mtime), 0}, {static_cast<time_t>(mtime), 0}};
  const bool ok = written == contents.size() && futimens(fd, times) == 0;
  return close(fd) == 0 && ok ? absl::OkStatus()
                              : absl::InternalError(absl::StrCat("cannot write ", path));
}

// The staging directories of the live TlsReloaders (RemoveTlsStagingDirectories).
std::mutex staging_directories_mutex;
std::set<std::string>& StagingDirectories() {
  static std::set<std::string>* const directories = new std::set<std::string>();
  return *directories;
}

}  // namespace

void RemoveTlsStagingDirectories() {
  std::lock_guard<std::mutex> lock(staging_directories_mutex);
  for (const std::string& directory : StagingDirectories()) {
    std::error_code ignored;
    std::filesystem::remove_all(directory, ignored);
  }
}

bool operator==(const TlsContents& a, const TlsContents& b) {
  return a.certificate == b.certificate && a.private_key == b.private_key &&
         a.client_ca == b.client_ca;
}

absl::Status ValidateTlsContents(const TlsContents& contents, const TlsFiles& files) {
  ATTNGRAD_ASSIGN_OR_RETURN(
      const std::vector<Certificate> chain,
      ParseCertificates(contents.certificate, "--tls_cert", files.certificate));
  ATTNGRAD_ASSIGN_OR_RETURN(const PrivateKey key,
                            ParsePrivateKey(contents.private_key, files.private_key));
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: ", files.private_key, " is not the key of --tls_cert ",
                     files.certificate, " (its first certificate's public key differs)"));
  }
  if (!files.client_ca.empty()) {
    ATTNGRAD_RETURN_IF_ERROR(
        ParseCertificates(contents.client_ca, "--tls_client_ca", files.client_ca).status());
  }
  return absl::OkStatus();
}

absl::StatusOr<TlsContents> ReadTlsFiles(const TlsFiles& files) {
  TlsContents contents;
  ATTNGRAD_ASSIGN_OR_RETURN(contents.certificate,
                            common::ReadFileToString(files.certificate, "--tls_cert"));
  ATTNGRAD_ASSIGN_OR_RETURN(contents.private_key,
                            common::ReadFileToString(files.private_key, "--tls_key"));
  if (!files.client_ca.empty()) {
    ATTNGRAD_ASSIGN_OR_RETURN(contents.client_ca,
                              common::ReadFileToString(files.client_ca, "--tls_client_ca"));
  }
  return contents;
}

absl::StatusOr<std::unique_ptr<TlsReloader>> TlsReloader::Start(const TlsFiles& files,
                                                                TlsReloadObserver observer) {
  ATTNGRAD_ASSIGN_OR_RETURN(TlsContents contents, ReadTlsFiles(files));
  ATTNGRAD_RETURN_IF_ERROR(ValidateTlsContents(contents, files));
  const char* temporary = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(temporary != nullptr && *temporary != '\0' ? temporary : "/tmp",
                   "/attngrad-tls-staging-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("TLS: cannot make a private staging directory like ", pattern));
  }
  std::unique_ptr<TlsReloader> reloader(
      new TlsReloader(files, std::move(observer), std::move(pattern)));
  ATTNGRAD_RETURN_IF_ERROR(reloader->Stage(contents));
  reloader->applied_ = std::move(contents);
  reloader->watcher_ = std::thread([raw = reloader.get()] { raw->Watch(); });
  return reloader;
}

TlsReloader::TlsReloader(TlsFiles files, TlsReloadObserver observer, std::string directory)
    : files_(std::move(files)),
      observer_(std::move(observer)),
      directory_(std::move(directory)),
      current_(directory_ + "/current") {
  std::lock_guard<std::mutex> lock(staging_directories_mutex);
  StagingDirectories().insert(directory_);
}

TlsReloader::~TlsReloader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_requested_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  std::lock_guard<std::mutex> lock(staging_directories_mutex);
  StagingDirectories().erase(directory_);
  std::error_code ignored;
  std::filesystem::remove_all(directory_, ignored);
}

// Writes generation N's files into directory_/gN, points a new symlink at it and renames that over
// directory_/current (one atomic step for all three files), then removes generation N-2 (N-1 may
// still be open in a read that began before the swap).
absl::Status TlsReloader::Stage(const TlsContents& contents) {
  ++generation_;
  const std::string name = absl::StrCat("g", generation_);
  const std::string generation_directory = absl::StrCat(directory_, "/", name);
  if (mkdir(generation_directory.c_str(), 0700) != 0) {
    return absl::InternalError(absl::StrCat("TLS: cannot make ", generation_directory));
  }
  last_mtime_ = std::max<long long>(last_mtime_ + 1, std::time(nullptr));
  ATTNGRAD_RETURN_IF_ERROR(WriteStagedFile(generation_directory + "/certificate.pem",
                                           contents.certificate, last_mtime_));
  ATTNGRAD_RETURN_IF_ERROR(WriteStagedFile(generation_directory + "/private_key.pem",
                                           contents.private_key, last_mtime_));
  ATTNGRAD_RETURN_IF_ERROR(
      WriteStagedFile(generation_directory + "/client_ca.pem", contents.client_ca, last_mtime_));
  const std::string link = current_ + ".new";
  unlink(link.c_str());
  if (symlink(name.c_str(), link.c_str()) != 0 ||
      std::rename(link.c_str(), current_.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("TLS: cannot point ", current_, " at ", name));
  }
  std::error_code ignored;
  std::filesystem::remove_all(absl::StrCat(directory_, "/g", generation_ - 2), ignored);
  return absl::OkStatus();
}

void TlsReloader::CheckForChange() {
  std::lock_guard<std::mutex> lock(check_mutex_);
  absl::StatusOr<TlsContents> contents = ReadTlsFiles(files_);
  absl::Status checked = contents.ok() ? ValidateTlsContents(*contents, files_) : contents.status();
  if (contents.ok() && (*contents == applied_ || (!checked.ok() && *contents == rejected_))) return;
  if (checked.ok()) checked = Stage(*contents);
  if (checked.ok()) {
    applied_ = *std::move(contents);
    rejected_ = TlsContents();
    observer_(true, absl::StrCat("TLS: reloaded the changed files (certificate ",
                                 files_.certificate, ")"));
    return;
  }
  if (contents.ok()) rejected_ = *std::move(contents);
  observer_(false, absl::StrCat("TLS: the changed files are refused, the last good credentials "
                                "stay in use: ",
                                checked.message()));
}

void TlsReloader::Watch() {
  const auto interval = std::chrono::seconds(files_.reload_interval_seconds);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_requested_.wait_for(lock, interval, [this] { return stopping_; })) {
    lock.unlock();
    CheckForChange();
    lock.lock();
  }
}

absl::StatusOr<ServerTransport> MakeServerTransport(const TlsFiles& files,
                                                    TlsReloadObserver observer) {
  ServerTransport transport;
  if (files.certificate.empty() && files.private_key.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is TLS with client "
          "certificates)");
    }
    transport.credentials = grpc::InsecureServerCredentials();
    transport.description = "gRPC transport: plaintext (no --tls_cert)";
    return transport;
  }
  if (files.certificate.empty() || files.private_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (files.reload_interval_seconds < 1) {
    return absl::InvalidArgumentError("--tls_reload_interval_seconds must be >= 1");
  }
  ATTNGRAD_ASSIGN_OR_RETURN(transport.reloader, TlsReloader::Start(files, std::move(observer)));
  const TlsReloader& staged = *transport.reloader;
  const bool mutual = !files.client_ca.empty();
  auto provider =
      mutual ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                   staged.private_key_path(), staged.certificate_path(), staged.client_ca_path(),
                   kStagedReloadSeconds)
             : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                   staged.private_key_path(), staged.certificate_path(), kStagedReloadSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (mutual) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  transport.credentials = grpc::experimental::TlsServerCredentials(options);
  if (transport.credentials == nullptr) {
    return absl::InternalError("gRPC could not make TLS server credentials");
  }
  transport.description = absl::StrCat(
      "gRPC transport: ",
      mutual ? absl::StrCat("mutual TLS (client certificates required, verified against ",
                            files.client_ca, ")")
             : "TLS",
      "; certificate ", files.certificate,
      ", reloaded when the files change and pass the checks "
      "(checked every ",
      files.reload_interval_seconds,
      " s; a bad set is refused and the last "
      "good one kept)");
  return transport;
}

}  // namespace attngrad::server
