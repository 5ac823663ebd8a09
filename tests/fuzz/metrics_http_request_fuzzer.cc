// libFuzzer target: the /metrics endpoint's request-head parser (server/metrics/http_request.h).
// Parses the input whole and every prefix the server could have received, with a limit taken
// from the first byte; checks what a complete head reports against the input.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "metrics/http_request.h"

using attngrad::server::HttpParseResult;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::size_t max_head_bytes = 1 + data[0] * 4;
  const absl::string_view received(reinterpret_cast<const char*>(data) + 1, size - 1);
  for (std::size_t prefix = 0; prefix <= received.size(); prefix += 1 + prefix / 8) {
    const HttpParseResult parsed =
        attngrad::server::ParseHttpRequestHead(received.substr(0, prefix), max_head_bytes);
    const attngrad::server::HttpAnswer answer = attngrad::server::ChooseHttpAnswer(parsed);
    if (answer.status < 200 || answer.status > 599) __builtin_trap();
    if (parsed.outcome == HttpParseResult::Outcome::kComplete) {
      if (parsed.head_bytes == 0 || parsed.head_bytes > prefix ||
          parsed.head_bytes > max_head_bytes) {
        __builtin_trap();
      }
      if (parsed.head.path.empty() || parsed.head.path.front() != '/') __builtin_trap();
    }
    if (parsed.outcome == HttpParseResult::Outcome::kNeedMore && prefix >= max_head_bytes) {
      __builtin_trap();  // the limit must end the reading
    }
  }
  return 0;
}
