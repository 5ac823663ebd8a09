// Tensor files the CLI reads and writes: NumPy .npy (fp32 '<f4' or fp64 '<f8', C order; fp32 is
// written) and safetensors (read: any tensor's header entry and raw bytes, F32/F16/BF16 converted to
// fp32 on request; write: fp32 tensors with a JSON header).
#ifndef ATTNGRAD_CLIENT_SRC_TENSOR_FILES_H_
#define ATTNGRAD_CLIENT_SRC_TENSOR_FILES_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "attngrad/client.h"

namespace attngrad {

absl::StatusOr<HostTensor> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const HostTensor& tensor);

struct SafetensorsEntry {
  std::string dtype;  // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data section
  uint64_t end = 0;
};

// The header of a safetensors file (the tensors' entries; the data is read on demand).
class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  // The raw bytes of one tensor; NOT_FOUND names the missing tensor.
  absl::StatusOr<std::string> ReadBytes(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
};

// The wire dtype of a safetensors dtype ("F32" -> FLOAT32, "F16", "BF16"); UNSPECIFIED otherwise.
v1::DType WireDTypeOf(const std::string& safetensors_dtype);

// fp32 tensors written as a safetensors file, in the order given.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, const HostTensor*>>& tensors);

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_SRC_TENSOR_FILES_H_
