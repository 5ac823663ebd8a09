// HTTP/1.x request heads of the /metrics endpoint.
#include "metrics/http_request.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace attngrad::server {
namespace {

constexpr int kMaxHeaderLines = 100;

// RFC 9110 tchar.
bool IsTokenChar(char c) {
  if (absl::ascii_isalnum(static_cast<unsigned char>(c))) return true;
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~': return true;
    default: return false;
  }
}

bool IsToken(absl::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!IsTokenChar(c)) return false;
  }
  return true;
}

// Visible ASCII (no spaces, no control characters).
bool IsVisible(absl::string_view text) {
  for (char c : text) {
    if (c <= ' ' || c >= 0x7f) return false;
  }
  return true;
}

HttpParseResult Bad(std::string error) {
  HttpParseResult result;
  result.outcome = HttpParseResult::Outcome::kBadRequest;
  result.error = std::move(error);
  return result;
}

// Splits the next line off `rest` (its end: "\r\n" or "\n"); false when there is no line end.
bool NextLine(absl::string_view* rest, absl::string_view* line) {
  const std::size_t newline = rest->find('\n');
  if (newline == absl::string_view::npos) return false;
  *line = rest->substr(0, newline);
  if (!line->empty() && line->back() == '\r') line->remove_suffix(1);
  rest->remove_prefix(newline + 1);
  return true;
}

}  // namespace

HttpParseResult ParseHttpRequestHead(absl::string_view received, std::size_t max_head_bytes) {
  // Only the first max_head_bytes count: a head must end within them.
  absl::string_view rest = received.substr(0, max_head_bytes);
  // Where the head ends: the first empty line (leading empty lines are not allowed: RFC 9112
  // lets a server ignore them, this one calls them a bad request).
  absl::string_view request_line;
  if (!NextLine(&rest, &request_line)) {
    HttpParseResult result;
    result.outcome = received.size() >= max_head_bytes ? HttpParseResult::Outcome::kTooLarge
                                                       : HttpParseResult::Outcome::kNeedMore;
    return result;
  }

  // The header lines, up to the blank line.
  int header_lines = 0;
  std::string header_error;
  while (true) {
    absl::string_view line;
    if (!NextLine(&rest, &line)) {
      HttpParseResult result;
      result.outcome = received.size() >= max_head_bytes ? HttpParseResult::Outcome::kTooLarge
                                                         : HttpParseResult::Outcome::kNeedMore;
      return result;
    }
    if (line.empty()) break;
    if (header_error.empty()) {
      if (++header_lines > kMaxHeaderLines) {
        header_error = absl::StrCat("more than ", kMaxHeaderLines, " header lines");
      } else if (line.front() == ' ' || line.front() == '\t') {
        header_error = "folded header line (obsolete line folding is not accepted)";
      } else {
        const std::size_t colon = line.find(':');
        if (colon == absl::string_view::npos || !IsToken(line.substr(0, colon))) {
          header_error = "a header line is not \"name: value\"";
        }
      }
    }
  }
  const std::size_t head_bytes = received.substr(0, max_head_bytes).size() - rest.size();

  // The request line: method SP target SP HTTP/1.x
  const std::size_t first_space = request_line.find(' ');
  if (first_space == absl::string_view::npos) return Bad("request line has no spaces");
  const std::size_t second_space = request_line.find(' ', first_space + 1);
  if (second_space == absl::string_view::npos) return Bad("request line has no HTTP version");
  const absl::string_view method = request_line.substr(0, first_space);
  const absl::string_view target =
      request_line.substr(first_space + 1, second_space - first_space - 1);
  const absl::string_view version = request_line.substr(second_space + 1);
  if (!IsToken(method)) return Bad("the method is not a token");
  if (target.empty() || !IsVisible(target))
    return Bad("the request target is empty or not visible ASCII");
  if (target.front() != '/') return Bad("the request target does not start with '/'");
  if (version.size() != 8 || !absl::StartsWith(version, "HTTP/1.") ||
      !absl::ascii_isdigit(static_cast<unsigned char>(version[7]))) {
    return Bad("the version is not HTTP/1.x");
  }
  if (!header_error.empty()) return Bad(header_error);

  HttpParseResult result;
  result.outcome = HttpParseResult::Outcome::kComplete;
  result.head_bytes = head_bytes;
  result.head.method = std::string(method);
  const std::size_t question = target.find('?');
  result.head.path = std::string(target.substr(0, question));
  if (question != absl::string_view::npos)
    result.head.query = std::string(target.substr(question + 1));
  result.head.minor_version = version[7] - '0';
  return result;
}

HttpAnswer ChooseHttpAnswer(const HttpParseResult& parsed) {
  HttpAnswer answer;
  switch (parsed.outcome) {
    case HttpParseResult::Outcome::kNeedMore:
    case HttpParseResult::Outcome::kBadRequest:
      answer.status = 400;
      answer.reason = "Bad Request";
      answer.body = absl::StrCat(
          "bad request: ", parsed.error.empty() ? "incomplete request head" : parsed.error, "\n");
      return answer;
    case HttpParseResult::Outcome::kTooLarge:
      answer.status = 431;
      answer.reason = "Request Header Fields Too Large";
      answer.body = "request head too large\n";
      return answer;
    case HttpParseResult::Outcome::kComplete: break;
  }
  const bool is_head = parsed.head.method == "HEAD";
  answer.send_body = !is_head;
  if (parsed.head.method != "GET" && !is_head) {
    answer.status = 405;
    answer.reason = "Method Not Allowed";
    answer.body = "only GET and HEAD\n";
  } else if (parsed.head.path != "/metrics") {
    answer.status = 404;
    answer.reason = "Not Found";
    answer.body = "metrics are at /metrics\n";
  } else {
    answer.serve_metrics = true;
  }
  return answer;
}

}  // namespace attngrad::server
