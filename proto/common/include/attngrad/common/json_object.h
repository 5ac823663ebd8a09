// A JSON object parsed from text with nlohmann::json, exceptions off: malformed text is an error
// status, never a throw. For config.json files, safetensors headers and their index files.
#ifndef ATTNGRAD_COMMON_JSON_OBJECT_H_
#define ATTNGRAD_COMMON_JSON_OBJECT_H_

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attngrad::common {

// The object `text` holds. INVALID_ARGUMENT "<where>: not valid JSON" for text that does not
// parse, "<where>: not a JSON object" for JSON of another kind (an array, a number, ...).
absl::StatusOr<nlohmann::json> ParseJsonObject(absl::string_view text, absl::string_view where);

}  // namespace attngrad::common

#endif  // ATTNGRAD_COMMON_JSON_OBJECT_H_
