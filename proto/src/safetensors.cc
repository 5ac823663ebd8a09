// safetensors headers parsed with nlohmann::json (exceptions off: a malformed header is an error,
// never a throw), tensors read with positioned reads, and files written with an ordered header.
#include "attngrad/wire/safetensors.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attngrad/common/json_object.h"
#include "attngrad/common/read_file.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"

namespace attngrad::wire {
namespace {

constexpr std::uint64_t kMaxHeaderBytes = std::uint64_t{100} << 20;

// Bytes per element of a safetensors dtype; 0 for names this reader does not know.
std::uint64_t SafetensorsElementSize(absl::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

// The members of a JSON array of non-negative integers (each below 2^63).
absl::StatusOr<std::vector<std::uint64_t>> UnsignedArray(const nlohmann::json& value,
                                                         absl::string_view what) {
  if (!value.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be an array of integers >= 0"));
  }
  std::vector<std::uint64_t> numbers;
  numbers.reserve(value.size());
  for (const nlohmann::json& item : value) {
    if (!item.is_number_unsigned() ||
        item.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", item.dump(), " is not an integer >= 0"));
    }
    numbers.push_back(item.get<std::uint64_t>());
  }
  return numbers;
}

// A shard name from an index: a plain file name or a relative path that stays in the folder.
bool IsSafeShardName(const std::string& name) {
  const std::filesystem::path path(name);
  if (name.empty() || path.is_absolute()) return false;
  for (const std::filesystem::path& part : path) {
    if (part == "..") return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         std::uint64_t data_size,
                                                         absl::string_view where) {
  ATTNGRAD_ASSIGN_OR_RETURN(const nlohmann::json root,
                            common::ParseJsonObject(json, absl::StrCat(where, ": header")));
  SafetensorsHeader header;
  for (const auto& [name, value] : root.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": __metadata__ is not an object"));
      }
      for (const auto& [key, text] : value.items()) {
        if (text.is_string()) header.metadata[key] = text.get<std::string>();
      }
      continue;
    }
    const std::string tensor = absl::StrCat(where, ": tensor ", name);
    if (!value.is_object() || !value.contains("dtype") || !value["dtype"].is_string() ||
        !value.contains("shape") || !value.contains("data_offsets")) {
      return absl::InvalidArgumentError(absl::StrCat(
          tensor, ": needs dtype (a string), shape (an array) and data_offsets ([begin,end])"));
    }
    SafetensorsEntry entry;
    entry.dtype = value["dtype"].get<std::string>();
    ATTNGRAD_ASSIGN_OR_RETURN(const std::vector<std::uint64_t> shape,
                              UnsignedArray(value["shape"], absl::StrCat(tensor, ": shape")));
    entry.shape.assign(shape.begin(), shape.end());
    const std::int64_t count = NumElements(entry.shape);
    if (count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(tensor, ": shape ", ShapeString(entry.shape), " has too many elements"));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(
        const std::vector<std::uint64_t> offsets,
        UnsignedArray(value["data_offsets"], absl::StrCat(tensor, ": data_offsets")));
    if (offsets.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(tensor, ": data_offsets must be [begin,end]"));
    }
    entry.begin = offsets[0];
    entry.end = offsets[1];
    if (entry.begin > entry.end || entry.end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(tensor, ": data_offsets [", entry.begin, ",",
                                                     entry.end, "] outside the data section of ",
                                                     data_size, " bytes"));
    }
    const std::uint64_t element_size = SafetensorsElementSize(entry.dtype);
    if (element_size != 0 &&
        entry.end - entry.begin != static_cast<std::uint64_t>(count) * element_size) {
      return absl::InvalidArgumentError(absl::StrCat(tensor, ": ", entry.end - entry.begin,
                                                     " bytes for ", count, " elements of ",
                                                     entry.dtype));
    }
    header.tensors.emplace(name, std::move(entry));
  }
  return header;
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  std::ifstream file(path, std::ios::binary | std::ios::ate);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open safetensors file ", path));
  const std::streamoff end = file.tellg();
  const std::uint64_t file_size = end < 0 ? 0 : static_cast<std::uint64_t>(end);
  file.seekg(0);
  unsigned char length_bytes[8];
  if (file_size < 8 || !file.read(reinterpret_cast<char*>(length_bytes), 8)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": too short for a safetensors file"));
  }
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  if (header_length > kMaxHeaderBytes || header_length > file_size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_length,
                                                   " is larger than the file or than 100 MiB"));
  }
  std::string json(header_length, '\0');
  if (!file.read(json.data(), static_cast<std::streamsize>(header_length))) {
    return absl::DataLossError(absl::StrCat(path, ": cannot read the header"));
  }
  const std::uint64_t data_start = 8 + header_length;
  SafetensorsFile result;
  result.path_ = path;
  ATTNGRAD_ASSIGN_OR_RETURN(result.header_,
                            ParseSafetensorsHeader(json, file_size - data_start, path));
  result.header_.data_start = data_start;
  return result;
}

absl::StatusOr<const SafetensorsEntry*> SafetensorsFile::Find(absl::string_view name) const {
  auto it = header_.tensors.find(std::string(name));
  if (it == header_.tensors.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", name));
  }
  return &it->second;
}

absl::Status SafetensorsFile::ReadInto(const SafetensorsEntry& entry, char* out) const {
  const std::uint64_t size = entry.end - entry.begin;
  if (size == 0) return absl::OkStatus();
  std::ifstream file(path_, std::ios::binary);
  file.seekg(static_cast<std::streamoff>(header_.data_start + entry.begin));
  if (!file || !file.read(out, static_cast<std::streamsize>(size))) {
    return absl::DataLossError(absl::StrCat(path_, ": cannot read ", size, " bytes at offset ",
                                            header_.data_start + entry.begin,
                                            " (the file changed since it was opened?)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SafetensorsFile::ReadBytes(absl::string_view name) const {
  ATTNGRAD_ASSIGN_OR_RETURN(const SafetensorsEntry* entry, Find(name));
  std::string bytes(entry->end - entry->begin, '\0');
  ATTNGRAD_RETURN_IF_ERROR(ReadInto(*entry, bytes.data()));
  return bytes;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloats(absl::string_view name) const {
  ATTNGRAD_ASSIGN_OR_RETURN(const SafetensorsEntry* entry, Find(name));
  const v1::DType dtype = DTypeFromSafetensors(entry->dtype);
  if (dtype == v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", name, " has dtype ",
                                                   entry->dtype, "; expected F32, F16 or BF16"));
  }
  std::vector<float> values(static_cast<std::size_t>(NumElements(entry->shape)));
  if (dtype == v1::DTYPE_FLOAT32) {  // straight into the result
    ATTNGRAD_RETURN_IF_ERROR(ReadInto(*entry, reinterpret_cast<char*>(values.data())));
    return values;
  }
  std::string bytes(entry->end - entry->begin, '\0');
  ATTNGRAD_RETURN_IF_ERROR(ReadInto(*entry, bytes.data()));
  ATTNGRAD_RETURN_IF_ERROR(
      DecodeToFloat(bytes, dtype, absl::StrCat(path_, ": ", name), absl::MakeSpan(values)));
  return values;
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::map<std::string, std::string>> ReadSafetensorsIndex(const std::string& path) {
  ATTNGRAD_ASSIGN_OR_RETURN(const std::string text, common::ReadFileToString(path));
  ATTNGRAD_ASSIGN_OR_RETURN(const nlohmann::json root, common::ParseJsonObject(text, path));
  const auto weight_map = root.find("weight_map");
  if (weight_map == root.end() || !weight_map->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no \"weight_map\" object"));
  }
  std::map<std::string, std::string> shards;
  for (const auto& [name, shard] : weight_map->items()) {
    if (!shard.is_string() || !IsSafeShardName(shard.get<std::string>())) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": weight_map[\"", name, "\"] is not a file name in the index's folder"));
    }
    shards[name] = shard.get<std::string>();
  }
  return shards;
}

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& path) {
  std::error_code error;
  std::string file_path = path;
  if (std::filesystem::is_directory(path, error)) {
    const std::filesystem::path folder(path);
    if (std::filesystem::exists(folder / "model.safetensors.index.json", error)) {
      file_path = (folder / "model.safetensors.index.json").string();
    } else if (std::filesystem::exists(folder / "model.safetensors", error)) {
      file_path = (folder / "model.safetensors").string();
    } else {
      return absl::NotFoundError(absl::StrCat(
          path, ": a folder without model.safetensors.index.json or model.safetensors"));
    }
  }
  SafetensorsCheckpoint checkpoint;
  checkpoint.path_ = path;
  if (!absl::EndsWith(file_path, ".json")) {
    ATTNGRAD_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(file_path));
    for (const auto& [name, entry] : file.tensors()) checkpoint.file_of_tensor_[name] = 0;
    checkpoint.files_.push_back(std::move(file));
    return checkpoint;
  }
  ATTNGRAD_ASSIGN_OR_RETURN(const auto shards, ReadSafetensorsIndex(file_path));
  const std::filesystem::path folder = std::filesystem::path(file_path).parent_path();
  std::map<std::string, std::size_t> file_index;  // shard name -> index into files_
  for (const auto& [name, shard] : shards) {
    auto it = file_index.find(shard);
    if (it == file_index.end()) {
      ATTNGRAD_ASSIGN_OR_RETURN(SafetensorsFile file,
                                SafetensorsFile::Open((folder / shard).string()));
      checkpoint.files_.push_back(std::move(file));
      it = file_index.emplace(shard, checkpoint.files_.size() - 1).first;
    }
    if (checkpoint.files_[it->second].tensors().count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(file_path, ": ", name, " is in ", shard,
                                                     " by the weight_map, but that file lacks it"));
    }
    checkpoint.file_of_tensor_[name] = it->second;
  }
  return checkpoint;
}

std::vector<std::string> SafetensorsCheckpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(file_of_tensor_.size());
  for (const auto& [name, file] : file_of_tensor_) names.push_back(name);
  return names;
}

const SafetensorsFile* SafetensorsCheckpoint::FileOf(absl::string_view name) const {
  auto it = file_of_tensor_.find(name);
  return it == file_of_tensor_.end() ? nullptr : &files_[it->second];
}

absl::StatusOr<const SafetensorsEntry*> SafetensorsCheckpoint::Find(absl::string_view name) const {
  const SafetensorsFile* file = FileOf(name);
  if (file == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", name));
  return file->Find(name);
}

absl::StatusOr<std::string> SafetensorsCheckpoint::ReadBytes(absl::string_view name) const {
  const SafetensorsFile* file = FileOf(name);
  if (file == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", name));
  return file->ReadBytes(name);
}

absl::StatusOr<std::vector<float>> SafetensorsCheckpoint::ReadFloats(absl::string_view name) const {
  const SafetensorsFile* file = FileOf(name);
  if (file == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", name));
  return file->ReadFloats(name);
}

// ---------------------------------------------------------------------------------------------

absl::Status WriteSafetensors(const std::string& path, absl::Span<const SafetensorsTensor> tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const SafetensorsTensor& tensor : tensors) {
    const std::int64_t count = NumElements(tensor.shape);
    if (count < 0 || static_cast<std::uint64_t>(count) != tensor.values.size()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", tensor.name, " has ",
                                                     tensor.values.size(), " values for shape ",
                                                     ShapeString(tensor.shape)));
    }
    if (SafetensorsDTypeName(tensor.dtype).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", tensor.name, ": cannot write dtype ", tensor.dtype));
    }
    if (tensor.name == "__metadata__" || !names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor name ", tensor.name, " is reserved or given twice"));
    }
    const std::uint64_t bytes = static_cast<std::uint64_t>(count) * DTypeSize(tensor.dtype);
    header[tensor.name] = {{"dtype", std::string(SafetensorsDTypeName(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  while (text.size() % 8 != 0) text.push_back(' ');
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  char length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] = static_cast<char>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xff);
  }
  file.write(length, 8);
  file.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::string encoded;
  for (const SafetensorsTensor& tensor : tensors) {
    if (tensor.dtype == v1::DTYPE_FLOAT32) {  // the host is little-endian: the values as they are
      file.write(reinterpret_cast<const char*>(tensor.values.data()),
                 static_cast<std::streamsize>(tensor.values.size() * sizeof(float)));
      continue;
    }
    encoded.clear();
    EncodeFromFloat(tensor.values, tensor.dtype, &encoded);
    file.write(encoded.data(), static_cast<std::streamsize>(encoded.size()));
  }
  if (!file) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace attngrad::wire
