// The Backward messages as client and server exchange them (attngrad/wire/backward_messages.h,
// message_walker.h, byte_buffer.h): a request built with its activations as slices of their own,
// and an answer serialized around its tensors' slices, are byte for byte protobuf's serialization
// of the same message; walking those bytes, cut into pieces anywhere, gives back every field.
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "attngrad/common/buffer_pool.h"
#include "attngrad/wire/backward_messages.h"
#include "attngrad/wire/byte_buffer.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"

namespace attngrad::wire {
namespace {

using google::protobuf::util::MessageDifferencer;

std::vector<float> Values(std::size_t count, float scale) {
  std::vector<float> values(count);
  for (std::size_t i = 0; i < count; ++i) values[i] = scale * (static_cast<float>(i % 97) - 48.5f);
  return values;
}

std::string Flatten(const grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  std::string flat;
  for (const grpc::Slice& slice : slices) {
    flat.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return flat;
}

// `bytes` as a ByteBuffer of slices of `piece` bytes (the last one shorter).
grpc::ByteBuffer Cut(const std::string& bytes, std::size_t piece) {
  std::vector<grpc::Slice> slices;
  for (std::size_t offset = 0; offset < bytes.size(); offset += piece) {
    const std::string part = bytes.substr(offset, piece);
    slices.emplace_back(part.data(), part.size());
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Every field of a request the client sets, in one of its variants.
v1::BackwardRequest FullRequest(int dtype, bool tables, const std::vector<float>& hidden,
                                const std::vector<float>& grad) {
  v1::BackwardRequest request;
  request.set_batch_id(0x8123456789abcdefull);
  request.set_mode(v1::GRADIENT_MODE_ACCUMULATE);
  request.set_precision(v1::PRECISION_UNSPECIFIED);
  request.set_expected_weights_version(7);
  EncodeTensor(hidden, {2, 3, 4}, dtype, request.mutable_hidden_states());
  EncodeTensor(grad, {2, 3, 4}, dtype, request.mutable_grad_output());
  if (tables) {
    EncodeTensor(Values(12, 0.5f), {2, 3, 2}, v1::DTYPE_FLOAT32,
                 request.mutable_rotary_tables()->mutable_cos());
    EncodeTensor(Values(12, 0.25f), {2, 3, 2}, v1::DTYPE_FLOAT32,
                 request.mutable_rotary_tables()->mutable_sin());
  } else {
    request.mutable_positions()->set_rope_theta(10000.0);
    for (int i = 0; i < 6; ++i) request.mutable_positions()->add_position_ids(i * 300);
  }
  request.set_scaling(0.125f);
  request.set_softcap(0.0f);  // optional: present though zero
  request.set_eps(1e-6f);
  request.set_accumulation_window_id(3);
  request.set_response_dtype(v1::DTYPE_BFLOAT16);
  request.set_layer(0);
  request.set_sliding_window(512);
  request.mutable_hidden_states_region()->set_region_id(9);
  request.mutable_hidden_states_region()->set_offset(4096);
  request.mutable_hidden_states_region()->set_byte_size(96);
  request.mutable_grad_output_region()->set_region_id(9);
  request.mutable_grad_output_region()->set_offset(0);
  request.mutable_grad_hidden_states_region()->set_byte_size(-1);
  return request;
}

TEST(BackwardMessagesTest, RequestIsProtobufsSerializationByteForByte) {
  const std::vector<float> hidden = Values(24, 1.5f), grad = Values(24, -0.75f);
  auto pool = common::BufferPool::Create(1 << 20);
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    for (bool tables : {false, true}) {
      SCOPED_TRACE(DTypeName(dtype) + (tables ? " tables" : " positions"));
      const v1::BackwardRequest full = FullRequest(dtype, tables, hidden, grad);
      v1::BackwardRequest fields = full;
      fields.mutable_hidden_states()->clear_raw_data();
      fields.mutable_grad_output()->clear_raw_data();
      absl::StatusOr<grpc::ByteBuffer> bytes =
          EncodeBackwardRequest(fields, hidden, grad, dtype, *pool);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_EQ(Flatten(*bytes), full.SerializeAsString());
    }
  }
}

// Borrowed float32 activations: the same bytes, the caller's memory sent as it is (not copied),
// and the owner kept until the last slice of the message goes. Other dtypes are converted into
// the pool's buffer and drop the owner at once.
TEST(BackwardMessagesTest, BorrowedRequestIsTheSameBytesAndKeepsItsOwner) {
  std::vector<float> hidden = Values(24, 1.5f), grad = Values(24, -0.75f);
  auto pool = common::BufferPool::Create(1 << 20);
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const v1::BackwardRequest full = FullRequest(dtype, true, hidden, grad);
    v1::BackwardRequest fields = full;
    fields.mutable_hidden_states()->clear_raw_data();
    fields.mutable_grad_output()->clear_raw_data();
    auto owner = std::make_shared<int>(0);
    std::weak_ptr<int> watch = owner;
    absl::StatusOr<grpc::ByteBuffer> bytes =
        EncodeBackwardRequest(fields, hidden, grad, dtype, *pool, std::move(owner));
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(Flatten(*bytes), full.SerializeAsString());
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(bytes->Dump(&slices).ok());
    bool points_into_caller = false;
    for (const grpc::Slice& slice : slices) {
      points_into_caller = points_into_caller ||
                           reinterpret_cast<const void*>(slice.begin()) == hidden.data() ||
                           reinterpret_cast<const void*>(slice.begin()) == grad.data();
    }
    EXPECT_EQ(points_into_caller, dtype == v1::DTYPE_FLOAT32);
    EXPECT_EQ(watch.expired(), dtype != v1::DTYPE_FLOAT32);
    slices.clear();
    *bytes = grpc::ByteBuffer();
    EXPECT_TRUE(watch.expired());
  }
}

// Activations already in the wire dtype (EncodeBackwardRequestBytes, e.g. a bf16 trainer's
// tensors): byte for byte the request of the floats they encode, copied into the pool's buffer, or
// borrowed (the caller's memory sent as it is, the owner kept until the last slice goes).
TEST(BackwardMessagesTest, EncodedActivationsAreTheSameRequestCopiedOrBorrowed) {
  const std::vector<float> hidden = Values(24, 1.5f), grad = Values(24, -0.75f);
  auto pool = common::BufferPool::Create(1 << 20);
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    for (bool borrow : {false, true}) {
      SCOPED_TRACE(DTypeName(dtype) + (borrow ? " borrowed" : " copied"));
      const v1::BackwardRequest full = FullRequest(dtype, false, hidden, grad);
      v1::BackwardRequest fields = full;
      fields.mutable_hidden_states()->clear_raw_data();
      fields.mutable_grad_output()->clear_raw_data();
      const std::string hidden_raw = full.hidden_states().raw_data();
      const std::string grad_raw = full.grad_output().raw_data();
      auto owner = borrow ? std::make_shared<int>(0) : nullptr;
      std::weak_ptr<int> watch = owner;
      absl::StatusOr<grpc::ByteBuffer> bytes =
          EncodeBackwardRequestBytes(fields, hidden_raw, grad_raw, *pool, std::move(owner));
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_EQ(Flatten(*bytes), full.SerializeAsString());
      std::vector<grpc::Slice> slices;
      ASSERT_TRUE(bytes->Dump(&slices).ok());
      bool hidden_borrowed = false, grad_borrowed = false;
      for (const grpc::Slice& slice : slices) {
        const void* begin = slice.begin();
        hidden_borrowed = hidden_borrowed || begin == hidden_raw.data();
        grad_borrowed = grad_borrowed || begin == grad_raw.data();
      }
      EXPECT_EQ(hidden_borrowed, borrow);
      EXPECT_EQ(grad_borrowed, borrow);
      EXPECT_EQ(watch.expired(), !borrow);
      slices.clear();
      *bytes = grpc::ByteBuffer();
      EXPECT_TRUE(watch.expired());
    }
  }
}

TEST(BackwardMessagesTest, RequestWithEmptyActivationsIsProtobufs) {
  v1::BackwardRequest fields;
  fields.set_batch_id(1);
  fields.mutable_hidden_states()->set_dtype(v1::DTYPE_FLOAT32);
  fields.mutable_grad_output();  // present, all defaults
  auto pool = common::BufferPool::Create(0);
  absl::StatusOr<grpc::ByteBuffer> bytes = EncodeBackwardRequest(fields, {}, {}, 1, *pool);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(Flatten(*bytes), fields.SerializeAsString());
}

TEST(BackwardMessagesTest, APathWithoutItsTensorIsAnError) {
  v1::BackwardRequest fields;  // no hidden_states, no grad_output
  fields.set_batch_id(1);
  auto pool = common::BufferPool::Create(0);
  const std::vector<float> values = Values(4, 1.f);
  EXPECT_EQ(EncodeBackwardRequest(fields, values, values, 1, *pool).status().code(),
            absl::StatusCode::kInternal);
}

// An answer with every field set, as the server sends it: serialized around its tensors' slices.
struct Answer {
  v1::BackwardResponse full;
  grpc::ByteBuffer bytes;
};
Answer ServerAnswer(int dtype) {
  Answer answer;
  v1::BackwardResponse& full = answer.full;
  full.set_batch_id(42);
  full.set_weights_version(5);
  EncodeTensor(Values(24, 0.5f), {2, 3, 4}, dtype, full.mutable_grad_hidden_states());
  int size = 3;
  for (Weight weight : kAllWeights) {
    EncodeTensor(Values(static_cast<std::size_t>(size), 0.1f * size), {size}, dtype,
                 MutableGradientTensor(full.mutable_weight_gradients(), weight));
    size += 5;
  }
  full.mutable_timings()->set_queue_seconds(0.5);
  full.mutable_timings()->set_copy_out_seconds(0.25);
  full.set_device("cuda:0");
  full.set_server_instance_id("instance");
  full.set_accumulation_window_id(11);
  full.set_duplicate(true);
  full.set_layer(3);

  v1::BackwardResponse fields = full;
  std::vector<grpc::Slice> payloads;
  const std::vector<FieldPath>& paths = BackwardResponseTensorPaths();
  payloads.emplace_back(fields.grad_hidden_states().raw_data());
  fields.mutable_grad_hidden_states()->clear_raw_data();
  for (Weight weight : kAllWeights) {
    v1::Tensor* tensor = MutableGradientTensor(fields.mutable_weight_gradients(), weight);
    payloads.emplace_back(tensor->raw_data());
    tensor->clear_raw_data();
  }
  absl::StatusOr<grpc::ByteBuffer> bytes = SerializeWithPayloads(fields, paths, payloads);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (bytes.ok()) answer.bytes = *std::move(bytes);
  return answer;
}

TEST(BackwardMessagesTest, AnswerIsProtobufsSerializationByteForByte) {
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Answer answer = ServerAnswer(dtype);
    EXPECT_EQ(Flatten(answer.bytes), answer.full.SerializeAsString());
  }
}

TEST(BackwardMessagesTest, AnswerReadOnAnyCutGivesEveryField) {
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    const Answer answer = ServerAnswer(dtype);
    const std::string flat = answer.full.SerializeAsString();
    for (std::size_t piece : {std::size_t{1}, std::size_t{3}, std::size_t{7}, flat.size()}) {
      SCOPED_TRACE(DTypeName(dtype) + " pieces of " + std::to_string(piece));
      absl::StatusOr<ReceivedBackwardResponse> read = ReadBackwardResponse(Cut(flat, piece));
      ASSERT_TRUE(read.ok()) << read.status();
      EXPECT_EQ(read->bytes, static_cast<std::int64_t>(flat.size()));
      // Put the payloads back: the whole message again.
      v1::BackwardResponse rebuilt = read->response;
      auto join = [](const std::vector<absl::string_view>& pieces) {
        std::string joined;
        for (absl::string_view p : pieces) joined.append(p.data(), p.size());
        return joined;
      };
      EXPECT_TRUE(rebuilt.grad_hidden_states().raw_data().empty());
      rebuilt.mutable_grad_hidden_states()->set_raw_data(join(read->payloads[0]));
      for (std::size_t w = 0; w < kAllWeights.size(); ++w) {
        MutableGradientTensor(rebuilt.mutable_weight_gradients(), kAllWeights[w])
            ->set_raw_data(join(read->payloads[w + 1]));
      }
      EXPECT_TRUE(MessageDifferencer::Equals(rebuilt, answer.full));
      // The decoded values equal protobuf's path (DecodeTensor on the parsed message).
      std::vector<float> expected;
      ASSERT_TRUE(DecodeTensor(answer.full.grad_hidden_states(), "g", {2, 3, 4}, &expected).ok());
      std::vector<float> decoded(expected.size());
      ASSERT_TRUE(DecodePiecesToFloat(read->payloads[0], dtype, "g", absl::MakeSpan(decoded)).ok());
      EXPECT_EQ(decoded, expected);
    }
  }
}

TEST(BackwardMessagesTest, TheLastRawDataOfARepeatedTensorWinsAsInProtobuf) {
  // Two occurrences of grad_hidden_states: protobuf merges them (the second raw_data wins).
  v1::BackwardResponse first, second;
  EncodeTensor(Values(4, 1.f), {4}, v1::DTYPE_FLOAT32, first.mutable_grad_hidden_states());
  second.mutable_grad_hidden_states()->set_raw_data(std::string(8, '\x01'));
  const std::string bytes = first.SerializeAsString() + second.SerializeAsString();
  v1::BackwardResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  absl::StatusOr<ReceivedBackwardResponse> read = ReadBackwardResponse(Cut(bytes, 5));
  ASSERT_TRUE(read.ok()) << read.status();
  std::string payload;
  for (absl::string_view p : read->payloads[0]) payload.append(p.data(), p.size());
  EXPECT_EQ(payload, parsed.grad_hidden_states().raw_data());
  EXPECT_EQ(read->response.grad_hidden_states().shape_size(), 1);
}

TEST(BackwardMessagesTest, BytesThatAreNotAnAnswerAreInvalidArgument) {
  const std::string flat = ServerAnswer(v1::DTYPE_FLOAT32).full.SerializeAsString();
  for (const std::string& bad : {flat.substr(0, flat.size() - 3), std::string("\x22\xff", 2),
                                 std::string("\x00\x01", 2), std::string("\x2b", 1)}) {
    absl::StatusOr<ReceivedBackwardResponse> read = ReadBackwardResponse(Cut(bad, 4));
    EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << read.status();
  }
}

TEST(BackwardMessagesTest, TagsAndLengthsProtobufRefusesAreRefused) {
  // Protobuf reads a tag or a length in at most 5 bytes (a length below 2^31 less 16); a longer
  // encoding of even a small value makes it refuse the whole message, so the walker refuses it.
  const std::string batch_id("\x08\x02", 2);
  for (const std::string& bad :
       {batch_id + std::string("\x22\x80\x80\x80\x80\x80\x80\x80\x80\x00", 10),
        batch_id + std::string("\x22\x80\x80\x80\x80\x08", 6),
        std::string("\x88\x80\x80\x80\x80\x00\x02", 7)}) {
    v1::BackwardResponse parsed;
    EXPECT_FALSE(parsed.ParseFromString(bad));
    absl::StatusOr<ReceivedBackwardResponse> read = ReadBackwardResponse(Cut(bad, 3));
    EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << read.status();
  }
  // Up to 5 bytes is protobuf's and the walker's: a length of 0 in 5 bytes.
  const std::string padded = batch_id + std::string("\x22\x80\x80\x80\x80\x00", 6);
  v1::BackwardResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(padded));
  EXPECT_TRUE(ReadBackwardResponse(Cut(padded, 3)).ok());
}

TEST(BackwardMessagesTest, DecodePiecesHandlesElementsAcrossPieces) {
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    const std::vector<float> values = Values(50, 0.375f);
    std::string raw;
    EncodeFromFloat(values, dtype, &raw);
    std::vector<float> expected(values.size());
    ASSERT_TRUE(DecodeToFloat(raw, dtype, "x", absl::MakeSpan(expected)).ok());
    for (std::size_t piece : {1, 3, 5, 64}) {
      std::vector<absl::string_view> pieces;
      for (std::size_t offset = 0; offset < raw.size(); offset += piece) {
        pieces.push_back(absl::string_view(raw).substr(offset, piece));
      }
      std::vector<float> decoded(values.size());
      ASSERT_TRUE(DecodePiecesToFloat(pieces, dtype, "x", absl::MakeSpan(decoded)).ok());
      EXPECT_EQ(decoded, expected) << DTypeName(dtype) << " pieces of " << piece;
    }
    std::vector<float> too_many(values.size() + 1);
    EXPECT_EQ(
        DecodePiecesToFloat({absl::string_view(raw)}, dtype, "x", absl::MakeSpan(too_many)).code(),
        absl::StatusCode::kInvalidArgument);
  }
}

TEST(BufferPoolTest, AGivenBackBufferIsReusedWithinTheLimit) {
  auto pool = common::BufferPool::Create(1000);
  const char* first = nullptr;
  {
    common::BufferPool::Buffer buffer = pool->Acquire(600);
    first = buffer.data();
    EXPECT_EQ(buffer.size(), 600u);
  }
  EXPECT_EQ(pool->cached_bytes(), 600u);
  {
    common::BufferPool::Buffer again = pool->Acquire(500);  // 600 <= 2 * 500: reused
    EXPECT_EQ(again.data(), first);
    EXPECT_EQ(again.size(), 500u);
    EXPECT_EQ(pool->cached_bytes(), 0u);
    common::BufferPool::Buffer other = pool->Acquire(200);  // nothing cached: new
    EXPECT_NE(other.data(), first);
  }
  // 600 went back, then 200 (800 <= 1000); a 300-byte buffer would pass the limit.
  EXPECT_EQ(pool->cached_bytes(), 800u);
  { common::BufferPool::Buffer big = pool->Acquire(1000); }  // 1800 > 1000: freed, not kept
  EXPECT_EQ(pool->cached_bytes(), 800u);
  // A slice owning a buffer gives it back when gRPC (here: the last slice) lets go.
  {
    grpc::Slice slice = SliceOf(pool->Acquire(150));  // takes the 200
    EXPECT_EQ(pool->cached_bytes(), 600u);
  }
  EXPECT_EQ(pool->cached_bytes(), 800u);
}

}  // namespace
}  // namespace attngrad::wire
