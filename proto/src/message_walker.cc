// Walking serialized attngrad messages on their pieces (protobuf wire format: varint tags, wire
// types 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32) and the headers of raw_data payloads.
#include "attngrad/wire/message_walker.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"

namespace attngrad::wire {

void AppendVarint(std::uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

std::size_t VarintSize(std::uint64_t value) {
  std::size_t size = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++size;
  }
  return size;
}

absl::Status NotAMessage(const char* type, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("the message does not parse as an ", type, " (", why,
                   "); the stream was ended: nothing after it was read"));
}

namespace {

constexpr std::uint64_t kRawDataField = 3;  // Tensor.raw_data
constexpr std::uint32_t kLengthDelimited = 2;

std::uint64_t LengthDelimitedTag(std::uint64_t field) { return field << 3 | kLengthDelimited; }

// Sequential reads over the pieces, with ranges of them copied out or referred to.
class PieceReader {
 public:
  explicit PieceReader(const std::vector<absl::string_view>& pieces) : slices_(pieces) {
    starts_.reserve(slices_.size());
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

  // A field tag and a length-delimited field's length as protobuf reads them: at most 5 bytes,
  // and within 32 bits (a tag) or INT32_MAX less protobuf's 16 bytes of slop (a length).
  // Protobuf refuses a message with a longer or larger one, so the walker must too.
  bool ReadTag(std::uint64_t* tag) { return ReadVarint32(tag, 0xffffffffULL); }
  bool ReadLength(std::uint64_t* length) { return ReadVarint32(length, 0x7fffffffULL - 16); }

  bool ReadVarint32(std::uint64_t* value, std::uint64_t largest) {
    *value = 0;
    for (int shift = 0; shift < 35; shift += 7) {
      std::uint8_t byte = 0;
      if (!ReadByte(&byte)) return false;
      *value |= static_cast<std::uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return *value <= largest;
    }
    return false;  // more than 5 bytes
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
        return ReadLength(&length) && position_ <= limit && Skip(length, limit);
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

using Range = std::pair<std::size_t, std::size_t>;

class Walker {
 public:
  Walker(const std::vector<absl::string_view>& pieces, absl::Span<const FieldPath> paths,
         const char* type)
      : reader_(pieces), paths_(paths), type_(type), ranges_(paths.size()) {}

  absl::StatusOr<WalkedMessage> Walk() {
    std::vector<std::size_t> all(paths_.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    WalkedMessage walked;
    ATTNGRAD_RETURN_IF_ERROR(Fields(reader_.size(), all, 0, -1, "", &walked.rest));
    walked.payloads.reserve(ranges_.size());
    for (const std::optional<Range>& range : ranges_) {
      walked.payloads.push_back(range ? reader_.Pieces(range->first, range->second)
                                      : std::vector<absl::string_view>());
    }
    return walked;
  }

 private:
  // Walks the fields in [position, end) of the message `where` ("" at the top, else "5" or "5.1")
  // at `depth` of the paths in `candidates`, appending what is kept to `out`. `tensor` >= 0: the
  // message is that path's Tensor, whose raw_data is recorded, not kept.
  absl::Status Fields(std::size_t end, const std::vector<std::size_t>& candidates,
                      std::size_t depth, int tensor, const std::string& where, std::string* out) {
    const bool top = where.empty();
    while (reader_.position() < end) {
      const std::size_t field_start = reader_.position();
      std::uint64_t tag = 0;
      if (!reader_.ReadTag(&tag) || reader_.position() > end) {
        return NotAMessage(type_, top ? std::string("a truncated field tag")
                                      : absl::StrCat("a truncated tag in field ", where));
      }
      const std::uint64_t field = tag >> 3;
      const std::uint32_t wire_type = static_cast<std::uint32_t>(tag & 7);
      if (field == 0) return NotAMessage(type_, "field number 0");
      if (tensor >= 0 && tag == LengthDelimitedTag(kRawDataField)) {
        std::uint64_t size = 0;
        if (!reader_.ReadLength(&size) || reader_.position() > end) {
          return NotAMessage(type_, absl::StrCat("a truncated raw_data in field ", where));
        }
        const std::size_t begin = reader_.position();
        if (!reader_.Skip(size, end)) {
          return NotAMessage(
              type_, absl::StrCat("raw_data of field ", where, " is longer than its tensor"));
        }
        ranges_[static_cast<std::size_t>(tensor)] = Range(begin, reader_.position());
        continue;
      }
      std::vector<std::size_t> inner_candidates;
      int inner_tensor = -1;
      if (wire_type == kLengthDelimited) {
        for (std::size_t index : candidates) {
          const FieldPath& path = paths_[index];
          if (static_cast<std::uint64_t>(path[depth]) != field) continue;
          if (path.size() == depth + 1) {
            inner_tensor = static_cast<int>(index);
          } else {
            inner_candidates.push_back(index);
          }
        }
      }
      if (inner_tensor >= 0 || !inner_candidates.empty()) {
        const std::string name = top ? absl::StrCat(field) : absl::StrCat(where, ".", field);
        std::uint64_t length = 0;
        if (!reader_.ReadLength(&length) || reader_.position() > end ||
            length > end - reader_.position()) {
          return NotAMessage(type_, absl::StrCat("field ", name, " is longer than the message"));
        }
        std::string inner;
        ATTNGRAD_RETURN_IF_ERROR(Fields(reader_.position() + length, inner_candidates, depth + 1,
                                        inner_tensor, name, &inner));
        AppendVarint(tag, out);
        AppendVarint(inner.size(), out);
        *out += inner;
        continue;
      }
      if (!reader_.SkipValue(wire_type, end)) {
        return NotAMessage(type_, top ? absl::StrCat("field ", field, " is malformed or truncated")
                                      : absl::StrCat("a malformed field in field ", where));
      }
      reader_.Append(field_start, reader_.position(), out);
    }
    return absl::OkStatus();
  }

  PieceReader reader_;
  absl::Span<const FieldPath> paths_;
  const char* type_;
  std::vector<std::optional<Range>> ranges_;
};

// Splices payloads into a serialized message as the raw_data of the Tensors at the paths.
class Splicer {
 public:
  Splicer(const std::vector<absl::string_view>& pieces, absl::Span<const FieldPath> paths,
          absl::Span<const std::size_t> payload_sizes)
      : reader_(pieces), paths_(paths), payload_sizes_(payload_sizes), spliced_(paths.size()) {}

  absl::StatusOr<std::vector<MessageSegment>> Splice() {
    std::vector<std::size_t> all(paths_.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    std::vector<MessageSegment> segments;
    std::size_t size = 0;
    ATTNGRAD_RETURN_IF_ERROR(Fields(reader_.size(), all, 0, &segments, &size));
    for (std::size_t i = 0; i < spliced_.size(); ++i) {
      if (!spliced_[i]) {
        return absl::InternalError(absl::StrCat("SpliceTensorPayloads: payload ", i,
                                                " has no tensor in the message to go into"));
      }
    }
    return segments;
  }

 private:
  static void AddBytes(std::string bytes, std::vector<MessageSegment>* out) {
    if (bytes.empty()) return;
    if (!out->empty() && out->back().payload < 0) {
      out->back().bytes += bytes;
    } else {
      out->push_back(MessageSegment{std::move(bytes), -1});
    }
  }

  absl::Status Fields(std::size_t end, const std::vector<std::size_t>& candidates,
                      std::size_t depth, std::vector<MessageSegment>* out, std::size_t* size) {
    const absl::Status malformed =
        absl::InternalError("SpliceTensorPayloads: the serialized message is malformed");
    while (reader_.position() < end) {
      const std::size_t field_start = reader_.position();
      std::uint64_t tag = 0;
      if (!reader_.ReadTag(&tag) || reader_.position() > end) return malformed;
      const std::uint64_t field = tag >> 3;
      std::vector<std::size_t> inner_candidates;
      int tensor = -1;
      if ((tag & 7) == kLengthDelimited) {
        for (std::size_t index : candidates) {
          const FieldPath& path = paths_[index];
          if (static_cast<std::uint64_t>(path[depth]) != field) continue;
          if (path.size() == depth + 1) {
            tensor = static_cast<int>(index);
          } else {
            inner_candidates.push_back(index);
          }
        }
      }
      if (tensor < 0 && inner_candidates.empty()) {
        if (!reader_.SkipValue(static_cast<std::uint32_t>(tag & 7), end)) return malformed;
        std::string bytes;
        reader_.Append(field_start, reader_.position(), &bytes);
        *size += bytes.size();
        AddBytes(std::move(bytes), out);
        continue;
      }
      std::uint64_t length = 0;
      if (!reader_.ReadLength(&length) || reader_.position() > end ||
          length > end - reader_.position()) {
        return malformed;
      }
      std::vector<MessageSegment> inner;
      std::size_t inner_size = 0;
      if (tensor >= 0) {
        // The Tensor's fields as they are, then its raw_data from the payload.
        std::string fields;
        reader_.Append(reader_.position(), reader_.position() + length, &fields);
        if (!reader_.Skip(length, end)) return malformed;
        const std::size_t payload = payload_sizes_[static_cast<std::size_t>(tensor)];
        if (payload > 0) {  // proto3 leaves an empty bytes field out
          AppendVarint(LengthDelimitedTag(kRawDataField), &fields);
          AppendVarint(payload, &fields);
        }
        inner_size = fields.size() + payload;
        AddBytes(std::move(fields), &inner);
        if (payload > 0) inner.push_back(MessageSegment{std::string(), tensor});
        spliced_[static_cast<std::size_t>(tensor)] = true;
      } else {
        ATTNGRAD_RETURN_IF_ERROR(
            Fields(reader_.position() + length, inner_candidates, depth + 1, &inner, &inner_size));
      }
      std::string header;
      AppendVarint(tag, &header);
      AppendVarint(inner_size, &header);
      *size += header.size() + inner_size;
      AddBytes(std::move(header), out);
      for (MessageSegment& segment : inner) {
        if (segment.payload >= 0) {
          out->push_back(std::move(segment));
        } else {
          AddBytes(std::move(segment.bytes), out);
        }
      }
    }
    return absl::OkStatus();
  }

  PieceReader reader_;
  absl::Span<const FieldPath> paths_;
  absl::Span<const std::size_t> payload_sizes_;
  std::vector<bool> spliced_;
};

}  // namespace

absl::StatusOr<WalkedMessage> WalkMessage(const std::vector<absl::string_view>& pieces,
                                          absl::Span<const FieldPath> tensors, const char* type) {
  for (const FieldPath& path : tensors) {
    if (path.empty()) return absl::InternalError("WalkMessage: an empty field path");
  }
  return Walker(pieces, tensors, type).Walk();
}

absl::StatusOr<std::vector<MessageSegment>> SpliceTensorPayloads(
    absl::string_view serialized, absl::Span<const FieldPath> tensors,
    absl::Span<const std::size_t> payload_sizes) {
  if (payload_sizes.size() != tensors.size()) {
    return absl::InternalError("SpliceTensorPayloads: one payload size per tensor path");
  }
  for (const FieldPath& path : tensors) {
    if (path.empty()) return absl::InternalError("SpliceTensorPayloads: an empty field path");
  }
  const std::vector<absl::string_view> pieces = {serialized};
  return Splicer(pieces, tensors, payload_sizes).Splice();
}

}  // namespace attngrad::wire
