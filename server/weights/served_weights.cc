// The weights' shape check and the deterministic random initialisation.
#include "weights/served_weights.h"

#include "absl/strings/str_cat.h"
#include "attngrad/spec_random.h"

namespace attngrad::server {

absl::Status CheckShapes(const LayerTensors& tensors, const LayerConfig& config) {
  for (Weight weight : kAllWeights) {
    if (tensors[weight].size() != WeightElements(config, weight)) {
      return absl::InvalidArgumentError(absl::StrCat(WeightModuleName(weight), ": ",
                                                     tensors[weight].size(), " elements, expected ",
                                                     WeightElements(config, weight)));
    }
  }
  return absl::OkStatus();
}

LayerWeights RandomLayerWeights(const LayerConfig& config, std::uint64_t seed) {
  LayerWeights weights;
  weights.config = config;
  weights.source = absl::StrCat("random:seed=", seed);
  weights.values = ZeroWeights<std::vector<float>>(config);
  FillRandomLayerWeights(config, seed, DataOf(weights.values));
  return weights;
}

}  // namespace attngrad::server
