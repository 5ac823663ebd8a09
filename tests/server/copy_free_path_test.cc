// The copy-free batch path on the CPU backend: the request is read on the received slices
// (rpc/raw_request.h) and the answer sent as slices of the worker's answer buffer. Its results must
// be the bits of the decoded path it replaced: the request decoded by protobuf into fp32 arrays,
// BackwardHost with the server's thread count, the outputs encoded in the response dtype
// (wire::EncodeFromFloat). On GPUs (ATTNGRAD_TEST_DEVICES) the same comparison is made on values,
// within the kernels' tolerance: it checks the device-side fp16/bf16 conversions.
#include <cstring>
#include <string>
#include <vector>

#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "rpc/raw_request.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

constexpr int kCpuThreads = 2;  // ServerTest's options.cpu_threads

v1::Tensor Encoded(const std::vector<float>& values, std::vector<std::int64_t> shape, int dtype) {
  v1::Tensor tensor;
  wire::EncodeTensor(values, shape, dtype, &tensor);
  return tensor;
}

// The answer the decoded path gives: inputs decoded from the request's own tensors.
struct Expected {
  std::string grad_hidden_states;
  PerWeight<std::string> weight_gradients;
};
Expected DecodedPath(const LayerWeights& weights, const v1::BackwardRequest& request,
                     int response_dtype) {
  const LayerConfig& config = weights.config;
  std::vector<float> hidden, grad, cos, sin;
  EXPECT_TRUE(
      wire::DecodeTensor(request.hidden_states(), "h", {-1, -1, config.hidden_size}, &hidden).ok());
  EXPECT_TRUE(
      wire::DecodeTensor(request.grad_output(), "g", {-1, -1, config.hidden_size}, &grad).ok());
  EXPECT_TRUE(
      wire::DecodeTensor(request.rotary_tables().cos(), "c", {-1, -1, config.head_dim}, &cos).ok());
  EXPECT_TRUE(
      wire::DecodeTensor(request.rotary_tables().sin(), "s", {-1, -1, config.head_dim}, &sin).ok());
  const int batch = static_cast<int>(request.hidden_states().shape(0));
  const int seq_len = static_cast<int>(request.hidden_states().shape(1));
  std::vector<float> grad_hidden(hidden.size(), 0.f);
  LayerTensors gradients = ZeroWeights<std::vector<float>>(config);
  BackwardInputs in;
  in.weights = DataOf(weights.values);
  in.hidden_states = hidden.data();
  in.grad_output = grad.data();
  in.cos = cos.data();
  in.sin = sin.data();
  BackwardOutputs out;
  out.grad_hidden_states = grad_hidden.data();
  out.weight_gradients = DataOf(gradients);
  Scalars scalars;
  scalars.scaling = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
  EXPECT_EQ(BackwardHost(config, batch, seq_len, scalars, false, in, out, kCpuThreads).code,
            ATTNGRAD_OK);
  Expected expected;
  wire::EncodeFromFloat(grad_hidden, response_dtype, &expected.grad_hidden_states);
  for (Weight weight : kAllWeights) {
    wire::EncodeFromFloat(gradients[weight], response_dtype, &expected.weight_gradients[weight]);
  }
  return expected;
}

class ServerCopyFreePathTest : public ServerTest {};

TEST_F(ServerCopyFreePathTest, AnswersAreTheBitsOfTheDecodedPathForEveryWireDtype) {
  // 1 x 32 tokens: each activation tensor is 320 KiB (fp32), so it arrives in many slices.
  const Batch batch = MakeBatch(config(), 1, 32, 4242);
  const std::int64_t b = batch.batch, s = batch.seq_len;
  std::uint64_t batch_id = 1;
  for (int input_dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    for (int response_dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
      SCOPED_TRACE(wire::DTypeName(input_dtype) + " in, " + wire::DTypeName(response_dtype) +
                   " out");
      v1::BackwardRequest request =
          MakeRequest(config(), batch, batch_id++, v1::GRADIENT_MODE_RETURN);
      *request.mutable_hidden_states() =
          Encoded(batch.hidden_states, {b, s, config().hidden_size}, input_dtype);
      *request.mutable_grad_output() =
          Encoded(batch.grad_output, {b, s, config().hidden_size}, input_dtype);
      request.set_response_dtype(static_cast<v1::DType>(response_dtype));
      const v1::BackwardResponse response = RunOne(stub(), request);
      ASSERT_FALSE(response.has_error()) << response.error().message();
      const Expected expected = DecodedPath(weights(), request, response_dtype);
      EXPECT_EQ(response.grad_hidden_states().dtype(), response_dtype);
      EXPECT_EQ(response.grad_hidden_states().shape_size(), 3);
      // On GPUs (ATTNGRAD_TEST_DEVICES) the kernels' sums differ from BackwardHost's in their last
      // bits: the answers are compared as values there, within the kernels' tolerance plus the
      // 16-bit rounding of the response.
      const bool gpu = TestOnGpu();
      const double tolerance = Tolerance(0) + (response_dtype == v1::DTYPE_FLOAT32 ? 0 : 1e-2);
      auto same = [&](const v1::Tensor& tensor, const std::string& bytes, const std::string& what) {
        if (!gpu) {
          EXPECT_TRUE(tensor.raw_data() == bytes) << what << " differs from the decoded path";
          return;
        }
        v1::Tensor expected_tensor = tensor;
        expected_tensor.set_raw_data(bytes);
        EXPECT_TRUE(Close(ToFloats(tensor), ToFloats(expected_tensor), tolerance, what));
      };
      same(response.grad_hidden_states(), expected.grad_hidden_states, "grad_hidden_states");
      for (Weight weight : kAllWeights) {
        const v1::Tensor& tensor = wire::GradientTensor(response.weight_gradients(), weight);
        EXPECT_EQ(tensor.dtype(), response_dtype);
        EXPECT_EQ(std::vector<std::int64_t>(tensor.shape().begin(), tensor.shape().end()),
                  WeightShape(config(), weight));
        same(tensor, expected.weight_gradients[weight], WeightModuleName(weight));
      }
    }
  }
}

// The walker on received bytes split into tiny slices, with the tensors' fields repeated (protobuf
// merges them: the last raw_data wins, shapes concatenate) equals protobuf's own parse.
TEST(ReceivedBackwardRequestTest, EqualsProtobufsParseOnAnySlicing) {
  v1::BackwardRequest first;
  first.set_batch_id(9);
  first.mutable_hidden_states()->set_dtype(v1::DTYPE_FLOAT16);
  first.mutable_hidden_states()->add_shape(1);
  first.mutable_hidden_states()->set_raw_data("old-bytes");
  first.mutable_grad_output()->set_raw_data(std::string(1000, 'g'));
  first.mutable_positions()->add_position_ids(3);
  v1::BackwardRequest second;
  second.mutable_hidden_states()->add_shape(2);
  second.mutable_hidden_states()->set_raw_data(std::string(777, 'h'));
  second.set_mode(v1::GRADIENT_MODE_ACCUMULATE);
  const std::string bytes = first.SerializeAsString() + second.SerializeAsString();
  v1::BackwardRequest merged;
  ASSERT_TRUE(merged.ParseFromString(bytes));
  for (std::size_t slice_size : {1u, 3u, 7u, 64u, 100000u}) {
    SCOPED_TRACE(slice_size);
    std::vector<grpc::Slice> slices;
    for (std::size_t offset = 0; offset < bytes.size(); offset += slice_size) {
      slices.emplace_back(bytes.substr(offset, slice_size));
    }
    const grpc::ByteBuffer buffer(slices.data(), slices.size());
    absl::StatusOr<ReceivedBackwardRequest> received = ParseReceivedBackwardRequest(buffer);
    ASSERT_TRUE(received.ok()) << received.status();
    std::string hidden(received->hidden_states.size_bytes(), '\0');
    received->hidden_states.CopyBytes(0, hidden.size(), hidden.data());
    std::string grad(received->grad_output.size_bytes(), '\0');
    received->grad_output.CopyBytes(0, grad.size(), grad.data());
    EXPECT_EQ(hidden, merged.hidden_states().raw_data());
    EXPECT_EQ(grad, merged.grad_output().raw_data());
    v1::BackwardRequest rest = merged;
    rest.mutable_hidden_states()->clear_raw_data();
    rest.mutable_grad_output()->clear_raw_data();
    EXPECT_EQ(received->message.SerializeAsString(), rest.SerializeAsString());
  }
}

TEST(ReceivedBackwardRequestTest, TruncatedOrMalformedBytesAreInvalidArgument) {
  v1::BackwardRequest request;
  request.set_batch_id(5);
  request.mutable_hidden_states()->set_raw_data(std::string(100, 'x'));
  const std::string bytes = request.SerializeAsString();
  for (const std::string& bad : {bytes.substr(0, bytes.size() - 1), std::string("\x00", 1),
                                 std::string("\x2a\x64\x01", 3), std::string("\x0b\x01", 2),
                                 std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11)}) {
    grpc::Slice slice(bad);
    const grpc::ByteBuffer buffer(&slice, 1);
    absl::StatusOr<ReceivedBackwardRequest> received = ParseReceivedBackwardRequest(buffer);
    EXPECT_TRUE(absl::IsInvalidArgument(received.status())) << received.status();
  }
}

}  // namespace
}  // namespace attngrad::server::testing
