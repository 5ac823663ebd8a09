// What one attngrad batch puts on the wire, for the wire-ceiling benchmark: the shape of a batch
// (B, S, the layer's configuration, mode, rotary form, input and response dtypes) and the
// attngrad.v1.BackwardRequest / BackwardResponse messages of exactly the size attngrad's client and
// server exchange for it (same fields, same values' encoded lengths; tensor bytes are zeros,
// nothing is computed).
#ifndef ATTNGRAD_BENCH_WIRE_CEILING_WIRE_SHAPE_H_
#define ATTNGRAD_BENCH_WIRE_CEILING_WIRE_SHAPE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attngrad/layer_config.h"
#include "attngrad/v1/attngrad.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attngrad::wire_ceiling {

enum class Rotary { kTables, kPositions };

struct WireShape {
  int64_t batch = 1;     // B
  int64_t seq_len = 16;  // S
  LayerConfig config;    // the SPEC layer by default
  v1::GradientMode mode = v1::GRADIENT_MODE_ACCUMULATE;
  v1::Precision precision = v1::PRECISION_AUTO;
  v1::DType input_dtype = v1::DTYPE_FLOAT32;     // hidden_states and grad_output
  v1::DType response_dtype = v1::DTYPE_FLOAT32;  // grad_hidden_states and the weight gradients
  Rotary rotary = Rotary::kTables;  // as attngrad-cli's --rotary: fp32 cos/sin [B,S,head_dim]

  int64_t tokens() const { return batch * seq_len; }
  // "B,S,hidden,heads,kv_heads,head_dim,mode,precision,input_dtype,response_dtype,rotary" (enum
  // values as numbers): what a stream's metadata tells the server.
  std::string ToMetadata() const;
  static absl::StatusOr<WireShape> FromMetadata(absl::string_view text);
  // "[4,1024] accumulate, input float32, response float32, rotary tables".
  std::string Describe() const;
  // INVALID_ARGUMENT naming the flag when a number is out of range or a dtype unsupported.
  absl::Status Validate() const;
};

// The stream metadata key that carries WireShape::ToMetadata.
inline constexpr char kShapeMetadataKey[] = "attngrad-wire-ceiling-shape";

// Batch ids are chosen in [2^56, 2^63) so that each encodes in 9 bytes, as attngrad's client's
// (random 62-bit starting points) almost always do: every request of a shape has the same size.
inline constexpr uint64_t kFirstBatchId = uint64_t{1} << 60;

// The request attngrad's client sends for `shape` (attngrad-cli bench's fields: batch_id, mode,
// precision, response_dtype, the two inputs, the rotary tables or positions), with batch_id 0.
v1::BackwardRequest MakeRequest(const WireShape& shape);
// The response attngrad's server sends (grad_hidden_states always; the six weight gradients in
// RETURN mode; timings, device, server instance id, weights version, window), with batch_id 0.
v1::BackwardResponse MakeResponse(const WireShape& shape);

// The encoded bytes of field 1 (batch_id) of a message: the tag and the varint. Since protobuf
// writes fields in number order, this followed by the message serialized with batch_id 0 is the
// message serialized with `batch_id`.
std::string EncodeBatchIdField(uint64_t batch_id);

// Reads field 1 (batch_id) at the start of a serialized request or response without copying the
// message; false when the message does not start with it.
bool ReadBatchIdField(grpc::ByteBuffer* message, uint64_t* batch_id);

// `message` serialized into one reference-counted slice that owns its bytes (copies of the slice
// share them; the bytes go with the last copy).
grpc::Slice SerializedSlice(const google::protobuf::MessageLite& message);

// The serialized size of `message` (a request or response with batch_id 0) once its batch_id is
// set to any id the bench uses (all encode in the same 9 bytes).
int64_t SizeWithBatchId(const google::protobuf::MessageLite& message);

}  // namespace attngrad::wire_ceiling

#endif  // ATTNGRAD_BENCH_WIRE_CEILING_WIRE_SHAPE_H_
