// .npy reading and writing for the CLI.
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

namespace attngrad {

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
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": dtype must be little-endian float32 '<f4' or float64 '<f8'; header ", header));
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
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", shape, "), }");
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

}  // namespace attngrad
