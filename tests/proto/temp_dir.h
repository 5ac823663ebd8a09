// A temporary directory for the wire library's tests, removed with its contents on destruction.
#ifndef ATTNGRAD_TESTS_PROTO_TEMP_DIR_H_
#define ATTNGRAD_TESTS_PROTO_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>

namespace attngrad::wire::testing {

class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "attngrad_wire_XXXXXX").string();
    path_ = mkdtemp(pattern.data()) == nullptr ? std::string() : pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace attngrad::wire::testing

#endif  // ATTNGRAD_TESTS_PROTO_TEMP_DIR_H_
