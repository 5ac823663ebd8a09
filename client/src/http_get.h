// A minimal HTTP/1.0 GET over a TCP socket (no TLS, no redirects, no chunked encoding), enough to
// read a Prometheus /metrics page or Prometheus's HTTP API without further dependencies.
#ifndef ATTNGRAD_CLIENT_SRC_HTTP_GET_H_
#define ATTNGRAD_CLIENT_SRC_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attngrad {

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET http://<host:port><path>. `address` is "host:port" (a name or an IPv4/IPv6 literal).
absl::StatusOr<HttpResponse> HttpGet(const std::string& address, const std::string& path,
                                     absl::Duration timeout = absl::Seconds(10));

// Percent-encodes everything but unreserved characters (for query strings).
std::string UrlEncode(const std::string& text);

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_SRC_HTTP_GET_H_
