// ReadFileToString with std::ifstream (binary: the bytes as they are on disk).
#include "attngrad/common/read_file.h"

#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace attngrad::common {

absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what) {
  const std::string prefix = what.empty() ? "" : absl::StrCat(what, ": ");
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat(prefix, "cannot read ", path));
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) return absl::DataLossError(absl::StrCat(prefix, "cannot read all of ", path));
  return text;
}

}  // namespace attngrad::common
