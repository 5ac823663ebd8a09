// libFuzzer target: the region socket's messages (attngrad/wire/region_socket.h), the request the
// server parses from any local peer and the reply the client parses. A request that parses must
// format back to an equal request; a reply that parses must be an id or a status of a known code;
// every reply the server can format must parse back to what it said.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "attngrad/wire/region_socket.h"

namespace wire = attngrad::wire;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<wire::RegionSocketRequest> request = wire::ParseRegionRequest(input);
  if (request.ok()) {
    if (request->byte_size <= 0) __builtin_trap();
    const absl::StatusOr<wire::RegionSocketRequest> again =
        wire::ParseRegionRequest(wire::FormatRegionRequest(*request));
    if (!again.ok() || again->byte_size != request->byte_size || again->token != request->token ||
        again->client_id != request->client_id) {
      __builtin_trap();
    }
  }
  const absl::StatusOr<std::uint64_t> reply = wire::ParseRegionReply(input);
  if (reply.ok() && *reply == 0) __builtin_trap();
  if (!reply.ok() && reply.status().code() == absl::StatusCode::kOk) __builtin_trap();
  // Any message the server might send about this input comes back as sent (newlines become
  // spaces, long messages are cut).
  const absl::Status error(absl::StatusCode::kInvalidArgument, input);
  const std::string formatted = wire::FormatRegionReply(error);
  if (formatted.size() > wire::kMaxRegionMessageBytes) __builtin_trap();
  const absl::StatusOr<std::uint64_t> parsed = wire::ParseRegionReply(formatted);
  if (parsed.ok() || parsed.status().code() != absl::StatusCode::kInvalidArgument) {
    __builtin_trap();
  }
  return 0;
}
