// The six weights of one attention layer as fp32 host arrays (the master copy every device worker
// uploads), how to draw them at random (SPEC section 3) and how to check them against a
// configuration.
#ifndef ATTNGRAD_SERVER_LAYER_WEIGHTS_H_
#define ATTNGRAD_SERVER_LAYER_WEIGHTS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attngrad/backward.h"
#include "attngrad/v1/attngrad.pb.h"

namespace attngrad::server {

// Index of each weight in LayerWeights::tensors (the order of attngrad.v1.WeightName minus one).
enum WeightIndex : int { kQProj = 0, kKProj, kVProj, kOProj, kQNorm, kKNorm, kNumWeights };

// "q_proj", "k_proj", ... (the Hugging Face module names).
const char* WeightModuleName(int index);
// WeightIndex of a wire name; -1 for UNSPECIFIED or unknown values.
int WeightIndexOf(int wire_name);
v1::WeightName WireWeightName(int index);
// The shape of each weight for `config`: q_proj [q_out,hidden], k/v_proj [kv_out,hidden],
// o_proj [hidden,q_out], q/k_norm [head_dim].
std::vector<std::int64_t> WeightShape(const LayerConfig& config, int index);
std::size_t WeightElements(const LayerConfig& config, int index);

// Six fp32 arrays (or six gradient arrays of the same shapes).
struct LayerTensors {
  std::array<std::vector<float>, kNumWeights> tensors;

  // Resized to `config`'s shapes and zero-filled.
  static LayerTensors Zeros(const LayerConfig& config);
  // OK when every array has the size `config` implies; else INVALID_ARGUMENT naming the weight.
  absl::Status CheckShapes(const LayerConfig& config) const;
};

struct LayerWeights {
  LayerConfig config;
  LayerTensors values;
  std::string source;  // "random:seed=N", "safetensors:PATH#layer=I" or "upload"

  BackwardInputs AsInputs() const;  // weight pointers only; activations left null
};

// Random weights as in SPEC section 3, drawn by attngrad::FillRandomLayerWeights
// (attngrad/spec_random.h: the generator the clients use to reproduce them from the same seed).
LayerWeights RandomLayerWeights(const LayerConfig& config, std::uint64_t seed);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_LAYER_WEIGHTS_H_
