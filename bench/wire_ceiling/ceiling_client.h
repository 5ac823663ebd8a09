// The wire-ceiling client: attngrad-cli bench's traffic without attngrad. --streams Backward
// streams spread round-robin over --channels separate TCP connections, each keeping up to
// --in_flight batches outstanding (a batch is in flight from its write until its answer arrives),
// after
// --warmup batches per stream answered one at a time before the clock starts; --count batches per
// stream, or as many as fit in --duration_seconds when --count is 0.
#ifndef ATTNGRAD_BENCH_WIRE_CEILING_CEILING_CLIENT_H_
#define ATTNGRAD_BENCH_WIRE_CEILING_CEILING_CLIENT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ceiling_server.h"
#include "wire_shape.h"

namespace attngrad::wire_ceiling {

enum class Transport { kProtobuf, kByteBuffer };

struct RunOptions {
  std::string target;
  WireShape shape;
  Transport transport = Transport::kProtobuf;
  int channels = 1;
  int streams = 4;
  int in_flight = 4;
  int warmup = 1;
  int64_t count = 1;  // batches per stream; 0 = run for `duration`
  absl::Duration duration = absl::Seconds(10);
  int64_t max_message_bytes = int64_t{1} << 30;
  absl::Duration connect_timeout = absl::Seconds(10);
};

// The timed part of a run (warm-up excluded). Bytes are serialized message sizes, as attngrad-cli
// bench counts them.
struct RunResult {
  int64_t batches = 0;
  int64_t tokens = 0;
  double seconds = 0;                    // from the start of timing to the last answer
  int64_t request_bytes = 0;             // sent by the client
  int64_t response_bytes = 0;            // received by the client
  int64_t request_bytes_per_batch = 0;   // what the shape implies
  int64_t response_bytes_per_batch = 0;  // what the shape implies
  double p50_seconds = 0, p90_seconds = 0, p99_seconds = 0, max_seconds = 0;  // round trips
  ServerStats server;             // the server's counts over the timed part (CPU, bytes, batches)
  double client_cpu_seconds = 0;  // this process over the timed part
  int64_t errors = 0;
  std::string first_error;
};

absl::StatusOr<RunResult> RunClient(const RunOptions& options);

}  // namespace attngrad::wire_ceiling

#endif  // ATTNGRAD_BENCH_WIRE_CEILING_CEILING_CLIENT_H_
