// NumPy .npy files the CLI reads and writes (fp32 '<f4' or fp64 '<f8', C order; fp32 is written).
// safetensors files are the wire library's: attngrad/wire/safetensors.h.
#ifndef ATTNGRAD_CLIENT_SRC_TENSOR_FILES_H_
#define ATTNGRAD_CLIENT_SRC_TENSOR_FILES_H_

#include <string>

#include "absl/status/statusor.h"
#include "attngrad/client.h"

namespace attngrad {

absl::StatusOr<HostTensor> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const HostTensor& tensor);

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_SRC_TENSOR_FILES_H_
