// The layer-range grammar of attngrad/wire/layer_range.h, parsed with absl's string splitting and
// a digits-only reading of layer numbers (no sign, no other characters).
#include "attngrad/wire/layer_range.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace attngrad::wire {
namespace {

// A layer number: ASCII digits only, below 2^31; false for anything else.
bool ParseLayerNumber(absl::string_view text, int* layer) {
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return false;
  std::int64_t value = 0;
  for (const char digit : text) {
    if (digit < '0' || digit > '9') return false;
    value = value * 10 + (digit - '0');
    if (value > INT32_MAX) return false;
  }
  *layer = static_cast<int>(value);
  return true;
}

// One "span=target" entry of a map of several; `whole` is the map, for the message.
absl::StatusOr<LayerRange> ParseMapEntry(absl::string_view piece, absl::string_view whole) {
  piece = absl::StripAsciiWhitespace(piece);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer map \"", whole, "\": \"", piece, "\": ", why,
                     " (expected FIRST-LAST=host:port, e.g. \"0-12=host-a:50051\")"));
  };
  const std::vector<absl::string_view> sides = absl::StrSplit(piece, absl::MaxSplits('=', 1));
  if (sides.size() != 2) return bad("no '='");
  const std::string target(absl::StripAsciiWhitespace(sides[1]));
  if (target.empty()) return bad("no address");
  absl::StatusOr<LayerRange> range = ParseLayerSpan(sides[0]);
  if (!range.ok()) return bad(range.status().message());
  range->target = target;
  return range;
}

}  // namespace

std::string LayerRange::ToString() const {
  if (all_layers()) return target;
  const std::string span = first == last ? absl::StrCat(first) : absl::StrCat(first, "-", last);
  return target.empty() ? span : absl::StrCat(span, "=", target);
}

absl::StatusOr<LayerRange> ParseLayerSpan(absl::string_view text) {
  const std::vector<absl::string_view> bounds =
      absl::StrSplit(absl::StripAsciiWhitespace(text), absl::MaxSplits('-', 1));
  LayerRange range;
  if (!ParseLayerNumber(bounds[0], &range.first) || !ParseLayerNumber(bounds.back(), &range.last)) {
    return absl::InvalidArgumentError("the layers are not a range of integers");
  }
  if (range.last < range.first) {
    return absl::InvalidArgumentError("the range must be FIRST-LAST with 0 <= FIRST <= LAST");
  }
  return range;
}

absl::StatusOr<std::vector<LayerRange>> ParseLayerMap(absl::string_view text) {
  const absl::string_view whole = absl::StripAsciiWhitespace(text);
  if (whole.empty()) return absl::InvalidArgumentError("layer map: empty");
  if (!absl::StrContains(whole, '=')) {
    if (absl::StrContains(whole, ',')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer map \"", whole,
          "\": several servers need layer ranges, e.g. \"0-12=host-a:50051,13-25=host-b:50051\""));
    }
    return std::vector<LayerRange>{LayerRange{-1, -1, std::string(whole)}};
  }
  std::vector<LayerRange> map;
  for (const absl::string_view piece : absl::StrSplit(whole, ',')) {
    absl::StatusOr<LayerRange> range = ParseMapEntry(piece, whole);
    if (!range.ok()) return range.status();
    map.push_back(*std::move(range));
  }
  std::sort(map.begin(), map.end(),
            [](const LayerRange& a, const LayerRange& b) { return a.first < b.first; });
  for (std::size_t i = 1; i < map.size(); ++i) {
    if (map[i].first <= map[i - 1].last) {
      return absl::InvalidArgumentError(absl::StrCat("layer map \"", whole,
                                                     "\": ", map[i - 1].ToString(), " and ",
                                                     map[i].ToString(), " overlap"));
    }
  }
  return map;
}

std::string LayerMapString(const std::vector<LayerRange>& map) {
  return absl::StrJoin(map, ",", [](std::string* out, const LayerRange& range) {
    absl::StrAppend(out, range.ToString());
  });
}

}  // namespace attngrad::wire
