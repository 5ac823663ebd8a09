// .npy and safetensors reading and writing for the CLI.
#include "tensor_files.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "dtype.h"

namespace attngrad {
namespace {

absl::StatusOr<std::string> ReadRange(const std::string& path, uint64_t offset, uint64_t size) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  file.seekg(static_cast<std::streamoff>(offset));
  std::string bytes(size, '\0');
  file.read(bytes.data(), static_cast<std::streamsize>(size));
  if (static_cast<uint64_t>(file.gcount()) != size) {
    return absl::DataLossError(absl::StrCat(path, ": expected ", size, " bytes at offset ", offset,
                                            ", the file is shorter"));
  }
  return bytes;
}

// A minimal JSON reader, enough for a safetensors header: objects, arrays, strings (with \" and \\
// escapes), integers and the literals; values are kept as text where they are scalars.
struct Json {
  enum Kind { kNull, kScalar, kString, kArray, kObject } kind = kNull;
  std::string text;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;
};

class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<Json> Parse() {
    auto value = Value();
    if (!value.ok()) return value;
    Skip();
    if (pos_ != text_.size()) return Error("trailing characters");
    return value;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header: ", what, " at byte ", pos_));
  }
  void Skip() {
    while (pos_ < text_.size() && std::strchr(" \t\r\n", text_[pos_]) != nullptr) ++pos_;
  }
  absl::StatusOr<std::string> String() {
    if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a string");
    ++pos_;
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) ++pos_;
      out.push_back(text_[pos_++]);
    }
    if (pos_ >= text_.size()) return Error("unterminated string");
    ++pos_;
    return out;
  }
  absl::StatusOr<Json> Value() {
    if (++depth_ > 32) return Error("nested too deeply");
    Skip();
    if (pos_ >= text_.size()) return Error("unexpected end");
    Json value;
    const char c = text_[pos_];
    if (c == '{') {
      value.kind = Json::kObject;
      ++pos_;
      Skip();
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
      } else {
        while (true) {
          Skip();
          auto key = String();
          if (!key.ok()) return key.status();
          Skip();
          if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':'");
          ++pos_;
          auto member = Value();
          if (!member.ok()) return member;
          value.members.emplace_back(*std::move(key), *std::move(member));
          Skip();
          if (pos_ < text_.size() && text_[pos_] == ',') {
            ++pos_;
            continue;
          }
          if (pos_ < text_.size() && text_[pos_] == '}') {
            ++pos_;
            break;
          }
          return Error("expected ',' or '}'");
        }
      }
    } else if (c == '[') {
      value.kind = Json::kArray;
      ++pos_;
      Skip();
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
      } else {
        while (true) {
          auto item = Value();
          if (!item.ok()) return item;
          value.items.push_back(*std::move(item));
          Skip();
          if (pos_ < text_.size() && text_[pos_] == ',') {
            ++pos_;
            continue;
          }
          if (pos_ < text_.size() && text_[pos_] == ']') {
            ++pos_;
            break;
          }
          return Error("expected ',' or ']'");
        }
      }
    } else if (c == '"') {
      value.kind = Json::kString;
      auto s = String();
      if (!s.ok()) return s.status();
      value.text = *std::move(s);
    } else {
      value.kind = Json::kScalar;
      const size_t start = pos_;
      while (pos_ < text_.size() && std::strchr(",}] \t\r\n", text_[pos_]) == nullptr) ++pos_;
      value.text = std::string(text_.substr(start, pos_ - start));
      if (value.text.empty()) return Error("expected a value");
    }
    --depth_;
    return value;
  }

  absl::string_view text_;
  size_t pos_ = 0;
  int depth_ = 0;
};

const Json* Member(const Json& object, absl::string_view key) {
  for (const auto& [name, value] : object.members) {
    if (name == key) return &value;
  }
  return nullptr;
}

absl::StatusOr<std::vector<int64_t>> IntArray(const Json* value, absl::string_view what) {
  if (value == nullptr || value->kind != Json::kArray) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected an array of integers"));
  }
  std::vector<int64_t> out;
  for (const Json& item : value->items) {
    int64_t number;
    if (item.kind != Json::kScalar || !absl::SimpleAtoi(item.text, &number) || number < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": '", item.text, "' is not an integer >= 0"));
    }
    out.push_back(number);
  }
  return out;
}

}  // namespace

absl::StatusOr<HostTensor> ReadNpy(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  char magic[8];
  file.read(magic, 8);
  if (file.gcount() != 8 || std::memcmp(magic, "\x93NUMPY", 6) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a .npy file"));
  }
  uint32_t header_length = 0;
  unsigned char length_bytes[4] = {0, 0, 0, 0};
  const int length_size = magic[6] == 1 ? 2 : 4;
  file.read(reinterpret_cast<char*>(length_bytes), length_size);
  for (int i = 0; i < length_size; ++i) header_length |= uint32_t{length_bytes[i]} << (8 * i);
  std::string header(header_length, '\0');
  file.read(header.data(), header_length);
  if (header.find("'fortran_order': True") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": Fortran order is not supported"));
  }
  const bool f4 = header.find("'<f4'") != std::string::npos;
  const bool f8 = header.find("'<f8'") != std::string::npos;
  if (!f4 && !f8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": dtype must be little-endian float32 '<f4' or float64 '<f8'; header ",
                     header));
  }
  const size_t open = header.find("'shape': (");
  const size_t close = header.find(')', open);
  if (open == std::string::npos || close == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no shape in the header"));
  }
  HostTensor tensor;
  const std::string dims = header.substr(open + 10, close - open - 10);
  for (absl::string_view dim : absl::StrSplit(dims, ',', absl::SkipWhitespace())) {
    int64_t d;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(dim), &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad shape (", dims, ")"));
    }
    tensor.shape.push_back(d);
  }
  const int64_t n = tensor.num_elements();
  tensor.data.resize(static_cast<size_t>(n));
  if (f4) {
    file.read(reinterpret_cast<char*>(tensor.data.data()), n * 4);
    if (file.gcount() != n * 4) return absl::DataLossError(absl::StrCat(path, ": truncated data"));
  } else {
    std::vector<double> values(static_cast<size_t>(n));
    file.read(reinterpret_cast<char*>(values.data()), n * 8);
    if (file.gcount() != n * 8) return absl::DataLossError(absl::StrCat(path, ": truncated data"));
    for (int64_t i = 0; i < n; ++i) tensor.data[i] = static_cast<float>(values[i]);
  }
  return tensor;
}

absl::Status WriteNpy(const std::string& path, const HostTensor& tensor) {
  std::string shape = absl::StrJoin(tensor.shape, ", ");
  if (tensor.shape.size() == 1) shape += ",";
  std::string header = absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", shape,
                                    "), }");
  // Pad so that magic (6) + version (2) + length (2) + header + '\n' is a multiple of 64.
  while ((10 + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  file.write("\x93NUMPY\x01\x00", 8);
  const uint16_t length = static_cast<uint16_t>(header.size());
  const char length_bytes[2] = {static_cast<char>(length & 0xff), static_cast<char>(length >> 8)};
  file.write(length_bytes, 2);
  file.write(header.data(), static_cast<std::streamsize>(header.size()));
  file.write(reinterpret_cast<const char*>(tensor.data.data()),
             static_cast<std::streamsize>(tensor.data.size() * sizeof(float)));
  if (!file) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  auto length_bytes = ReadRange(path, 0, 8);
  if (!length_bytes.ok()) return length_bytes.status();
  uint64_t header_length = 0;
  for (int i = 0; i < 8; ++i) {
    header_length |= uint64_t{static_cast<unsigned char>((*length_bytes)[i])} << (8 * i);
  }
  if (header_length > (uint64_t{100} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_length, " is not plausible"));
  }
  auto header = ReadRange(path, 8, header_length);
  if (!header.ok()) return header.status();
  auto json = JsonParser(*header).Parse();
  if (!json.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", json.status().message()));
  }
  if (json->kind != Json::kObject) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": the header is not a JSON object"));
  }
  SafetensorsFile file;
  file.path_ = path;
  file.data_start_ = 8 + header_length;
  for (const auto& [name, value] : json->members) {
    if (name == "__metadata__") continue;
    const Json* dtype = Member(value, "dtype");
    if (dtype == nullptr || dtype->kind != Json::kString) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", name, " has no dtype"));
    }
    auto shape = IntArray(Member(value, "shape"), absl::StrCat(path, ": ", name, ".shape"));
    if (!shape.ok()) return shape.status();
    auto offsets =
        IntArray(Member(value, "data_offsets"), absl::StrCat(path, ": ", name, ".data_offsets"));
    if (!offsets.ok()) return offsets.status();
    if (offsets->size() != 2 || (*offsets)[1] < (*offsets)[0]) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, ": bad data_offsets"));
    }
    SafetensorsEntry entry{dtype->text, *shape, static_cast<uint64_t>((*offsets)[0]),
                           static_cast<uint64_t>((*offsets)[1])};
    file.entries_[name] = std::move(entry);
  }
  return file;
}

absl::StatusOr<std::string> SafetensorsFile::ReadBytes(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", name));
  }
  return ReadRange(path_, data_start_ + it->second.begin, it->second.end - it->second.begin);
}

v1::DType WireDTypeOf(const std::string& safetensors_dtype) {
  if (safetensors_dtype == "F32") return v1::DTYPE_FLOAT32;
  if (safetensors_dtype == "F16") return v1::DTYPE_FLOAT16;
  if (safetensors_dtype == "BF16") return v1::DTYPE_BFLOAT16;
  return v1::DTYPE_UNSPECIFIED;
}

absl::Status WriteSafetensors(
    const std::string& path, const std::vector<std::pair<std::string, const HostTensor*>>& tensors) {
  std::string header = "{";
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const HostTensor& t = *tensors[i].second;
    const uint64_t bytes = t.data.size() * sizeof(float);
    absl::StrAppend(&header, i ? "," : "", "\"", tensors[i].first, "\":{\"dtype\":\"F32\",\"shape\":[",
                    absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",",
                    offset + bytes, "]}");
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8 != 0) header.push_back(' ');
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file.write(length, 8);
  file.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const auto& [name, tensor] : tensors) {
    file.write(reinterpret_cast<const char*>(tensor->data.data()),
               static_cast<std::streamsize>(tensor->data.size() * sizeof(float)));
  }
  if (!file) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace attngrad
