// A child process for the tests that drive binaries (attngrad-server, attngrad-cli) from outside:
// fork/exec with stdout and stderr collected, the server's port from its log, signals, exit status.
// ServerBinary() is attngrad-server (ATTNGRAD_TEST_SERVER_BINARY in the environment runs another,
// e.g. an older build, to see a test fail).
#ifndef ATTNGRAD_TESTS_SERVER_CHILD_PROCESS_H_
#define ATTNGRAD_TESTS_SERVER_CHILD_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "scheduling/device_worker.h"

namespace attngrad::server {

using Clock = std::chrono::steady_clock;
// SecondsSince(start): scheduling/device_worker.h.

// The attngrad-server binary to run ("" when the build did not say).
std::string ServerBinary();

// `binary` with `arguments` as a child process; its stdout and stderr collected by a reader
// thread. SIGKILLed and reaped on destruction if still running.
class ChildProcess {
 public:
  ChildProcess(const std::string& binary, const std::vector<std::string>& arguments);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  std::string log();
  // The gRPC port once the server says it is serving; 0 after `timeout_seconds` or an exit.
  int WaitServing(double timeout_seconds);
  void Signal(int signal_number);
  // Exit status (128 + signal when killed); -1 when still running after `timeout_seconds`.
  int WaitExit(double timeout_seconds);
  int Wait() { return WaitExit(1e9); }
  bool exited() const { return reaped_; }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int exit_status_ = -1;
  std::mutex mutex_;
  std::string log_;
  std::thread reader_;
};

// attngrad-server (ServerBinary()) as a child process.
class ServerProcess : public ChildProcess {
 public:
  explicit ServerProcess(const std::vector<std::string>& arguments)
      : ChildProcess(ServerBinary(), arguments) {}
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_TESTS_SERVER_CHILD_PROCESS_H_
