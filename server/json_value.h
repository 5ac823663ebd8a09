// A minimal JSON reader (RFC 8259: objects, arrays, strings with escapes, numbers, true/false/null)
// for safetensors headers and their index files. Not a general-purpose library: no writer.
#ifndef ATTNGRAD_SERVER_JSON_VALUE_H_
#define ATTNGRAD_SERVER_JSON_VALUE_H_

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace attngrad::server {

struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0.0;
  std::string text;        // kNumber: the literal as written (exact integers); kString: the value
  std::vector<JsonValue> array;
  std::map<std::string, JsonValue> object;

  bool IsObject() const { return kind == Kind::kObject; }
  // The member `key` of an object, or nullptr.
  const JsonValue* Find(const std::string& key) const;
};

// Parses one JSON document (surrounding whitespace allowed). Nesting is limited to 64 levels.
absl::StatusOr<JsonValue> ParseJson(std::string_view text);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_JSON_VALUE_H_
