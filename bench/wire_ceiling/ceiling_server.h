// The wire-ceiling server: answers Backward streams with the bytes attngrad's server would send
// (wire_shape.h), at once and without computing, over one of two transports:
//   protobuf:   the project's attngrad.v1.AttentionGradient/Backward (its generated callback
//               service): every request parsed into a BackwardRequest, every response serialized
//               from a BackwardResponse, as attngrad does;
//   bytebuffer: a generic method taking and giving grpc::ByteBuffer: the request is counted and
//               dropped, the response is a slice of its batch id plus one shared slice of the
//               serialized rest (no user-space copy).
// Each stream says its shape in the metadata kShapeMetadataKey; a request of another size ends the
// stream with INVALID_ARGUMENT. kStatsMethod answers the server process's CPU time and bytes.
// Started with a default shape (--serve), the server also answers attngrad's own client: its
// GetModelInfo, and attngrad.v1 Backward streams without the metadata (answered with that shape's
// response, their requests not size-checked), so that attngrad-cli bench can run against it and
// its client's CPU cost be measured beside the bare client's.
#ifndef ATTNGRAD_BENCH_WIRE_CEILING_CEILING_SERVER_H_
#define ATTNGRAD_BENCH_WIRE_CEILING_CEILING_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server.h"
#include "wire_shape.h"

namespace attngrad::wire_ceiling {

inline constexpr char kByteBufferBackwardMethod[] = "/attngrad.wire_ceiling.WireCeiling/Backward";
inline constexpr char kStatsMethod[] = "/attngrad.wire_ceiling.WireCeiling/ServerStats";

// What the server has done since it started (bytes are serialized message sizes).
struct ServerStats {
  double cpu_seconds = 0;  // user + system of the server process (getrusage)
  int64_t received_bytes = 0;
  int64_t sent_bytes = 0;
  int64_t batches = 0;

  std::string ToText() const;  // "cpu_seconds received_bytes sent_bytes batches"
  static absl::StatusOr<ServerStats> FromText(absl::string_view text);
};

// User + system CPU seconds of this process so far (getrusage).
double ProcessCpuSeconds();

// Counters the streams add to.
struct ServerCounters {
  std::atomic<int64_t> received_bytes{0};
  std::atomic<int64_t> sent_bytes{0};
  std::atomic<int64_t> batches{0};
};

class CeilingServer {
 public:
  // Listens on `address` ("host:port", port 0 = any free one).
  // `default_shape`: see above (nullopt: streams must name their shape; GetModelInfo is
  // UNIMPLEMENTED).
  static absl::StatusOr<std::unique_ptr<CeilingServer>> Start(
      const std::string& address, int64_t max_message_bytes,
      std::optional<WireShape> default_shape = std::nullopt);
  ~CeilingServer();  // shuts the server down
  CeilingServer(const CeilingServer&) = delete;
  CeilingServer& operator=(const CeilingServer&) = delete;

  int port() const { return port_; }

 private:
  class ProtobufService;
  class GenericService;
  CeilingServer();

  ServerCounters counters_;
  std::unique_ptr<ProtobufService> protobuf_service_;
  std::unique_ptr<GenericService> generic_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace attngrad::wire_ceiling

#endif  // ATTNGRAD_BENCH_WIRE_CEILING_CEILING_SERVER_H_
