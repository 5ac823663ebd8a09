// HTTP/1.0 GET for /metrics and Prometheus's API.
#include "cli/http_get.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attngrad::cli {

absl::StatusOr<HttpResponse> HttpGet(const std::string& address, const std::string& path,
                                     absl::Duration timeout) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (const int error = getaddrinfo(host.c_str(), port.c_str(), &hints, &addresses); error != 0) {
    return absl::UnavailableError(absl::StrCat("resolve ", address, ": ", gai_strerror(error)));
  }
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* a = addresses; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    timeval tv{};
    tv.tv_sec = static_cast<long>(absl::ToInt64Seconds(timeout));
    tv.tv_usec = static_cast<long>(absl::ToInt64Microseconds(timeout) % 1000000);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(addresses);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("connect ", address, ": ", last_error));
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\nConnection: close\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("send to ", address, ": ", std::strerror(errno)));
  }
  std::string raw;
  char buffer[65536];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    raw.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  const size_t space = raw.find(' ');
  const size_t header_end = raw.find("\r\n\r\n");
  HttpResponse response;
  if (space == std::string::npos || header_end == std::string::npos ||
      !absl::SimpleAtoi(raw.substr(space + 1, 3), &response.status)) {
    return absl::DataLossError(
        absl::StrCat("bad HTTP response from ", address, ": '", raw.substr(0, 200), "'"));
  }
  response.body = raw.substr(header_end + 4);
  return response;
}

std::string UrlEncode(absl::string_view text) {
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  return out;
}

}  // namespace attngrad::cli
