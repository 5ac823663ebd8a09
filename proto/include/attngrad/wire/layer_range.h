// Decoder layers addressed by range, as server and client write them: the server's --layers
// ("A-B" or "A") and the sharded client's layer maps ("0-12=host-a:50051,13-25=host-b:50051", or a
// plain "host:port" for every layer). One type and one grammar for both (the Python client's
// attngrad.sharded follows the same grammar; tests/fixtures/layer_maps.json holds the examples
// both parsers are tested on):
//
//   map    := target | entry ("," entry)*
//   entry  := span "=" target
//   span   := layer | layer "-" layer         first <= last
//   layer  := [0-9]+                          below 2^31
//   target := any text without ",", not empty
//
// ASCII whitespace around entries, spans, layers and targets is ignored. The entries of a map must
// not overlap; they are returned sorted by first layer.
#ifndef ATTNGRAD_WIRE_LAYER_RANGE_H_
#define ATTNGRAD_WIRE_LAYER_RANGE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attngrad::wire {

// Decoder layers first..last (inclusive), served at `target` in a layer map (empty elsewhere).
// first = last = -1: every layer (a map that is a plain target).
struct LayerRange {
  int first = -1;
  int last = -1;
  std::string target;

  bool all_layers() const { return first < 0; }
  bool Contains(int layer) const { return all_layers() || (layer >= first && layer <= last); }
  // "0-12=host-a:50051" ("7=host:port" for one layer), or the bare target for every layer; without
  // a target, the span alone ("0-12", "7").
  std::string ToString() const;
};

// A span "A-B" or "A" (no target). INVALID_ARGUMENT whose message says what is wrong ("the layers
// are not a range of integers", "the range must be FIRST-LAST with 0 <= FIRST <= LAST"), for the
// caller to prefix with the flag or map it came from.
absl::StatusOr<LayerRange> ParseLayerSpan(absl::string_view text);

// A layer map (the grammar above). INVALID_ARGUMENT naming the bad entry otherwise.
absl::StatusOr<std::vector<LayerRange>> ParseLayerMap(absl::string_view text);

// The map written back as ParseLayerMap reads it.
std::string LayerMapString(const std::vector<LayerRange>& map);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_LAYER_RANGE_H_
