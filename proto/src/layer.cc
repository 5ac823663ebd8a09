// A layer's configuration and weight names on the wire and in Hugging Face checkpoints.
#include "attngrad/wire/layer.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attngrad::wire {

LayerConfig LayerConfigFromWire(const v1::LayerConfig& wire) {
  LayerConfig config;
  if (wire.hidden_size() > 0) config.hidden_size = wire.hidden_size();
  if (wire.num_heads() > 0) config.num_heads = wire.num_heads();
  if (wire.num_kv_heads() > 0) config.num_kv_heads = wire.num_kv_heads();
  if (wire.head_dim() > 0) config.head_dim = wire.head_dim();
  return config;
}

void LayerConfigToWire(const LayerConfig& config, v1::LayerConfig* wire) {
  wire->set_hidden_size(config.hidden_size);
  wire->set_num_heads(config.num_heads);
  wire->set_num_kv_heads(config.num_kv_heads);
  wire->set_head_dim(config.head_dim);
}

const v1::Tensor& GradientTensor(const v1::WeightGradients& gradients, Weight weight) {
  switch (weight) {
    case Weight::kQProj: return gradients.q_proj();
    case Weight::kKProj: return gradients.k_proj();
    case Weight::kVProj: return gradients.v_proj();
    case Weight::kOProj: return gradients.o_proj();
    case Weight::kQNorm: return gradients.q_norm();
    case Weight::kKNorm: break;
  }
  return gradients.k_norm();
}

v1::Tensor* MutableGradientTensor(v1::WeightGradients* gradients, Weight weight) {
  switch (weight) {
    case Weight::kQProj: return gradients->mutable_q_proj();
    case Weight::kKProj: return gradients->mutable_k_proj();
    case Weight::kVProj: return gradients->mutable_v_proj();
    case Weight::kOProj: return gradients->mutable_o_proj();
    case Weight::kQNorm: return gradients->mutable_q_norm();
    case Weight::kKNorm: break;
  }
  return gradients->mutable_k_norm();
}

v1::WeightName WireWeightName(Weight weight) {
  return static_cast<v1::WeightName>(v1::WEIGHT_NAME_Q_PROJ + IndexOf(weight));
}

std::optional<Weight> WeightOfWireName(int wire_name) {
  if (wire_name < v1::WEIGHT_NAME_Q_PROJ || wire_name > v1::WEIGHT_NAME_K_NORM) return std::nullopt;
  return static_cast<Weight>(wire_name - v1::WEIGHT_NAME_Q_PROJ);
}

std::string HuggingFaceTensorName(int layer, Weight weight) {
  return absl::StrCat("model.layers.", layer, ".self_attn.", WeightModuleName(weight), ".weight");
}

absl::StatusOr<std::string> FindLayerTensorName(const std::vector<std::string>& names, int layer,
                                                Weight weight, const std::string& where) {
  const std::string canonical = HuggingFaceTensorName(layer, weight);
  // "model.language_model.layers..." keeps "language_model.layers..." as its tail.
  const std::string suffixes[] = {canonical,
                                  absl::StrCat("language_model.layers.", layer, ".self_attn.",
                                               WeightModuleName(weight), ".weight")};
  std::vector<std::string> matches;
  for (const std::string& name : names) {
    for (const std::string& suffix : suffixes) {
      if (name == suffix ||
          (absl::EndsWith(name, suffix) && name[name.size() - suffix.size() - 1] == '.')) {
        matches.push_back(name);
        break;
      }
    }
  }
  if (matches.empty()) {
    return absl::NotFoundError(absl::StrCat(where, ": no tensor ", canonical, " (layer ", layer,
                                            "; check --weights_layer)"));
  }
  if (matches.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": several tensors match ", canonical,
                                                   ": ", absl::StrJoin(matches, ", ")));
  }
  return matches.front();
}

}  // namespace attngrad::wire
