// Child processes, ports and HTTP for the end-to-end tests.
#include "test_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attngrad/client.h"
#include "attngrad/common/read_file.h"
#include "test_certificates.h"

extern char** environ;

namespace attngrad::testing {
namespace {

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log_path,
                            const std::string& stdin_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(
      &actions, STDIN_FILENO, stdin_path.empty() ? "/dev/null" : stdin_path.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int error = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(error)));
  }
  return pid;
}

std::string ReadFile(const std::string& path) {
  return common::ReadFileToString(path).value_or("");
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

TempDir::TempDir() {
  std::string pattern =
      (std::filesystem::temp_directory_path() / "attngrad-integration-XXXXXX").string();
  char* made = mkdtemp(pattern.data());
  path_ = made ? made : "/tmp";
}

TempDir::~TempDir() {
  if (path_ == "/tmp") return;
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const std::vector<std::string>& argv,
                                                              const std::string& log_path) {
  auto pid = Spawn(argv, log_path, "");
  if (!pid.ok()) return pid.status();
  return std::unique_ptr<Subprocess>(new Subprocess(*pid, log_path));
}

Subprocess::~Subprocess() { Stop(); }

bool Subprocess::Running() {
  if (exited_) return false;
  int status = 0;
  const pid_t done = waitpid(pid_, &status, WNOHANG);
  if (done == pid_) {
    exited_ = true;
    exit_code_ = ExitCode(status);
  }
  return !exited_;
}

int Subprocess::Stop(absl::Duration grace) {
  if (!Running()) return exit_code_;
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  while (Running() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  if (Running()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    exited_ = true;
    exit_code_ = ExitCode(status);
  }
  return exit_code_;
}

std::string Subprocess::LogTail(size_t bytes) const {
  const std::string text = ReadFile(log_path_);
  return text.size() <= bytes ? text : text.substr(text.size() - bytes);
}

int RunCommand(const std::vector<std::string>& argv, std::string* output,
               const std::string& stdin_path, absl::Duration timeout) {
  TempDir dir;
  const std::string log = dir.path() + "/output.txt";
  auto pid = Spawn(argv, log, stdin_path);
  if (!pid.ok()) {
    *output = pid.status().ToString();
    return -1;
  }
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (waitpid(*pid, &status, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(*pid, SIGKILL);
      waitpid(*pid, &status, 0);
      *output = ReadFile(log) + "\n[killed: timeout]";
      return -1;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  *output = ReadFile(log);
  return ExitCode(status);
}

int PickPort() {
  std::random_device device;
  std::uniform_int_distribution<int> distribution(20000, 59999);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = distribution(device);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) continue;
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
    close(fd);
    if (free) return port;
  }
  return distribution(device);
}

absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path, absl::Duration timeout) {
  return cli::HttpGet(absl::StrCat("127.0.0.1:", port), path, timeout);
}

std::string ServerBinary() { return ATTNGRAD_SERVER_BINARY; }
std::string CliBinary() { return ATTNGRAD_CLI_BINARY; }

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<TestServer>> TestServer::Start(
    const std::vector<std::string>& extra_flags) {
  return Start(extra_flags, ClientOptions());
}

absl::StatusOr<std::unique_ptr<TestServer>> TestServer::Start(
    const std::vector<std::string>& extra_flags, const ClientOptions& probe) {
  std::unique_ptr<TestServer> server(new TestServer());
  server->extra_flags_ = extra_flags;
  server->probe_ = probe;
  server->dir_ = std::make_unique<TempDir>();
  absl::Status status;
  for (int attempt = 0; attempt < 5; ++attempt) {
    server->grpc_port_ = PickPort();
    server->metrics_port_ = PickPort();
    if (server->metrics_port_ == server->grpc_port_) continue;
    status = server->Launch();
    if (status.ok()) return server;
  }
  return status;
}

TestServer::~TestServer() { Stop(); }

std::string TestServer::target() const { return absl::StrCat("127.0.0.1:", grpc_port_); }

std::string TestServer::LogTail() const {
  return process_ ? process_->LogTail() : std::string("(no server process)");
}

int TestServer::Stop() { return process_ ? process_->Stop() : 0; }

absl::Status TestServer::Restart() {
  Stop();
  process_.reset();
  // The ports were ours a moment ago; try them for a while (TIME_WAIT is fine with SO_REUSEADDR).
  absl::Status status;
  for (int attempt = 0; attempt < 5; ++attempt) {
    status = Launch();
    if (status.ok()) return status;
    absl::SleepFor(absl::Milliseconds(500));
  }
  return status;
}

absl::Status TestServer::Launch() {
  ++launches_;
  std::vector<std::string> argv = {ServerBinary(),
                                   absl::StrCat("--listen=127.0.0.1:", grpc_port_),
                                   absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_),
                                   "--devices=cpu",
                                   "--weights=random",
                                   absl::StrCat("--weights_seed=", kWeightsSeed),
                                   absl::StrCat("--max_batch_tokens=", kMaxBatchTokens),
                                   "--cpu_threads=2",
                                   "--shutdown_grace_seconds=5"};
  argv.insert(argv.end(), extra_flags_.begin(), extra_flags_.end());
  const std::string log = absl::StrCat(dir_->path(), "/server-", launches_, ".log");
  auto process = Subprocess::Start(argv, log);
  if (!process.ok()) return process.status();
  process_ = *std::move(process);
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  while (absl::Now() < deadline) {
    if (!process_->Running()) {
      return absl::UnavailableError(
          absl::StrCat("attngrad-server exited during start-up; log:\n", process_->LogTail()));
    }
    ClientOptions options = probe_;
    options.connect_timeout = absl::Seconds(1);
    options.max_attempts = 1;
    if (Client::Connect(target(), options).ok()) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(100));
  }
  const std::string tail = process_->LogTail();
  process_->Stop();
  return absl::DeadlineExceededError(
      absl::StrCat("attngrad-server did not answer within 90 s; log:\n", tail));
}

absl::Status MakeTestCertificates(const std::string& directory) {
  const std::string script = TestCertificatesScript(directory);
  std::string output;
  if (RunCommand({"/bin/sh", "-c", script}, &output) != 0) {
    return absl::InternalError(absl::StrCat("openssl: ", output));
  }
  return absl::OkStatus();
}

std::vector<float> NormalValues(std::size_t count, float scale, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> values(count);
  for (float& value : values) value = normal(generator);
  return values;
}

}  // namespace attngrad::testing
