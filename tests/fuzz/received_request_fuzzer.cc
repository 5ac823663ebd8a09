// libFuzzer target: the Backward request walker (server/rpc/request_walker.h), which reads
// untrusted bytes where gRPC received them. The first input byte chooses how the rest is cut into
// pieces (1 to 256 bytes each, as receive slices would be); the rest is the message. Differential
// against protobuf: bytes the walker accepts must parse with protobuf to the same request (the
// activations' raw data equal to what the walker's WireTensors hold, every other field equal);
// the walker may refuse what protobuf accepts only for groups (wire types 3 and 4).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attngrad/v1/attngrad.pb.h"
#include "rpc/request_walker.h"
#include "received_pieces.h"

namespace {

std::string Bytes(const attngrad::server::WireTensor& tensor) {
  std::string bytes(tensor.size_bytes(), '\0');
  tensor.CopyBytes(0, bytes.size(), bytes.data());
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  attngrad::fuzz::ReceivedPieces input;
  attngrad::fuzz::CutIntoPieces(data, size, &input);
  const std::string& message = input.message;
  const std::vector<absl::string_view>& pieces = input.pieces;
  absl::StatusOr<attngrad::server::ReceivedBackwardRequest> walked =
      attngrad::server::WalkBackwardRequest(pieces, nullptr);
  attngrad::v1::BackwardRequest parsed;
  const bool protobuf_ok = parsed.ParseFromString(message);
  if (!walked.ok()) {
    if (!absl::IsInvalidArgument(walked.status())) __builtin_trap();
    return 0;
  }
  if (!protobuf_ok) __builtin_trap();  // accepted what is no BackwardRequest
  if (Bytes(walked->hidden_states) != parsed.hidden_states().raw_data()) __builtin_trap();
  if (Bytes(walked->grad_output) != parsed.grad_output().raw_data()) __builtin_trap();
  // has_* of the tensors must agree too (a tensor with only raw_data is still present).
  if (parsed.has_hidden_states() != walked->message.has_hidden_states() ||
      parsed.has_grad_output() != walked->message.has_grad_output()) {
    __builtin_trap();
  }
  if (parsed.has_hidden_states()) parsed.mutable_hidden_states()->clear_raw_data();
  if (parsed.has_grad_output()) parsed.mutable_grad_output()->clear_raw_data();
  if (parsed.SerializeAsString() != walked->message.SerializeAsString()) __builtin_trap();
  return 0;
}
