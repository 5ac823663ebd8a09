// The six weights of one attention layer as fp32 host arrays (the master copy every device worker
// uploads), how to draw them at random (SPEC section 3) and how to check them against a
// configuration.
#ifndef ATTNGRAD_SERVER_WEIGHTS_LAYER_WEIGHTS_H_
#define ATTNGRAD_SERVER_WEIGHTS_LAYER_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attngrad/backward.h"
#include "attngrad/layer_weights.h"
#include "attngrad/v1/attngrad.pb.h"
#include "attngrad/wire/layer.h"

namespace attngrad::server {

// Six fp32 arrays (or six gradient arrays of the same shapes).
using LayerTensors = PerWeight<std::vector<float>>;

// OK when every array has the size `config` implies; else INVALID_ARGUMENT naming the weight.
absl::Status CheckShapes(const LayerTensors& tensors, const LayerConfig& config);

struct LayerWeights {
  LayerConfig config;
  LayerTensors values;
  std::string source;  // "random:seed=N", "safetensors:PATH#layer=I" or "upload"
};

// Random weights as in SPEC section 3, drawn by attngrad::FillRandomLayerWeights
// (attngrad/spec_random.h: the generator the clients use to reproduce them from the same seed).
LayerWeights RandomLayerWeights(const LayerConfig& config, std::uint64_t seed);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_WEIGHTS_LAYER_WEIGHTS_H_
