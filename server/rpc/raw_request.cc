// BackwardRequests read on gRPC's receive slices (request_walker.h) and answers written as slices.
#include "rpc/raw_request.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/backward_paths.h"
#include "attngrad/wire/byte_buffer.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "rpc/request_walker.h"

namespace attngrad::server {

absl::StatusOr<ReceivedBackwardRequest> ParseReceivedBackwardRequest(
    const grpc::ByteBuffer& bytes) {
  ATTNGRAD_ASSIGN_OR_RETURN(wire::ReceivedPieces received,
                            wire::PiecesOf(bytes, "attngrad.v1.BackwardRequest"));
  return WalkBackwardRequest(received.pieces, std::move(received.owner));
}

absl::Status ParseReceivedMessage(grpc::ByteBuffer* bytes, google::protobuf::Message* message) {
  grpc::ProtoBufferReader reader(bytes);
  if (!message->ParseFromZeroCopyStream(&reader)) {
    return wire::NotAMessage(message->GetDescriptor()->full_name().c_str(),
                             "the bytes are not its encoding");
  }
  return absl::OkStatus();
}

absl::Status ParseCallRequest(const grpc::ByteBuffer& bytes, const char* method,
                              google::protobuf::Message* request) {
  const std::string& type = request->GetDescriptor()->full_name();
  if (!bytes.Valid()) {
    return absl::InvalidArgumentError(
        absl::StrCat(method, ": no whole request arrived (the call ended inside or before its ",
                     type, "); send the request again"));
  }
  grpc::ByteBuffer copy = bytes;  // the reader consumes its buffer; the slices are shared
  grpc::ProtoBufferReader reader(&copy);
  if (!request->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(absl::StrCat(method, ": the request does not parse as an ",
                                                   type, " (the bytes are not its encoding)"));
  }
  return absl::OkStatus();
}

namespace {

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
  const LayerConfig& config = job.request.config;
  const int dtype = job.request.response_dtype;
  const std::size_t element_size = wire::DTypeSize(dtype);
  // The answer buffer's [B,S,hidden] tensor: grad_hidden_states, or a FORWARD batch's output.
  SetShape({job.request.batch, job.request.seq_len, config.hidden_size}, dtype,
           job.forward() ? response.mutable_output() : response.mutable_grad_hidden_states());
  if (job.request.return_weight_gradients) {
    for (Weight weight : kAllWeights) {
      SetShape(WeightShape(config, weight), dtype,
               wire::MutableGradientTensor(response.mutable_weight_gradients(), weight));
    }
  }
  v1::StageTimings* timings = response.mutable_timings();
  timings->set_queue_seconds(job.result.stages.queue);
  timings->set_copy_in_seconds(job.result.stages.copy_in);
  timings->set_compute_seconds(job.result.stages.compute);
  timings->set_copy_out_seconds(job.result.stages.copy_out);
  timings->set_total_seconds(job.result.stages.total);
  response.set_device(job.result.device);

  // The message's own fields, with each tensor's raw_data a slice of the answer buffer.
  auto* answer = new AnswerBuffer(std::move(job.result.answer));
  const grpc::Slice whole(answer->bytes.data(), answer->size, DeleteAnswer, answer);
  // The answer buffer holds the tensors in BackwardResponseTensorPaths' order (a FORWARD batch's:
  // the output alone).
  const std::vector<wire::FieldPath>& all_paths = wire::BackwardResponseTensorPaths();
  std::vector<wire::FieldPath> paths;
  std::vector<grpc::Slice> payloads;
  std::size_t offset = 0;
  auto add = [&](const wire::FieldPath& path, std::size_t elements, bool send) {
    const std::size_t bytes = elements * element_size;
    paths.push_back(path);
    payloads.push_back(send ? whole.sub(offset, offset + bytes) : grpc::Slice());
    offset += bytes;
  };
  const wire::FieldPath output_path = {v1::BackwardResponse::kOutputFieldNumber};
  add(job.forward() ? output_path : all_paths[0], job.activations(), !grad_hidden_states_in_region);
  if (job.request.return_weight_gradients) {
    for (std::size_t w = 0; w < kAllWeights.size(); ++w) {
      add(all_paths[w + 1], WeightElements(config, kAllWeights[w]), !weight_gradients_in_region);
    }
  }
  absl::StatusOr<grpc::ByteBuffer> bytes = wire::SerializeWithPayloads(response, paths, payloads);
  // Every path's tensor was set above: only a bug here fails, answered as INTERNAL.
  if (!bytes.ok()) {
    v1::BackwardResponse failed;
    failed.set_batch_id(response.batch_id());
    failed.mutable_error()->set_code(static_cast<int>(bytes.status().code()));
    failed.mutable_error()->set_message(std::string(bytes.status().message()));
    return SerializeMessage(failed);
  }
  return *std::move(bytes);
}

grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace attngrad::server
