// Loading one Gemma-3 attention layer from a Hugging Face safetensors checkpoint (a file, a sharded
// checkpoint's index, or a folder holding either), read with the wire library's
// attngrad/wire/safetensors.h.
#ifndef ATTNGRAD_SERVER_WEIGHTS_CHECKPOINT_LAYER_H_
#define ATTNGRAD_SERVER_WEIGHTS_CHECKPOINT_LAYER_H_

#include <string>

#include "absl/status/statusor.h"
#include "attngrad/wire/safetensors.h"
#include "weights/served_weights.h"

namespace attngrad::server {

// Loads the attention weights of decoder layer `layer`. Tensor names follow Hugging Face Gemma-3:
// model.layers.{layer}.self_attn.{q,k,v,o}_proj.weight and ...{q,k}_norm.weight, optionally behind
// a prefix (language_model.model.layers..., model.language_model.layers...). The layer
// configuration is read from the shapes (head_dim from q_norm; heads from the projections).
absl::StatusOr<LayerWeights> LoadSafetensorsLayer(const std::string& path, int layer);
// The same from a checkpoint already opened (a model directory's every layer reads one).
absl::StatusOr<LayerWeights> LoadCheckpointLayer(const wire::SafetensorsCheckpoint& checkpoint,
                                                 int layer);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_WEIGHTS_CHECKPOINT_LAYER_H_
