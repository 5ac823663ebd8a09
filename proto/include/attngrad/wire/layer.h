// One attention layer on the wire: its configuration (attngrad::LayerConfig <->
// attngrad.v1.LayerConfig) and its six weights (attngrad::Weight,
// kernels/include/attngrad/layer_weights.h: names and shapes) as the wire names them
// (attngrad.v1.WeightName, the fields of attngrad.v1.WeightGradients) and as Hugging Face
// checkpoints name them.
#ifndef ATTNGRAD_WIRE_LAYER_H_
#define ATTNGRAD_WIRE_LAYER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attngrad/layer_config.h"
#include "attngrad/layer_weights.h"
#include "attngrad/v1/attngrad.pb.h"

namespace attngrad::wire {

// The configuration a server reports; the SPEC layer's numbers (LayerConfig's defaults) where a
// field is missing or not positive.
LayerConfig LayerConfigFromWire(const v1::LayerConfig& wire);
void LayerConfigToWire(const LayerConfig& config, v1::LayerConfig* wire);

// The weight a wire name stands for; nullopt for UNSPECIFIED and values this build does not know.
std::optional<Weight> WeightOfWireName(int wire_name);
v1::WeightName WireWeightName(Weight weight);

// The field of attngrad.v1.WeightGradients that carries `weight`'s gradient.
const v1::Tensor& GradientTensor(const v1::WeightGradients& gradients, Weight weight);
v1::Tensor* MutableGradientTensor(v1::WeightGradients* gradients, Weight weight);

// "model.layers.{layer}.self_attn.{q_proj,...,k_norm}.weight": the tensor's name in a Hugging Face
// Gemma-3 text checkpoint.
std::string HuggingFaceTensorName(int layer, Weight weight);

// The one name among `names` that is HuggingFaceTensorName(layer, weight), possibly behind a prefix
// (multimodal checkpoints: "language_model.model.layers...", "model.language_model.layers...").
// NOT_FOUND or INVALID_ARGUMENT (several match), prefixed by `where`.
absl::StatusOr<std::string> FindLayerTensorName(const std::vector<std::string>& names, int layer,
                                                Weight weight, const std::string& where);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_LAYER_H_
