// Bytes that are not a message: a Backward stream that receives bytes which do not parse as a
// BackwardRequest ends with INVALID_ARGUMENT and computes nothing after them; a LoadWeights upload
// followed by such bytes is not committed. The client is a raw-bytes one (grpc::GenericStub), so
// that it can send what a generated stub never would.
#include <grpcpp/generic/generic_stub.h>

#include <string>
#include <vector>

#include "attngrad/wire/tensor.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

constexpr char kBackwardMethod[] = "/attngrad.v1.AttentionGradient/Backward";
constexpr char kLoadWeightsMethod[] = "/attngrad.v1.AttentionGradient/LoadWeights";

// A length-delimited field 5 (hidden_states) announcing 100 bytes and carrying 3: no parser
// accepts it.
const std::string kNotAMessage("\x2a\x64\x01\x02\x03", 5);

grpc::ByteBuffer ToByteBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromByteBuffer(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return bytes;
}

// One streaming call of raw messages on a completion queue, each operation waited for.
class RawCall {
 public:
  RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method)
      : stub_(channel) {
    call_ = stub_.PrepareCall(&context_, method, &queue_);
    call_->StartCall(Tag(1));
    EXPECT_TRUE(Wait(1));
  }
  ~RawCall() {
    context_.TryCancel();
    queue_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  bool Write(const std::string& bytes) {
    grpc::ByteBuffer buffer = ToByteBuffer(bytes);
    call_->Write(buffer, Tag(2));
    return Wait(2);
  }
  bool WritesDone() {
    call_->WritesDone(Tag(3));
    return Wait(3);
  }
  // The next message, or nothing when the server has ended the stream.
  std::optional<std::string> Read() {
    grpc::ByteBuffer buffer;
    call_->Read(&buffer, Tag(4));
    if (!Wait(4)) return std::nullopt;
    return FromByteBuffer(buffer);
  }
  grpc::Status Finish() {
    grpc::Status status;
    call_->Finish(&status, Tag(5));
    EXPECT_TRUE(Wait(5));
    return status;
  }

 private:
  static void* Tag(std::intptr_t value) { return reinterpret_cast<void*>(value); }
  bool Wait(std::intptr_t expected) {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(queue_.Next(&tag, &ok));
    EXPECT_EQ(tag, Tag(expected));
    return ok;
  }

  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
};

class ServerWireIntegrityTest : public ServerTest {
 protected:
  std::string Serialized(std::uint64_t batch_id) {
    const Batch batch = MakeBatch(config(), 1, 4, batch_id);
    return MakeRequest(config(), batch, batch_id, v1::GRADIENT_MODE_ACCUMULATE).SerializeAsString();
  }

  std::int64_t AccumulatedBatches() {
    v1::FetchGradientsRequest request;
    Fetched fetched = Fetch(stub(), request);
    EXPECT_TRUE(fetched.status.ok()) << fetched.status.error_message();
    return fetched.state.batches();
  }

  std::uint64_t WeightsVersion() {
    v1::GetModelInfoResponse info;
    grpc::ClientContext context;
    EXPECT_TRUE(stub().GetModelInfo(&context, {}, &info).ok());
    return info.weights_version();
  }
};

TEST_F(ServerWireIntegrityTest, RawBytesOfAGoodRequestAreServed) {
  RawCall call(channel(), kBackwardMethod);
  ASSERT_TRUE(call.Write(Serialized(1)));
  std::optional<std::string> answer = call.Read();
  ASSERT_TRUE(answer.has_value());
  v1::BackwardResponse response;
  ASSERT_TRUE(response.ParseFromString(*answer));
  EXPECT_EQ(response.batch_id(), 1u);
  EXPECT_FALSE(response.has_error()) << response.error().message();
  EXPECT_TRUE(call.WritesDone());
  EXPECT_TRUE(call.Finish().ok());
  EXPECT_EQ(AccumulatedBatches(), 1);
}

TEST_F(ServerWireIntegrityTest, BackwardStreamWithBytesThatAreNoRequestEndsInvalidArgument) {
  RawCall call(channel(), kBackwardMethod);
  ASSERT_TRUE(call.Write(Serialized(1)));
  // Wait for the first answer, so that the first batch is known to be in before the bad bytes.
  std::optional<std::string> answer = call.Read();
  ASSERT_TRUE(answer.has_value());
  call.Write(kNotAMessage);
  call.Write(Serialized(3));  // after the bad bytes: never computed
  call.WritesDone();
  while (call.Read().has_value()) {
  }
  const grpc::Status status = call.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("BackwardRequest"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(AccumulatedBatches(), 1);  // batch 1 only
}

TEST_F(ServerWireIntegrityTest, LoadWeightsFollowedByBytesThatAreNoChunkIsNotCommitted) {
  const std::uint64_t version = WeightsVersion();
  const LayerWeights replacement = RandomLayerWeights(config(), 77);
  RawCall call(channel(), kLoadWeightsMethod);
  for (Weight weight : kAllWeights) {
    v1::LoadWeightsRequest chunk;
    chunk.set_name(wire::WireWeightName(weight));
    chunk.set_dtype(v1::DTYPE_FLOAT32);
    for (std::int64_t dim : WeightShape(config(), weight)) chunk.add_shape(dim);
    wire::EncodeFromFloat(replacement.values[weight], v1::DTYPE_FLOAT32, chunk.mutable_data());
    ASSERT_TRUE(call.Write(chunk.SerializeAsString()));
  }
  call.Write(kNotAMessage);
  call.WritesDone();
  call.Read();  // the response, if any
  const grpc::Status status = call.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("LoadWeightsRequest"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(WeightsVersion(), version);
}

}  // namespace
}  // namespace attngrad::server::testing
