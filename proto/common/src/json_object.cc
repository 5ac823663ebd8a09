// ParseJsonObject: nlohmann::json::parse with allow_exceptions = false, then the kind checked.
#include "attngrad/common/json_object.h"

#include "absl/strings/str_cat.h"

namespace attngrad::common {

absl::StatusOr<nlohmann::json> ParseJsonObject(absl::string_view text, absl::string_view where) {
  nlohmann::json root = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                              /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not valid JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
  }
  return root;
}

}  // namespace attngrad::common
