// Walking a serialized BackwardRequest on its pieces (protobuf wire format: varint tags, wire types
// 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
#include "rpc/request_walker.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attngrad::server {

void AppendVarint(std::uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

absl::Status NotAMessage(const char* type, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("the message does not parse as an ", type, " (", why,
                   "); the stream was ended: nothing after it was read"));
}

namespace {

constexpr int kHiddenStatesField = 5;  // BackwardRequest.hidden_states
constexpr int kGradOutputField = 6;    // BackwardRequest.grad_output
constexpr int kRawDataField = 3;       // Tensor.raw_data
constexpr int kLengthDelimited = 2;

// Sequential reads over the received pieces, with ranges of them copied out or referred to.
class PieceReader {
 public:
  explicit PieceReader(const std::vector<absl::string_view>& pieces) : slices_(pieces) {
    for (absl::string_view piece : slices_) {
      starts_.push_back(size_);
      size_ += piece.size();
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
    *byte = static_cast<std::uint8_t>(slices_[index_][within_++]);
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
      const absl::string_view piece = slices_[index];
      const std::size_t begin = from - starts_[index];
      const std::size_t count = std::min(to - from, piece.size() - begin);
      if (count > 0) pieces.push_back(piece.substr(begin, count));
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

  const std::vector<absl::string_view>& slices_;
  std::vector<std::size_t> starts_;
  std::size_t size_ = 0;
  std::size_t position_ = 0;
  std::size_t index_ = 0;   // the slice holding position_
  std::size_t within_ = 0;  // position_ within it
};

}  // namespace

absl::StatusOr<ReceivedBackwardRequest> WalkBackwardRequest(
    const std::vector<absl::string_view>& pieces, std::shared_ptr<const void> owner) {
  constexpr const char* kType = "attngrad.v1.BackwardRequest";
  PieceReader reader(pieces);
  const std::size_t end = reader.size();
  std::string rest;  // every field but the activations' raw data, re-encoded
  using Range = std::pair<std::size_t, std::size_t>;
  std::optional<Range> payloads[2];  // hidden_states, grad_output
  while (reader.position() < end) {
    const std::size_t field_start = reader.position();
    std::uint64_t tag = 0;
    if (!reader.ReadVarint(&tag)) return NotAMessage(kType, "a truncated field tag");
    const std::uint64_t field = tag >> 3;
    const std::uint32_t wire_type = static_cast<std::uint32_t>(tag & 7);
    if (field == 0) return NotAMessage(kType, "field number 0");
    if ((field == kHiddenStatesField || field == kGradOutputField) &&
        wire_type == kLengthDelimited) {
      std::uint64_t length = 0;
      if (!reader.ReadVarint(&length) || length > end - reader.position()) {
        return NotAMessage(kType, absl::StrCat("field ", field, " is longer than the message"));
      }
      const std::size_t tensor_end = reader.position() + length;
      std::string tensor;  // the Tensor without raw_data
      while (reader.position() < tensor_end) {
        const std::size_t inner_start = reader.position();
        std::uint64_t inner_tag = 0;
        if (!reader.ReadVarint(&inner_tag) || reader.position() > tensor_end) {
          return NotAMessage(kType, absl::StrCat("a truncated tag in field ", field));
        }
        if ((inner_tag >> 3) == 0) return NotAMessage(kType, "field number 0");
        if (inner_tag == (kRawDataField << 3 | kLengthDelimited)) {
          std::uint64_t size = 0;
          if (!reader.ReadVarint(&size) || reader.position() > tensor_end) {
            return NotAMessage(kType, absl::StrCat("a truncated raw_data in field ", field));
          }
          const std::size_t begin = reader.position();
          if (!reader.Skip(size, tensor_end)) {
            return NotAMessage(
                kType, absl::StrCat("raw_data of field ", field, " is longer than its tensor"));
          }
          payloads[field == kHiddenStatesField ? 0 : 1] = Range(begin, reader.position());
        } else {
          if (!reader.SkipValue(static_cast<std::uint32_t>(inner_tag & 7), tensor_end)) {
            return NotAMessage(kType, absl::StrCat("a malformed field in field ", field));
          }
          reader.Append(inner_start, reader.position(), &tensor);
        }
      }
      AppendVarint(tag, &rest);
      AppendVarint(tensor.size(), &rest);
      rest += tensor;
    } else {
      if (!reader.SkipValue(wire_type, end)) {
        return NotAMessage(kType, absl::StrCat("field ", field, " is malformed or truncated"));
      }
      reader.Append(field_start, reader.position(), &rest);
    }
  }
  ReceivedBackwardRequest received;
  if (!received.message.ParseFromString(rest)) return NotAMessage(kType, "a field does not parse");
  WireTensor* tensors[2] = {&received.hidden_states, &received.grad_output};
  const v1::Tensor* described[2] = {&received.message.hidden_states(),
                                    &received.message.grad_output()};
  for (int i = 0; i < 2; ++i) {
    std::vector<absl::string_view> payload;
    if (payloads[i]) payload = reader.Pieces(payloads[i]->first, payloads[i]->second);
    *tensors[i] = WireTensor(described[i]->dtype(), std::move(payload), owner);
  }
  return received;
}

}  // namespace attngrad::server
