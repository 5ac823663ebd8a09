// The request head of the /metrics endpoint's HTTP/1.x: a pure parser over the bytes received so
// far (no I/O, no allocation beyond the result), so that it can be unit-tested and fuzzed
// (tests/fuzz/metrics_http_request_fuzzer.cc), and the answer chosen for a parsed request.
#ifndef ATTNGRAD_SERVER_METRICS_HTTP_REQUEST_H_
#define ATTNGRAD_SERVER_METRICS_HTTP_REQUEST_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace attngrad::server {

struct HttpRequestHead {
  std::string method;     // "GET"
  std::string path;       // "/metrics" (the request target without its query)
  std::string query;      // after '?', without it; empty when there is none
  int minor_version = 1;  // HTTP/1.<minor_version>
};

struct HttpParseResult {
  enum class Outcome {
    kNeedMore,    // no end of the head yet and fewer than max_head_bytes received: read more
    kComplete,    // `head` holds the request; `head_bytes` bytes of the buffer were its head
    kBadRequest,  // not an HTTP/1.x request head (`error` says why): answer 400
    kTooLarge,    // no end of the head within max_head_bytes: answer 431
  };
  Outcome outcome = Outcome::kNeedMore;
  HttpRequestHead head;
  std::size_t head_bytes = 0;
  std::string error;
};

// Parses the request line and header lines of `received` (CRLF or bare LF line ends, a blank line
// ends the head). Only the request line is kept; header lines are checked for a "name:" form. Never
// reads past `received`; bytes after the head (a body, a pipelined request) are ignored.
HttpParseResult ParseHttpRequestHead(absl::string_view received, std::size_t max_head_bytes);

// The answer to a request head: status line text, content type and body (the body of a 200 is
// left to the caller, which serializes the registry then).
struct HttpAnswer {
  int status = 200;
  std::string reason = "OK";
  std::string body;  // for errors
  bool serve_metrics = false;
  bool send_body = true;  // false for HEAD
};
HttpAnswer ChooseHttpAnswer(const HttpParseResult& parsed);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_METRICS_HTTP_REQUEST_H_
