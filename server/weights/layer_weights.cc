// Weight names, shapes and the deterministic random initialisation.
#include "weights/layer_weights.h"

#include <cmath>
#include "attngrad/spec_random.h"

#include "absl/strings/str_cat.h"

namespace attngrad::server {

const char* WeightModuleName(int index) {
  static constexpr const char* kNames[kNumWeights] = {"q_proj", "k_proj", "v_proj",
                                                     "o_proj", "q_norm", "k_norm"};
  return index >= 0 && index < kNumWeights ? kNames[index] : "unknown";
}

int WeightIndexOf(int wire_name) {
  return wire_name >= v1::WEIGHT_NAME_Q_PROJ && wire_name <= v1::WEIGHT_NAME_K_NORM
             ? wire_name - 1
             : -1;
}

v1::WeightName WireWeightName(int index) { return static_cast<v1::WeightName>(index + 1); }

std::vector<std::int64_t> WeightShape(const LayerConfig& config, int index) {
  switch (index) {
    case kQProj: return {config.q_out(), config.hidden_size};
    case kKProj:
    case kVProj: return {config.kv_out(), config.hidden_size};
    case kOProj: return {config.hidden_size, config.q_out()};
    default: return {config.head_dim};
  }
}

std::size_t WeightElements(const LayerConfig& config, int index) {
  std::size_t count = 1;
  for (std::int64_t dim : WeightShape(config, index)) count *= static_cast<std::size_t>(dim);
  return count;
}

LayerTensors LayerTensors::Zeros(const LayerConfig& config) {
  LayerTensors result;
  for (int i = 0; i < kNumWeights; ++i) result.tensors[i].assign(WeightElements(config, i), 0.f);
  return result;
}

absl::Status LayerTensors::CheckShapes(const LayerConfig& config) const {
  for (int i = 0; i < kNumWeights; ++i) {
    if (tensors[i].size() != WeightElements(config, i)) {
      return absl::InvalidArgumentError(absl::StrCat(WeightModuleName(i), ": ", tensors[i].size(),
                                                     " elements, expected ",
                                                     WeightElements(config, i)));
    }
  }
  return absl::OkStatus();
}

BackwardInputs LayerWeights::AsInputs() const {
  BackwardInputs in;
  in.q_weight = values.tensors[kQProj].data();
  in.k_weight = values.tensors[kKProj].data();
  in.v_weight = values.tensors[kVProj].data();
  in.o_weight = values.tensors[kOProj].data();
  in.q_norm_weight = values.tensors[kQNorm].data();
  in.k_norm_weight = values.tensors[kKNorm].data();
  return in;
}

LayerWeights RandomLayerWeights(const LayerConfig& config, std::uint64_t seed) {
  LayerWeights weights;
  weights.config = config;
  weights.source = absl::StrCat("random:seed=", seed);
  weights.values = LayerTensors::Zeros(config);
  std::array<std::vector<float>, kNumWeights>& t = weights.values.tensors;
  FillRandomLayerWeights(config, seed, t[kQProj].data(), t[kKProj].data(), t[kVProj].data(),
                         t[kOProj].data(), t[kQNorm].data(), t[kKNorm].data());
  return weights;
}

}  // namespace attngrad::server
