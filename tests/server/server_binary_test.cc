// The attngrad-server binary: its flag handling and its exit on SIGTERM. (The fp16/bf16 conversion
// and the safetensors JSON these tests once covered are the wire library's: tests/proto.)
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace attngrad::server {
namespace {

#ifdef ATTNGRAD_SERVER_BINARY
// Runs attngrad-server with `arguments`; returns its exit status after `action` (given the pid and
// the stderr read so far once the server says it is serving, or at exit).
int RunServer(const std::vector<std::string>& arguments, bool send_sigterm, std::string* log) {
  int pipe_fds[2];
  EXPECT_EQ(pipe(pipe_fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(pipe_fds[1], 2);
    close(pipe_fds[0]);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(ATTNGRAD_SERVER_BINARY));
    for (const std::string& argument : arguments)
      argv.push_back(const_cast<char*>(argument.c_str()));
    argv.push_back(nullptr);
    execv(ATTNGRAD_SERVER_BINARY, argv.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  char buffer[4096];
  ssize_t n;
  bool signalled = false;
  while ((n = read(pipe_fds[0], buffer, sizeof buffer)) > 0) {
    log->append(buffer, static_cast<std::size_t>(n));
    if (send_sigterm && !signalled && log->find("serving on port") != std::string::npos) {
      kill(pid, SIGTERM);
      signalled = true;
    }
  }
  close(pipe_fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(ServerBinaryTest, SigtermExitsZero) {
  std::string log;
  EXPECT_EQ(RunServer({"--listen=127.0.0.1:0", "--metrics_listen=", "--devices=cpu",
                       "--shutdown_grace_seconds=5"},
                      true, &log),
            0)
      << log;
  EXPECT_NE(log.find("stopped"), std::string::npos) << log;
}

TEST(ServerBinaryTest, BadFlagsFailWithAMessage) {
  std::string log;
  EXPECT_NE(RunServer({"--listen=127.0.0.1:0", "--metrics_listen=", "--devices=7"}, false, &log),
            0);
  EXPECT_NE(log.find("--devices"), std::string::npos) << log;
  log.clear();
  EXPECT_NE(RunServer({"--listen=127.0.0.1:0", "--metrics_listen=", "--devices=cpu",
                       "--weights=/nonexistent.safetensors"},
                      false, &log),
            0);
  EXPECT_NE(log.find("--weights"), std::string::npos) << log;
}
#endif

}  // namespace
}  // namespace attngrad::server
