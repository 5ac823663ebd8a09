// One layer's six tensors found by name in a checkpoint, converted to fp32, and the layer's
// configuration derived from their shapes and checked against all six.
#include "weights/checkpoint_layer.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/safetensors.h"

namespace attngrad::server {
namespace {

// The layer's configuration from the shapes of q_norm ([head_dim]), q_proj ([heads*head_dim,
// hidden]) and k_proj ([kv_heads*head_dim, hidden]), then every shape checked against it.
absl::StatusOr<LayerConfig> ConfigFromShapes(const PerWeight<std::vector<std::int64_t>>& shapes,
                                             const std::string& path, int layer) {
  const std::vector<std::int64_t>& q_norm = shapes[Weight::kQNorm];
  const std::vector<std::int64_t>& q_proj = shapes[Weight::kQProj];
  const std::vector<std::int64_t>& k_proj = shapes[Weight::kKProj];
  if (q_norm.size() != 1 || q_proj.size() != 2 || k_proj.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected q_norm [head_dim] and 2-D projections; got q_norm ",
                     absl::StrJoin(q_norm, "x"), ", q_proj ", absl::StrJoin(q_proj, "x")));
  }
  LayerConfig config;
  config.head_dim = static_cast<int>(q_norm[0]);
  config.hidden_size = static_cast<int>(q_proj[1]);
  config.num_heads = config.head_dim > 0 ? static_cast<int>(q_proj[0] / config.head_dim) : 0;
  config.num_kv_heads = config.head_dim > 0 ? static_cast<int>(k_proj[0] / config.head_dim) : 0;
  if (!config.IsValid()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": shapes give an invalid layer (hidden ", config.hidden_size, ", heads ",
        config.num_heads, ", kv heads ", config.num_kv_heads, ", head_dim ", config.head_dim, ")"));
  }
  for (Weight weight : kAllWeights) {
    if (shapes[weight] != WeightShape(config, weight)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": layer ", layer, " ", WeightModuleName(weight), " has shape [",
                       absl::StrJoin(shapes[weight], ","), "], expected [",
                       absl::StrJoin(WeightShape(config, weight), ","), "] (hidden ",
                       config.hidden_size, ", heads ", config.num_heads, "/", config.num_kv_heads,
                       ", head_dim ", config.head_dim, ")"));
    }
  }
  return config;
}

}  // namespace

absl::StatusOr<LayerWeights> LoadSafetensorsLayer(const std::string& path, int layer) {
  if (layer < 0)
    return absl::InvalidArgumentError(absl::StrCat("--weights_layer: ", layer, " < 0"));
  ATTNGRAD_ASSIGN_OR_RETURN(const wire::SafetensorsCheckpoint checkpoint,
                            wire::SafetensorsCheckpoint::Open(path));
  return LoadCheckpointLayer(checkpoint, layer);
}

absl::StatusOr<LayerWeights> LoadCheckpointLayer(const wire::SafetensorsCheckpoint& checkpoint,
                                                 int layer) {
  const std::string& path = checkpoint.path();
  const std::vector<std::string> names = checkpoint.TensorNames();
  LayerWeights weights;
  weights.source = absl::StrCat("safetensors:", path, "#layer=", layer);
  PerWeight<std::vector<std::int64_t>> shapes;
  for (Weight weight : kAllWeights) {
    ATTNGRAD_ASSIGN_OR_RETURN(const std::string name,
                              wire::FindLayerTensorName(names, layer, weight, path));
    ATTNGRAD_ASSIGN_OR_RETURN(const wire::SafetensorsEntry* entry, checkpoint.Find(name));
    shapes[weight] = entry->shape;
    ATTNGRAD_ASSIGN_OR_RETURN(weights.values[weight], checkpoint.ReadFloats(name));
  }
  ATTNGRAD_ASSIGN_OR_RETURN(weights.config, ConfigFromShapes(shapes, path, layer));
  return weights;
}

}  // namespace attngrad::server
