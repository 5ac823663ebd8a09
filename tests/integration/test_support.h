// Support for the end-to-end tests: child processes (the real attngrad-server, prometheus,
// promtool, attngrad-cli) started and stopped by RAII objects, loopback port picking, and a minimal
// HTTP/1.0 GET for /metrics and Prometheus's HTTP API. Everything talks to 127.0.0.1 only.
#ifndef ATTNGRAD_TESTS_INTEGRATION_TEST_SUPPORT_H_
#define ATTNGRAD_TESTS_INTEGRATION_TEST_SUPPORT_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attngrad/client.h"
#include "cli/http_get.h"

namespace attngrad::testing {

// A temporary directory removed (with its contents) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A child process with stdout and stderr appended to `log_path`. The destructor stops it
// (SIGTERM, then SIGKILL after a grace period).
class Subprocess {
 public:
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const std::vector<std::string>& argv,
                                                           const std::string& log_path);
  ~Subprocess();
  bool Running();
  // SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit code (128+signal when killed).
  int Stop(absl::Duration grace = absl::Seconds(15));
  pid_t pid() const { return pid_; }
  std::string LogTail(size_t bytes = 6000) const;

 private:
  Subprocess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}
  pid_t pid_;
  std::string log_path_;
  bool exited_ = false;
  int exit_code_ = -1;
};

// Runs a command to completion (stdin from `stdin_path` when given) and returns its exit code;
// stdout and stderr together in *output.
int RunCommand(const std::vector<std::string>& argv, std::string* output,
               const std::string& stdin_path = "", absl::Duration timeout = absl::Seconds(300));

// A random loopback port in [20000, 60000) that could be bound just now.
int PickPort();

// `count` draws of N(0, scale²) from a generator seeded with `seed` (the same values every run).
std::vector<float> NormalValues(std::size_t count, float scale, unsigned seed);

// GET http://127.0.0.1:port<path> (cli/http_get.h).
using ::attngrad::cli::HttpResponse;
absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path,
                                     absl::Duration timeout = absl::Seconds(10));
using ::attngrad::cli::UrlEncode;

// The real attngrad-server on loopback ports with the CPU backend and random weights of seed 7.
class TestServer {
 public:
  static constexpr uint64_t kWeightsSeed = 7;
  static constexpr int kMaxBatchTokens = 32;

  // Starts the server (retrying with other ports when they are taken) and waits until it answers
  // a client connecting with `probe`'s credentials, token and client id.
  static absl::StatusOr<std::unique_ptr<TestServer>> Start(
      const std::vector<std::string>& extra_flags = {});
  static absl::StatusOr<std::unique_ptr<TestServer>> Start(
      const std::vector<std::string>& extra_flags, const ClientOptions& probe);
  ~TestServer();

  std::string target() const;
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  std::string LogTail() const;
  // SIGTERM; returns the exit code.
  int Stop();
  // Stops it and starts a new process on the same ports.
  absl::Status Restart();

 private:
  TestServer() = default;
  absl::Status Launch();

  std::vector<std::string> extra_flags_;
  ClientOptions probe_;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Subprocess> process_;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  int launches_ = 0;
};

// Writes, with the openssl CLI, the certificates of tests/common/test_certificates.h into
// `directory`. An error carries openssl's output.
absl::Status MakeTestCertificates(const std::string& directory);

// Path of a binary built next to the tests (set by CMake).
std::string ServerBinary();
std::string CliBinary();

}  // namespace attngrad::testing

#endif  // ATTNGRAD_TESTS_INTEGRATION_TEST_SUPPORT_H_
