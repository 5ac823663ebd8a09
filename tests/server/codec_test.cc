// Pieces under the service: fp16/bf16 conversion, the JSON reader of safetensors headers, and the
// attngrad-server binary's flag handling and SIGTERM exit.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "half_float.h"
#include "json_value.h"

namespace attngrad::server {
namespace {

TEST(ServerCodecTest, HalfRoundTripsEveryValue) {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = HalfToFloat(static_cast<std::uint16_t>(bits));
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(value))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(value), bits) << "half bits " << bits << " value " << value;
  }
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(FloatToHalf(65520.f), 0x7c00);                // rounds to infinity
  EXPECT_EQ(FloatToHalf(65519.f), 0x7bff);                // 65504
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // half the smallest subnormal: to even
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), 0x0001);
}

TEST(ServerCodecTest, BFloat16RoundsToNearestEven) {
  for (std::uint32_t bits = 0; bits < 0x10000; bits += 7) {
    const float value = BFloat16ToFloat(static_cast<std::uint16_t>(bits));
    if (!std::isnan(value)) ASSERT_EQ(FloatToBFloat16(value), bits);
  }
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie to even (up)
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(NAN))));
}

TEST(ServerCodecTest, JsonReader) {
  absl::StatusOr<JsonValue> value = ParseJson(
      R"( {"a": [1, 2.5e3, -0.5], "s": "x\"\u00e9\ud83d\ude00", "o": {"t": true, "n": null}} )");
  ASSERT_TRUE(value.ok()) << value.status();
  ASSERT_NE(value->Find("a"), nullptr);
  EXPECT_EQ(value->Find("a")->array.size(), 3u);
  EXPECT_EQ(value->Find("a")->array[1].number, 2500.0);
  EXPECT_EQ(value->Find("a")->array[0].text, "1");
  EXPECT_EQ(value->Find("s")->text, "x\"\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(value->Find("o")->Find("t")->boolean);
  for (const char* bad : {"", "{", "{\"a\":}", "[1,]", "{\"a\":1} x", "\"\\q\"", "01x", "[1 2]"}) {
    EXPECT_FALSE(ParseJson(bad).ok()) << bad;
  }
  std::string deep(100, '[');
  EXPECT_FALSE(ParseJson(deep).ok());
}

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
    for (const std::string& argument : arguments) argv.push_back(const_cast<char*>(argument.c_str()));
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
  EXPECT_NE(RunServer({"--listen=127.0.0.1:0", "--metrics_listen=", "--devices=7"}, false, &log), 0);
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
