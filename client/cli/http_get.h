// A minimal HTTP/1.0 GET over a TCP socket (no TLS, no redirects, no chunked encoding): enough to
// read a Prometheus /metrics page or Prometheus's HTTP API, for the CLI and the tests.
#ifndef ATTNGRAD_CLI_HTTP_GET_H_
#define ATTNGRAD_CLI_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attngrad::cli {

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET http://<address><path>, where `address` is "host:port" (a name, an IPv4 literal or a
// bracketed IPv6 literal). UNAVAILABLE when it cannot connect; DATA_LOSS for a reply that is not
// HTTP. Any status code is returned as it is.
absl::StatusOr<HttpResponse> HttpGet(const std::string& address, const std::string& path,
                                     absl::Duration timeout = absl::Seconds(10));

// Percent-encodes everything but the unreserved characters (for query strings).
std::string UrlEncode(absl::string_view text);

}  // namespace attngrad::cli

#endif  // ATTNGRAD_CLI_HTTP_GET_H_
