// libFuzzer target: the wire walker (attngrad/wire/message_walker.h) on BackwardResponses, as the
// client reads the server's answers (the nested paths of weight_gradients' tensors included). The
// first input byte chooses how the rest is cut into pieces (1 to 256 bytes each, as receive slices
// would be); the rest is the message. Differential against protobuf: bytes the walker accepts and
// whose other fields protobuf parses (as wire::ReadBackwardResponse does) must parse with protobuf,
// whole, to the same response (each tensor's raw_data equal to the walker's payload,
// every other field equal); the walker may refuse what protobuf accepts only for groups (wire
// types 3 and 4).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attngrad/v1/attngrad.pb.h"
#include "attngrad/wire/backward_paths.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/message_walker.h"
#include "received_pieces.h"

namespace {

std::string Joined(const std::vector<absl::string_view>& pieces) {
  std::string bytes;
  for (absl::string_view piece : pieces) bytes.append(piece.data(), piece.size());
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using attngrad::kAllWeights;
  namespace wire = attngrad::wire;
  if (size == 0) return 0;
  attngrad::fuzz::ReceivedPieces input;
  attngrad::fuzz::CutIntoPieces(data, size, &input);
  const std::string& message = input.message;
  const std::vector<absl::string_view>& pieces = input.pieces;
  absl::StatusOr<wire::WalkedMessage> walked = wire::WalkMessage(
      pieces, wire::BackwardResponseTensorPaths(), "attngrad.v1.BackwardResponse");
  attngrad::v1::BackwardResponse parsed;
  const bool protobuf_ok = parsed.ParseFromString(message);
  if (!walked.ok()) {
    if (!absl::IsInvalidArgument(walked.status())) __builtin_trap();
    return 0;
  }
  // What the client accepts: the walk, then protobuf's parse of the rest (e.g. a string field's
  // UTF-8 is checked there). It refuses exactly what protobuf refuses.
  attngrad::v1::BackwardResponse rest;
  const bool rest_ok = rest.ParseFromString(walked->rest);
  if (rest_ok != protobuf_ok) __builtin_trap();
  if (!rest_ok) return 0;
  // The tensors: present alike, raw_data equal to the payloads (empty where absent), then the rest
  // equal once raw_data is cleared.
  auto check = [&](bool parsed_has, bool rest_has, attngrad::v1::Tensor* parsed_tensor,
                   const attngrad::v1::Tensor& rest_tensor, std::size_t path) {
    if (parsed_has != rest_has) __builtin_trap();
    if (!rest_tensor.raw_data().empty()) __builtin_trap();
    const std::string expected = parsed_has ? parsed_tensor->raw_data() : std::string();
    if (Joined(walked->payloads[path]) != expected) __builtin_trap();
    if (parsed_has) parsed_tensor->clear_raw_data();
  };
  const bool parsed_has_grad_hidden = parsed.has_grad_hidden_states();
  check(parsed_has_grad_hidden, rest.has_grad_hidden_states(),
        parsed_has_grad_hidden ? parsed.mutable_grad_hidden_states() : nullptr,
        rest.grad_hidden_states(), 0);
  if (parsed.has_weight_gradients() != rest.has_weight_gradients()) __builtin_trap();
  if (parsed.has_weight_gradients()) {
    const google::protobuf::Descriptor* descriptor = attngrad::v1::WeightGradients::descriptor();
    const google::protobuf::Reflection* reflection = attngrad::v1::WeightGradients::GetReflection();
    for (std::size_t w = 0; w < kAllWeights.size(); ++w) {
      const google::protobuf::FieldDescriptor* field =
          descriptor->FindFieldByNumber(static_cast<int>(wire::WireWeightName(kAllWeights[w])));
      const bool parsed_has = reflection->HasField(parsed.weight_gradients(), field);
      const bool rest_has = reflection->HasField(rest.weight_gradients(), field);
      check(parsed_has, rest_has,
            parsed_has
                ? wire::MutableGradientTensor(parsed.mutable_weight_gradients(), kAllWeights[w])
                : nullptr,
            wire::GradientTensor(rest.weight_gradients(), kAllWeights[w]), w + 1);
    }
  }
  if (parsed.SerializeAsString() != rest.SerializeAsString()) __builtin_trap();
  return 0;
}
