// A whole file read into a string: configuration files, token files, TLS certificates and keys,
// safetensors index files. The one reader of whole files, so that every caller gets the same
// errors.
#ifndef ATTNGRAD_COMMON_READ_FILE_H_
#define ATTNGRAD_COMMON_READ_FILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attngrad::common {

// The bytes of the file at `path`. NOT_FOUND "cannot read <path>" when it cannot be opened,
// DATA_LOSS when reading it fails part way. `what` names the file's role in those messages
// ("--tokens_file: cannot read <path>"); empty: the message starts with "cannot read".
absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what = "");

}  // namespace attngrad::common

#endif  // ATTNGRAD_COMMON_READ_FILE_H_
