// safetensors header parsing and tensor reading with positioned reads (a checkpoint may be many GB;
// only the requested tensors are read).
#include "weights/safetensors.h"

#include <cstring>
#include <fstream>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "half_float.h"
#include "json_value.h"

namespace attngrad::server {
namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

std::size_t SafetensorsDTypeSize(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "F16" || dtype == "BF16") return 2;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

absl::StatusOr<std::uint64_t> JsonUnsigned(const JsonValue& value, const std::string& what) {
  if (value.kind != JsonValue::Kind::kNumber || value.text.empty() ||
      value.text.find_first_not_of("0123456789") != std::string::npos || value.text.size() > 19) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be a non-negative integer"));
  }
  return std::stoull(value.text);
}

std::string DirectoryOf(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

// The key of `module` (e.g. "q_proj") of decoder layer `layer` among `names`.
absl::StatusOr<std::string> FindLayerTensor(const std::set<std::string>& names, int layer,
                                            const std::string& module, const std::string& where) {
  const std::string suffixes[] = {
      absl::StrCat("model.layers.", layer, ".self_attn.", module, ".weight"),
      absl::StrCat("language_model.layers.", layer, ".self_attn.", module, ".weight")};
  std::vector<std::string> matches;
  for (const std::string& name : names) {
    for (const std::string& suffix : suffixes) {
      if (name == suffix ||
          (absl::EndsWith(name, suffix) && name[name.size() - suffix.size() - 1] == '.')) {
        matches.push_back(name);
        break;
      }
    }
  }
  if (matches.empty()) {
    return absl::NotFoundError(absl::StrCat(where, ": no tensor ", suffixes[0],
                                            " (layer ", layer, "; check --weights_layer)"));
  }
  if (matches.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": several tensors match ", suffixes[0],
                                                   ": ", absl::StrJoin(matches, ", ")));
  }
  return matches.front();
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path) {
  std::ifstream file(path, std::ios::binary | std::ios::ate);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open safetensors file ", path));
  SafetensorsHeader header;
  header.path = path;
  header.file_size = static_cast<std::uint64_t>(file.tellg());
  file.seekg(0);
  unsigned char length_bytes[8];
  if (header.file_size < 8 || !file.read(reinterpret_cast<char*>(length_bytes), 8)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": too short for a safetensors file"));
  }
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  if (header_length > kMaxHeaderBytes || header_length > header.file_size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_length,
                                                   " is larger than the file or than 100 MiB"));
  }
  std::string json(header_length, '\0');
  if (!file.read(json.data(), static_cast<std::streamsize>(header_length))) {
    return absl::DataLossError(absl::StrCat(path, ": cannot read the header"));
  }
  header.data_start = 8 + header_length;
  absl::StatusOr<JsonValue> root = ParseJson(json);
  if (!root.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header: ", root.status().message()));
  }
  if (!root->IsObject()) return absl::InvalidArgumentError(absl::StrCat(path, ": header is not an object"));
  const std::uint64_t data_size = header.file_size - header.data_start;
  for (const auto& [name, value] : root->object) {
    if (name == "__metadata__") continue;
    const std::string where = absl::StrCat(path, ": tensor ", name);
    const JsonValue* dtype = value.Find("dtype");
    const JsonValue* shape = value.Find("shape");
    const JsonValue* offsets = value.Find("data_offsets");
    if (dtype == nullptr || dtype->kind != JsonValue::Kind::kString || shape == nullptr ||
        shape->kind != JsonValue::Kind::kArray || offsets == nullptr ||
        offsets->kind != JsonValue::Kind::kArray || offsets->array.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": needs dtype (string), shape (array), data_offsets ([begin,end])"));
    }
    SafetensorsEntry entry;
    entry.dtype = dtype->text;
    std::uint64_t count = 1;
    for (const JsonValue& dim : shape->array) {
      absl::StatusOr<std::uint64_t> size = JsonUnsigned(dim, absl::StrCat(where, ": shape"));
      if (!size.ok()) return size.status();
      if (*size > (1ull << 40)) return absl::InvalidArgumentError(absl::StrCat(where, ": shape too large"));
      count *= *size;
      if (count > (1ull << 40)) return absl::InvalidArgumentError(absl::StrCat(where, ": too many elements"));
      entry.shape.push_back(static_cast<std::int64_t>(*size));
    }
    absl::StatusOr<std::uint64_t> begin = JsonUnsigned(offsets->array[0], where + ": data_offsets");
    absl::StatusOr<std::uint64_t> end = JsonUnsigned(offsets->array[1], where + ": data_offsets");
    if (!begin.ok()) return begin.status();
    if (!end.ok()) return end.status();
    if (*begin > *end || *end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets [", *begin, ",", *end,
                                                     "] outside the data section of ", data_size,
                                                     " bytes"));
    }
    entry.begin = *begin;
    entry.end = *end;
    const std::size_t element_size = SafetensorsDTypeSize(entry.dtype);
    if (element_size != 0 && *end - *begin != count * element_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", *end - *begin, " bytes for ", count,
                                                     " elements of ", entry.dtype));
    }
    header.tensors.emplace(name, std::move(entry));
  }
  return header;
}

absl::StatusOr<std::vector<float>> ReadSafetensorsTensor(const SafetensorsHeader& header,
                                                         const std::string& name) {
  auto it = header.tensors.find(name);
  if (it == header.tensors.end()) {
    return absl::NotFoundError(absl::StrCat(header.path, ": no tensor ", name));
  }
  const SafetensorsEntry& entry = it->second;
  const std::size_t element_size =
      entry.dtype == "F32" ? 4 : (entry.dtype == "F16" || entry.dtype == "BF16") ? 2 : 0;
  if (element_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(header.path, ": tensor ", name, " has dtype ",
                                                   entry.dtype, "; expected F32, F16 or BF16"));
  }
  const std::uint64_t bytes = entry.end - entry.begin;
  std::string raw(bytes, '\0');
  std::ifstream file(header.path, std::ios::binary);
  file.seekg(static_cast<std::streamoff>(header.data_start + entry.begin));
  if (!file || !file.read(raw.data(), static_cast<std::streamsize>(bytes))) {
    return absl::DataLossError(absl::StrCat(header.path, ": cannot read tensor ", name));
  }
  std::vector<float> values(bytes / element_size);
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (element_size == 4) {
      std::memcpy(&values[i], raw.data() + 4 * i, 4);
    } else {
      std::uint16_t bits;
      std::memcpy(&bits, raw.data() + 2 * i, 2);
      values[i] = entry.dtype == "F16" ? HalfToFloat(bits) : BFloat16ToFloat(bits);
    }
  }
  return values;
}

absl::StatusOr<LayerWeights> LoadSafetensorsLayer(const std::string& path, int layer) {
  if (layer < 0) return absl::InvalidArgumentError(absl::StrCat("--weights_layer: ", layer, " < 0"));
  // Which file holds each tensor: the file itself, or the index's weight_map.
  std::map<std::string, std::string> file_of_tensor;
  std::map<std::string, SafetensorsHeader> headers;
  if (absl::EndsWith(path, ".json")) {
    std::ifstream file(path);
    if (!file) return absl::NotFoundError(absl::StrCat("cannot open index file ", path));
    const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    absl::StatusOr<JsonValue> index = ParseJson(text);
    if (!index.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", index.status().message()));
    const JsonValue* weight_map = index->Find("weight_map");
    if (weight_map == nullptr || !weight_map->IsObject()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": no \"weight_map\" object"));
    }
    for (const auto& [name, shard] : weight_map->object) {
      if (shard.kind != JsonValue::Kind::kString) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map[", name, "] is not a string"));
      }
      file_of_tensor[name] = DirectoryOf(path) + shard.text;
    }
  } else {
    absl::StatusOr<SafetensorsHeader> header = ReadSafetensorsHeader(path);
    if (!header.ok()) return header.status();
    for (const auto& [name, entry] : header->tensors) file_of_tensor[name] = path;
    headers.emplace(path, *std::move(header));
  }
  std::set<std::string> names;
  for (const auto& [name, file] : file_of_tensor) names.insert(name);

  LayerWeights weights;
  weights.source = absl::StrCat("safetensors:", path, "#layer=", layer);
  std::array<std::vector<std::int64_t>, kNumWeights> shapes;
  for (int i = 0; i < kNumWeights; ++i) {
    absl::StatusOr<std::string> name = FindLayerTensor(names, layer, WeightModuleName(i), path);
    if (!name.ok()) return name.status();
    const std::string& file = file_of_tensor[*name];
    auto header_it = headers.find(file);
    if (header_it == headers.end()) {
      absl::StatusOr<SafetensorsHeader> header = ReadSafetensorsHeader(file);
      if (!header.ok()) return header.status();
      header_it = headers.emplace(file, *std::move(header)).first;
    }
    auto entry = header_it->second.tensors.find(*name);
    if (entry == header_it->second.tensors.end()) {
      return absl::NotFoundError(absl::StrCat(file, ": no tensor ", *name, " (named by the index)"));
    }
    shapes[i] = entry->second.shape;
    absl::StatusOr<std::vector<float>> values = ReadSafetensorsTensor(header_it->second, *name);
    if (!values.ok()) return values.status();
    weights.values.tensors[i] = *std::move(values);
  }

  // The configuration from the shapes, then every shape checked against it.
  if (shapes[kQNorm].size() != 1 || shapes[kQProj].size() != 2 || shapes[kKProj].size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": expected q_norm [head_dim] and 2-D projections; got q_norm ",
        absl::StrJoin(shapes[kQNorm], "x"), ", q_proj ", absl::StrJoin(shapes[kQProj], "x")));
  }
  LayerConfig config;
  config.head_dim = static_cast<int>(shapes[kQNorm][0]);
  config.hidden_size = static_cast<int>(shapes[kQProj][1]);
  config.num_heads = config.head_dim > 0 ? static_cast<int>(shapes[kQProj][0] / config.head_dim) : 0;
  config.num_kv_heads = config.head_dim > 0 ? static_cast<int>(shapes[kKProj][0] / config.head_dim) : 0;
  if (!config.IsValid()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": shapes give an invalid layer (hidden ", config.hidden_size, ", heads ",
        config.num_heads, ", kv heads ", config.num_kv_heads, ", head_dim ", config.head_dim, ")"));
  }
  for (int i = 0; i < kNumWeights; ++i) {
    if (shapes[i] != WeightShape(config, i)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": layer ", layer, " ", WeightModuleName(i), " has shape [",
          absl::StrJoin(shapes[i], ","), "], expected [", absl::StrJoin(WeightShape(config, i), ","),
          "] (hidden ", config.hidden_size, ", heads ", config.num_heads, "/", config.num_kv_heads,
          ", head_dim ", config.head_dim, ")"));
    }
  }
  weights.config = config;
  return weights;
}

}  // namespace attngrad::server
