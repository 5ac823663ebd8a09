// The region socket's messages (attngrad/wire/region_socket.h): formatting and strict parsing.
#include "attngrad/wire/region_socket.h"

#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attngrad::wire {

namespace {

// Non-empty, printable ASCII, no spaces: the only values the protocol carries.
bool IsPlainValue(absl::string_view value) {
  if (value.empty()) return false;
  for (char c : value) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

// A decimal of 1 to 19 digits (no sign, no spaces) into *number.
bool ParseDecimal(absl::string_view text, std::uint64_t* number) {
  if (text.empty() || text.size() > 19) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(text, number);
}

// The message's lines after the protocol line; INVALID_ARGUMENT (or `code`) naming what is wrong.
absl::StatusOr<std::vector<absl::string_view>> SplitMessage(absl::string_view message,
                                                            absl::string_view what) {
  if (message.size() > kMaxRegionMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", message.size(), " bytes; expected at most ", kMaxRegionMessageBytes));
  }
  if (!absl::EndsWith(message, "\n")) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the last line does not end in '\\n'"));
  }
  message.remove_suffix(1);
  std::vector<absl::string_view> lines = absl::StrSplit(message, '\n');
  if (lines.front() != kRegionProtocolLine) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the first line is not \"", kRegionProtocolLine, "\""));
  }
  lines.erase(lines.begin());
  return lines;
}

// Stores one "key value" line of a request into *request.
absl::Status ReadRequestLine(absl::string_view line, std::size_t number,
                             RegionSocketRequest* request) {
  const std::size_t space = line.find(' ');
  const absl::string_view key = line.substr(0, space);
  const absl::string_view value =
      space == absl::string_view::npos ? absl::string_view() : line.substr(space + 1);
  if (!IsPlainValue(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("line ", number,
                     ": expected \"<key> <value>\", the value printable ASCII "
                     "without spaces"));
  }
  if (key == "byte_size") {
    std::uint64_t size = 0;
    if (request->byte_size != 0) return absl::InvalidArgumentError("byte_size: given twice");
    if (!ParseDecimal(value, &size) || size == 0 || size > std::uint64_t{INT64_MAX}) {
      return absl::InvalidArgumentError("byte_size: expected a decimal number of bytes > 0");
    }
    request->byte_size = static_cast<std::int64_t>(size);
  } else if (key == "token" || key == "client_id") {
    std::optional<std::string>& field = key == "token" ? request->token : request->client_id;
    if (field.has_value()) return absl::InvalidArgumentError(absl::StrCat(key, ": given twice"));
    field = std::string(value);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("line ", number, ": unknown key; expected byte_size, token or client_id"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string FormatRegionRequest(const RegionSocketRequest& request) {
  std::string message = absl::StrCat(kRegionProtocolLine, "\nbyte_size ", request.byte_size, "\n");
  if (request.token.has_value()) absl::StrAppend(&message, "token ", *request.token, "\n");
  if (request.client_id.has_value()) {
    absl::StrAppend(&message, "client_id ", *request.client_id, "\n");
  }
  return message;
}

absl::StatusOr<RegionSocketRequest> ParseRegionRequest(absl::string_view message) {
  absl::StatusOr<std::vector<absl::string_view>> lines = SplitMessage(message, "request");
  if (!lines.ok()) return lines.status();
  RegionSocketRequest request;
  for (std::size_t index = 0; index < lines->size(); ++index) {
    absl::Status line = ReadRequestLine((*lines)[index], index + 2, &request);
    if (!line.ok()) return line;
  }
  if (request.byte_size == 0) {
    return absl::InvalidArgumentError("byte_size: missing; expected the region's bytes (> 0)");
  }
  return request;
}

std::string FormatRegionReply(const absl::StatusOr<std::uint64_t>& region_id) {
  if (region_id.ok()) return absl::StrCat(kRegionProtocolLine, "\nok ", *region_id, "\n");
  std::string text(region_id.status().message());
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::string reply =
      absl::StrCat(kRegionProtocolLine, "\nerror ", static_cast<int>(region_id.status().code()));
  // The message is cut so that the reply stays within kMaxRegionMessageBytes.
  const std::size_t room = kMaxRegionMessageBytes - reply.size() - 2;
  absl::StrAppend(&reply, " ", text.substr(0, room), "\n");
  return reply;
}

absl::StatusOr<std::uint64_t> ParseRegionReply(absl::string_view message) {
  absl::StatusOr<std::vector<absl::string_view>> lines = SplitMessage(message, "reply");
  if (!lines.ok() || lines->size() != 1) {
    return absl::DataLossError(absl::StrCat(
        "the region socket's reply is not one: ",
        lines.ok() ? "expected one line after the protocol line" : lines.status().message()));
  }
  const absl::string_view line = lines->front();
  std::uint64_t number = 0;
  if (absl::StartsWith(line, "ok ") && ParseDecimal(line.substr(3), &number) && number != 0) {
    return number;
  }
  const std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 2));
  if (parts.size() == 3 && parts[0] == "error" && ParseDecimal(parts[1], &number) && number >= 1 &&
      number <= 16) {
    return absl::Status(static_cast<absl::StatusCode>(number), parts[2]);
  }
  return absl::DataLossError("the region socket's reply is not one: expected ok or error");
}

std::string DefaultRegionSocketPath(int port) {
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  const std::string directory =
      runtime != nullptr && runtime[0] == '/'
          ? absl::StrCat(runtime, "/attngrad")
          : absl::StrCat("/tmp/attngrad-", static_cast<std::uint64_t>(geteuid()));
  return absl::StrCat(directory, "/regions-", port, ".sock");
}

std::optional<int> TargetPort(absl::string_view target) {
  if (absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:")) {
    return std::nullopt;
  }
  const std::size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos) return std::nullopt;
  std::uint64_t port = 0;
  if (!ParseDecimal(target.substr(colon + 1), &port) || port == 0 || port > 65535) {
    return std::nullopt;
  }
  return static_cast<int>(port);
}

}  // namespace attngrad::wire
