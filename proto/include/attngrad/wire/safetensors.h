// safetensors files (https://github.com/huggingface/safetensors: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the data)
// and Hugging Face checkpoints made of them: one file, or shards named by a
// model.safetensors.index.json "weight_map". Headers are checked when opened (every offset inside
// the file, byte counts matching dtype and shape); tensors are read on demand with positioned
// reads, so a many-GB checkpoint costs only what is asked for.
#ifndef ATTNGRAD_WIRE_SAFETENSORS_H_
#define ATTNGRAD_WIRE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attngrad/v1/tensor.pb.h"

namespace attngrad::wire {

// One tensor of a safetensors header.
struct SafetensorsEntry {
  std::string dtype;  // as written: "F32", "F16", "BF16", "I64", ...
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte offsets relative to the start of the data section
  std::uint64_t end = 0;
};

// A parsed and checked safetensors header.
struct SafetensorsHeader {
  std::uint64_t data_start = 0;  // 8 + the header's length
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__" (string values only)
};

// Parses the JSON text of a header for a data section of `data_size` bytes. INVALID_ARGUMENT,
// prefixed by `where`, for malformed JSON, a missing or mistyped field, offsets outside the data
// section, or a byte count that does not match the dtype and shape (for dtypes of known size).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         std::uint64_t data_size,
                                                         absl::string_view where);

// One safetensors file, its header read and checked by Open.
class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  // The entry of `name`; NOT_FOUND naming the file and the tensor.
  absl::StatusOr<const SafetensorsEntry*> Find(absl::string_view name) const;
  // The tensor's raw little-endian bytes.
  absl::StatusOr<std::string> ReadBytes(absl::string_view name) const;
  // The tensor converted to fp32 (F32, F16 and BF16; INVALID_ARGUMENT for other dtypes).
  absl::StatusOr<std::vector<float>> ReadFloats(absl::string_view name) const;

 private:
  absl::Status ReadInto(const SafetensorsEntry& entry, char* out) const;

  std::string path_;
  SafetensorsHeader header_;
};

// A Hugging Face checkpoint: a .safetensors file, a model.safetensors.index.json (shard file names
// relative to its folder), or a folder holding either (the index preferred). Every shard's header
// is read and checked by Open.
class SafetensorsCheckpoint {
 public:
  static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;
  // The file that holds `name`, or nullptr.
  const SafetensorsFile* FileOf(absl::string_view name) const;
  absl::StatusOr<const SafetensorsEntry*> Find(absl::string_view name) const;
  absl::StatusOr<std::string> ReadBytes(absl::string_view name) const;
  absl::StatusOr<std::vector<float>> ReadFloats(absl::string_view name) const;

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::size_t, std::less<>> file_of_tensor_;  // index into files_
};

// Reads an index file's "weight_map": tensor name -> shard file name (as written).
absl::StatusOr<std::map<std::string, std::string>> ReadSafetensorsIndex(const std::string& path);

// A tensor to write: fp32 values with a shape, stored as `dtype` (FLOAT32, FLOAT16 or BFLOAT16).
struct SafetensorsTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  absl::Span<const float> values;
  v1::DType dtype = v1::DTYPE_FLOAT32;
};

// Writes a safetensors file: the tensors' data in the order given, the header padded with spaces
// to a multiple of 8 bytes, and `metadata` as "__metadata__" when not empty.
absl::Status WriteSafetensors(const std::string& path, absl::Span<const SafetensorsTensor> tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_SAFETENSORS_H_
