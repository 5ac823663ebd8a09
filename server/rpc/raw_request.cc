// Reading BackwardRequests on the received slices (protobuf wire format: varint tags, wire types
// 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
#include "rpc/raw_request.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"

namespace attngrad::server {
namespace {

constexpr int kHiddenStatesField = 5;  // BackwardRequest.hidden_states
constexpr int kGradOutputField = 6;    // BackwardRequest.grad_output
constexpr int kRawDataField = 3;       // Tensor.raw_data
constexpr int kLengthDelimited = 2;

// Sequential reads over the received slices, with ranges of them copied out or referred to.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& slice : slices_) {
      starts_.push_back(size_);
      size_ += slice.size();
    }
  }

  std::size_t position() const { return position_; }
  std::size_t size() const { return size_; }

  bool ReadByte(std::uint8_t* byte) {
    while (index_ < slices_.size() && within_ == slices_[index_].size()) {
      ++index_;
      within_ = 0;
    }
    if (index_ == slices_.size()) return false;
    *byte = slices_[index_].begin()[within_++];
    ++position_;
    return true;
  }

  bool ReadVarint(std::uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      std::uint8_t byte = 0;
      if (!ReadByte(&byte)) return false;
      *value |= static_cast<std::uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  // Moves `count` bytes on, not past `limit`.
  bool Skip(std::uint64_t count, std::size_t limit) {
    if (count > limit - position_) return false;
    position_ += count;
    Seek(position_);
    return true;
  }

  // Skips the value of a field of `wire_type`, not past `limit`.
  bool SkipValue(std::uint32_t wire_type, std::size_t limit) {
    std::uint64_t length = 0;
    switch (wire_type) {
      case 0: return ReadVarint(&length) && position_ <= limit;
      case 1: return Skip(8, limit);
      case kLengthDelimited:
        return ReadVarint(&length) && position_ <= limit && Skip(length, limit);
      case 5: return Skip(4, limit);
      default: return false;  // groups (deprecated, never in these messages) and invalid types
    }
  }

  void Append(std::size_t from, std::size_t to, std::string* out) const {
    for (absl::string_view piece : Pieces(from, to)) out->append(piece.data(), piece.size());
  }

  std::vector<absl::string_view> Pieces(std::size_t from, std::size_t to) const {
    std::vector<absl::string_view> pieces;
    std::size_t index = static_cast<std::size_t>(
        std::upper_bound(starts_.begin(), starts_.end(), from) - starts_.begin());
    index = index == 0 ? 0 : index - 1;
    for (; from < to && index < slices_.size(); ++index) {
      const grpc::Slice& slice = slices_[index];
      const std::size_t begin = from - starts_[index];
      const std::size_t count = std::min(to - from, slice.size() - begin);
      if (count > 0) {
        pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()) + begin, count);
      }
      from += count;
    }
    return pieces;
  }

 private:
  void Seek(std::size_t position) {
    index_ = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), position) -
                                      starts_.begin());
    index_ = index_ == 0 ? 0 : index_ - 1;
    within_ = index_ < slices_.size() ? position - starts_[index_] : 0;
  }

  const std::vector<grpc::Slice>& slices_;
  std::vector<std::size_t> starts_;
  std::size_t size_ = 0;
  std::size_t position_ = 0;
  std::size_t index_ = 0;   // the slice holding position_
  std::size_t within_ = 0;  // position_ within it
};

void AppendVarint(std::uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

absl::Status NotA(const char* type, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("the message does not parse as an ", type, " (", why,
                   "); the stream was ended: nothing after it was read"));
}

}  // namespace

absl::StatusOr<ReceivedBackwardRequest> ParseReceivedBackwardRequest(
    const grpc::ByteBuffer& bytes) {
  constexpr const char* kType = "attngrad.v1.BackwardRequest";
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!bytes.Dump(slices.get()).ok()) return NotA(kType, "unreadable bytes");
  SliceReader reader(*slices);
  const std::size_t end = reader.size();
  std::string rest;  // every field but the activations' raw data, re-encoded
  using Range = std::pair<std::size_t, std::size_t>;
  std::optional<Range> payloads[2];  // hidden_states, grad_output
  while (reader.position() < end) {
    const std::size_t field_start = reader.position();
    std::uint64_t tag = 0;
    if (!reader.ReadVarint(&tag)) return NotA(kType, "a truncated field tag");
    const std::uint64_t field = tag >> 3;
    const std::uint32_t wire_type = static_cast<std::uint32_t>(tag & 7);
    if (field == 0) return NotA(kType, "field number 0");
    if ((field == kHiddenStatesField || field == kGradOutputField) &&
        wire_type == kLengthDelimited) {
      std::uint64_t length = 0;
      if (!reader.ReadVarint(&length) || length > end - reader.position()) {
        return NotA(kType, absl::StrCat("field ", field, " is longer than the message"));
      }
      const std::size_t tensor_end = reader.position() + length;
      std::string tensor;  // the Tensor without raw_data
      while (reader.position() < tensor_end) {
        const std::size_t inner_start = reader.position();
        std::uint64_t inner_tag = 0;
        if (!reader.ReadVarint(&inner_tag) || reader.position() > tensor_end) {
          return NotA(kType, absl::StrCat("a truncated tag in field ", field));
        }
        if ((inner_tag >> 3) == 0) return NotA(kType, "field number 0");
        if (inner_tag == (kRawDataField << 3 | kLengthDelimited)) {
          std::uint64_t size = 0;
          if (!reader.ReadVarint(&size) || reader.position() > tensor_end) {
            return NotA(kType, absl::StrCat("a truncated raw_data in field ", field));
          }
          const std::size_t begin = reader.position();
          if (!reader.Skip(size, tensor_end)) {
            return NotA(kType,
                        absl::StrCat("raw_data of field ", field, " is longer than its tensor"));
          }
          payloads[field == kHiddenStatesField ? 0 : 1] = Range(begin, reader.position());
        } else {
          if (!reader.SkipValue(static_cast<std::uint32_t>(inner_tag & 7), tensor_end)) {
            return NotA(kType, absl::StrCat("a malformed field in field ", field));
          }
          reader.Append(inner_start, reader.position(), &tensor);
        }
      }
      AppendVarint(tag, &rest);
      AppendVarint(tensor.size(), &rest);
      rest += tensor;
    } else {
      if (!reader.SkipValue(wire_type, end)) {
        return NotA(kType, absl::StrCat("field ", field, " is malformed or truncated"));
      }
      reader.Append(field_start, reader.position(), &rest);
    }
  }
  ReceivedBackwardRequest received;
  if (!received.message.ParseFromString(rest)) return NotA(kType, "a field does not parse");
  WireTensor* tensors[2] = {&received.hidden_states, &received.grad_output};
  const v1::Tensor* described[2] = {&received.message.hidden_states(),
                                    &received.message.grad_output()};
  for (int i = 0; i < 2; ++i) {
    std::vector<absl::string_view> pieces;
    if (payloads[i]) pieces = reader.Pieces(payloads[i]->first, payloads[i]->second);
    *tensors[i] = WireTensor(described[i]->dtype(), std::move(pieces), slices);
  }
  return received;
}

absl::Status ParseReceivedMessage(grpc::ByteBuffer* bytes, google::protobuf::Message* message) {
  grpc::ProtoBufferReader reader(bytes);
  if (!message->ParseFromZeroCopyStream(&reader)) {
    return NotA(message->GetDescriptor()->full_name().c_str(), "the bytes are not its encoding");
  }
  return absl::OkStatus();
}

namespace {

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

grpc::ByteBuffer SerializeBackwardResponse(v1::BackwardResponse response, BatchJob& job) {
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
  auto add = [&](std::initializer_list<int> fields, std::size_t elements) {
    const std::size_t bytes = elements * element_size;
    slices.emplace_back(RawDataHeader(fields, bytes));
    if (bytes > 0) slices.push_back(whole.sub(offset, offset + bytes));
    offset += bytes;
  };
  add({kGradHiddenStatesField}, job.activations());
  if (job.return_weight_gradients) {
    for (Weight weight : kAllWeights) {
      add({kWeightGradientsField, static_cast<int>(wire::WireWeightName(weight))},
          WeightElements(config, weight));
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace attngrad::server
