// BackwardRequests read on gRPC's receive slices (request_walker.h) and answers written as slices.
#include "rpc/raw_request.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/request_walker.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"

namespace attngrad::server {

absl::StatusOr<ReceivedBackwardRequest> ParseReceivedBackwardRequest(
    const grpc::ByteBuffer& bytes) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!bytes.Dump(slices.get()).ok()) {
    return NotAMessage("attngrad.v1.BackwardRequest", "unreadable bytes");
  }
  std::vector<absl::string_view> pieces;
  pieces.reserve(slices->size());
  for (const grpc::Slice& slice : *slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return WalkBackwardRequest(pieces, std::move(slices));
}

absl::Status ParseReceivedMessage(grpc::ByteBuffer* bytes, google::protobuf::Message* message) {
  grpc::ProtoBufferReader reader(bytes);
  if (!message->ParseFromZeroCopyStream(&reader)) {
    return NotAMessage(message->GetDescriptor()->full_name().c_str(),
                       "the bytes are not its encoding");
  }
  return absl::OkStatus();
}

namespace {

constexpr int kLengthDelimited = 2;

std::size_t VarintSize(std::uint64_t value) {
  std::size_t size = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++size;
  }
  return size;
}

// The encoding of `fields` (outermost first) nested around a raw_data (Tensor field 3) of `bytes`
// bytes: the header that goes in front of the payload slice.
std::string RawDataHeader(std::initializer_list<int> fields, std::size_t bytes) {
  constexpr int kRawDataField = 3;
  // Sizes from the inside out.
  std::vector<int> path(fields);
  std::vector<std::size_t> lengths(path.size());
  std::size_t inner = VarintSize(kRawDataField << 3 | kLengthDelimited) + VarintSize(bytes) + bytes;
  for (std::size_t i = path.size(); i-- > 0;) {
    lengths[i] = inner;
    inner +=
        VarintSize(static_cast<std::uint64_t>(path[i]) << 3 | kLengthDelimited) + VarintSize(inner);
  }
  std::string header;
  for (std::size_t i = 0; i < path.size(); ++i) {
    AppendVarint(static_cast<std::uint64_t>(path[i]) << 3 | kLengthDelimited, &header);
    AppendVarint(lengths[i], &header);
  }
  AppendVarint(kRawDataField << 3 | kLengthDelimited, &header);
  AppendVarint(bytes, &header);
  return header;
}

void DeleteAnswer(void* answer) { delete static_cast<AnswerBuffer*>(answer); }

void SetShape(absl::Span<const std::int64_t> shape, int dtype, v1::Tensor* tensor) {
  tensor->set_dtype(static_cast<v1::DType>(dtype));
  tensor->clear_shape();
  for (std::int64_t dim : shape) tensor->add_shape(dim);
}

}  // namespace

grpc::ByteBuffer SerializeBackwardResponse(v1::BackwardResponse response, BatchJob& job,
                                           bool grad_hidden_states_in_region,
                                           bool weight_gradients_in_region) {
  constexpr int kGradHiddenStatesField = 4;  // BackwardResponse.grad_hidden_states
  constexpr int kWeightGradientsField = 5;   // BackwardResponse.weight_gradients
  const LayerConfig& config = job.config;
  const int dtype = job.response_dtype;
  const std::size_t element_size = wire::DTypeSize(dtype);
  SetShape({job.batch, job.seq_len, config.hidden_size}, dtype,
           response.mutable_grad_hidden_states());
  if (job.return_weight_gradients) {
    for (Weight weight : kAllWeights) {
      SetShape(WeightShape(config, weight), dtype,
               wire::MutableGradientTensor(response.mutable_weight_gradients(), weight));
    }
  }
  v1::StageTimings* timings = response.mutable_timings();
  timings->set_queue_seconds(job.stages.queue);
  timings->set_copy_in_seconds(job.stages.copy_in);
  timings->set_compute_seconds(job.stages.compute);
  timings->set_copy_out_seconds(job.stages.copy_out);
  timings->set_total_seconds(job.stages.total);
  response.set_device(job.device);

  // The message's own fields, then each tensor's raw_data as a slice of the answer buffer.
  std::vector<grpc::Slice> slices;
  slices.emplace_back(response.SerializeAsString());
  auto* answer = new AnswerBuffer(std::move(job.answer));
  const grpc::Slice whole(answer->bytes.get(), answer->size, DeleteAnswer, answer);
  std::size_t offset = 0;
  auto add = [&](std::initializer_list<int> fields, std::size_t elements, bool send = true) {
    const std::size_t bytes = elements * element_size;
    if (!send) {
      offset += bytes;
      return;
    }
    slices.emplace_back(RawDataHeader(fields, bytes));
    if (bytes > 0) slices.push_back(whole.sub(offset, offset + bytes));
    offset += bytes;
  };
  add({kGradHiddenStatesField}, job.activations(), !grad_hidden_states_in_region);
  if (job.return_weight_gradients) {
    for (Weight weight : kAllWeights) {
      add({kWeightGradientsField, static_cast<int>(wire::WireWeightName(weight))},
          WeightElements(config, weight), !weight_gradients_in_region);
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace attngrad::server
