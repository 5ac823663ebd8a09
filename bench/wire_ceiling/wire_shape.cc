#include "wire_shape.h"

#include <memory>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "attngrad/layer_weights.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace attngrad::wire_ceiling {
namespace {

// Sets `tensor` to `shape` in `dtype`, all bytes zero (their values do not matter to the
// transport: nothing is compressed).
void FillTensor(const std::vector<int64_t>& shape, v1::DType dtype, v1::Tensor* tensor) {
  tensor->set_dtype(dtype);
  for (int64_t dimension : shape) tensor->add_shape(dimension);
  tensor->mutable_raw_data()->resize(static_cast<size_t>(wire::NumElements(shape)) *
                                     wire::DTypeSize(dtype));
}

}  // namespace

std::string WireShape::ToMetadata() const {
  return absl::StrCat(batch, ",", seq_len, ",", config.hidden_size, ",", config.num_heads, ",",
                      config.num_kv_heads, ",", config.head_dim, ",", static_cast<int>(mode), ",",
                      static_cast<int>(precision), ",", static_cast<int>(input_dtype), ",",
                      static_cast<int>(response_dtype), ",", rotary == Rotary::kTables ? 1 : 0);
}

absl::StatusOr<WireShape> WireShape::FromMetadata(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ',');
  std::vector<int64_t> values;
  for (absl::string_view part : parts) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(part, &value)) break;
    values.push_back(value);
  }
  if (parts.size() != 11 || values.size() != 11) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata ", kShapeMetadataKey, " \"", text,
                     "\": expected 11 comma-separated integers (B,S,hidden,heads,kv_heads,"
                     "head_dim,mode,precision,input_dtype,response_dtype,rotary tables 0/1)"));
  }
  WireShape shape;
  shape.batch = values[0];
  shape.seq_len = values[1];
  shape.config.hidden_size = static_cast<int>(values[2]);
  shape.config.num_heads = static_cast<int>(values[3]);
  shape.config.num_kv_heads = static_cast<int>(values[4]);
  shape.config.head_dim = static_cast<int>(values[5]);
  shape.mode = static_cast<v1::GradientMode>(values[6]);
  shape.precision = static_cast<v1::Precision>(values[7]);
  shape.input_dtype = static_cast<v1::DType>(values[8]);
  shape.response_dtype = static_cast<v1::DType>(values[9]);
  shape.rotary = values[10] != 0 ? Rotary::kTables : Rotary::kPositions;
  absl::Status valid = shape.Validate();
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata ", kShapeMetadataKey, " \"", text, "\": ", valid.message()));
  }
  return shape;
}

std::string WireShape::Describe() const {
  return absl::StrFormat(
      "[%d,%d] (%d tokens), layer %d/%d/%d/%d, mode %s, input %s, response %s, rotary %s", batch,
      seq_len, tokens(), config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
      mode == v1::GRADIENT_MODE_ACCUMULATE ? "accumulate" : "return", wire::DTypeName(input_dtype),
      wire::DTypeName(response_dtype), rotary == Rotary::kTables ? "tables" : "positions");
}

absl::Status WireShape::Validate() const {
  if (batch < 1 || seq_len < 1 || tokens() > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat("--batch ", batch, " and --seq_len ", seq_len,
                                                   ": need both >= 1 and B*S <= 2^24"));
  }
  // LayerConfig::IsValid's rule, spelled out here: that lives in the kernels' library, which this
  // program does not link (it needs gRPC, not the kernels).
  if (config.hidden_size < 1 || config.num_heads < 1 || config.num_kv_heads < 1 ||
      config.head_dim < 2 || config.num_heads % config.num_kv_heads != 0 ||
      config.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer config hidden_size ", config.hidden_size, ", num_heads ", config.num_heads,
        ", num_kv_heads ", config.num_kv_heads, ", head_dim ", config.head_dim,
        ": need positive numbers, num_heads a multiple of num_kv_heads and an even head_dim"));
  }
  if (mode != v1::GRADIENT_MODE_ACCUMULATE && mode != v1::GRADIENT_MODE_RETURN) {
    return absl::InvalidArgumentError(absl::StrCat("--mode ", mode, ": accumulate or return"));
  }
  if (!wire::IsSupportedDType(input_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--input_dtype ", wire::DTypeName(input_dtype), ": not a wire dtype"));
  }
  if (!wire::IsSupportedDType(response_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--response_dtype ", wire::DTypeName(response_dtype), ": not a wire dtype"));
  }
  return absl::OkStatus();
}

v1::BackwardRequest MakeRequest(const WireShape& shape) {
  const int64_t B = shape.batch, S = shape.seq_len, H = shape.config.hidden_size,
                D = shape.config.head_dim;
  v1::BackwardRequest request;
  request.set_mode(shape.mode);
  request.set_precision(shape.precision);
  request.set_response_dtype(shape.response_dtype);
  FillTensor({B, S, H}, shape.input_dtype, request.mutable_hidden_states());
  FillTensor({B, S, H}, shape.input_dtype, request.mutable_grad_output());
  if (shape.rotary == Rotary::kTables) {
    FillTensor({B, S, D}, v1::DTYPE_FLOAT32, request.mutable_rotary_tables()->mutable_cos());
    FillTensor({B, S, D}, v1::DTYPE_FLOAT32, request.mutable_rotary_tables()->mutable_sin());
  } else {
    v1::RotaryPositions* positions = request.mutable_positions();
    for (int64_t s = 0; s < S; ++s) positions->add_position_ids(s);
  }
  return request;
}

v1::BackwardResponse MakeResponse(const WireShape& shape) {
  v1::BackwardResponse response;
  FillTensor({shape.batch, shape.seq_len, shape.config.hidden_size}, shape.response_dtype,
             response.mutable_grad_hidden_states());
  if (shape.mode == v1::GRADIENT_MODE_RETURN) {
    for (Weight weight : kAllWeights) {
      FillTensor(WeightShape(shape.config, weight), shape.response_dtype,
                 wire::MutableGradientTensor(response.mutable_weight_gradients(), weight));
    }
  }
  // What attngrad's server adds (gradient_service.cc): non-zero timings, the device, its
  // 32-hex-digit instance id, the weights version and (ACCUMULATE) the window, an id below 2^51.
  v1::StageTimings* timings = response.mutable_timings();
  timings->set_queue_seconds(1e-3);
  timings->set_copy_in_seconds(1e-3);
  timings->set_compute_seconds(1e-3);
  timings->set_copy_out_seconds(1e-3);
  timings->set_total_seconds(4e-3);
  response.set_device("cuda:0");
  response.set_server_instance_id(std::string(32, 'f'));
  response.set_weights_version(1);
  if (shape.mode == v1::GRADIENT_MODE_ACCUMULATE) {
    response.set_accumulation_window_id((uint64_t{1} << 50) + 1);
  }
  return response;
}

static_assert(v1::BackwardRequest::kBatchIdFieldNumber == 1 &&
              v1::BackwardResponse::kBatchIdFieldNumber == 1);

std::string EncodeBatchIdField(uint64_t batch_id) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteTag(1 << 3);  // field 1, wire type 0 (varint)
    coded.WriteVarint64(batch_id);
  }
  return out;
}

bool ReadBatchIdField(grpc::ByteBuffer* message, uint64_t* batch_id) {
  grpc::ProtoBufferReader reader(message);
  google::protobuf::io::CodedInputStream input(&reader);
  return input.ReadTag() == (1 << 3) && input.ReadVarint64(batch_id);
}

grpc::Slice SerializedSlice(const google::protobuf::MessageLite& message) {
  auto bytes = std::make_unique<std::string>(message.SerializeAsString());
  const size_t size = bytes->size();
  std::string* owned = bytes.release();
  return grpc::Slice(
      owned->data(), size, [](void* owner) { delete static_cast<std::string*>(owner); }, owned);
}

int64_t SizeWithBatchId(const google::protobuf::MessageLite& message) {
  return static_cast<int64_t>(message.ByteSizeLong() + EncodeBatchIdField(kFirstBatchId).size());
}

}  // namespace attngrad::wire_ceiling
