#include "child_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

namespace attngrad::server {

std::string ServerBinary() {
  const char* override_binary = std::getenv("ATTNGRAD_TEST_SERVER_BINARY");
  if (override_binary != nullptr && *override_binary != '\0') return override_binary;
#ifdef ATTNGRAD_SERVER_BINARY
  return ATTNGRAD_SERVER_BINARY;
#else
  return "";
#endif
}

ChildProcess::ChildProcess(const std::string& binary, const std::vector<std::string>& arguments) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return;
  pid_ = fork();
  if (pid_ == 0) {
    dup2(pipe_fds[1], 1);
    dup2(pipe_fds[1], 2);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(binary.c_str()));
    for (const std::string& argument : arguments)
      argv.push_back(const_cast<char*>(argument.c_str()));
    argv.push_back(nullptr);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  reader_ = std::thread([this, fd = pipe_fds[0]] {
    char buffer[4096];
    ssize_t n;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      log_.append(buffer, static_cast<size_t>(n));
    }
    close(fd);
  });
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    Wait();
  }
  if (reader_.joinable()) reader_.join();
}

std::string ChildProcess::log() {
  std::lock_guard<std::mutex> lock(mutex_);
  return log_;
}

int ChildProcess::WaitServing(double timeout_seconds) {
  const auto start = Clock::now();
  while (SecondsSince(start) < timeout_seconds) {
    const std::string text = log();
    const size_t at = text.find("serving on port ");
    if (at != std::string::npos && text.find(',', at) != std::string::npos) {
      return std::atoi(text.c_str() + at + 16);
    }
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

void ChildProcess::Signal(int signal_number) {
  if (!reaped_) kill(pid_, signal_number);
}

int ChildProcess::WaitExit(double timeout_seconds) {
  const auto start = Clock::now();
  while (true) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      // The child is gone, so the pipe ends: read what it wrote last before anyone reads log()
      // (--help's text came back cut short now and then when log() raced the reader thread).
      if (reader_.joinable()) reader_.join();
      return exit_status_;
    }
    if (SecondsSince(start) >= timeout_seconds) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace attngrad::server
