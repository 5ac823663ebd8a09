// A served model: the decoder layers one server holds (a whole Gemma-3 checkpoint, a range of it,
// or the seed's single layer), each with its fp32 weights and the attention settings config.json
// gives it (type, sliding window, RoPE base and scaling, scalars). Built from a Hugging Face model
// directory, from random weights of a named model (proto/models/gemma3.json, embedded at build
// time), or from one layer of a safetensors file.
#ifndef ATTNGRAD_SERVER_WEIGHTS_MODEL_H_
#define ATTNGRAD_SERVER_WEIGHTS_MODEL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attngrad/backward.h"
#include "attngrad/wire/layer_range.h"
#include "weights/served_weights.h"

namespace attngrad::server {

enum class AttentionType { kFull, kSliding };

// What config.json says about one decoder layer.
struct LayerSettings {
  int index = 0;
  AttentionType type = AttentionType::kFull;
  double rope_theta = 10000.0;
  double rope_scaling_factor = 1.0;  // linear RoPE scaling (positions / factor); 1 = none
  Scalars scalars;                   // defaults of a request: scaling, softcap, eps, window
};

// The attention fields of a Gemma-3 text config (config.json, or its text_config).
struct ModelConfig {
  std::string name;  // model name or model_type
  LayerConfig layer;
  int num_hidden_layers = 1;
  double query_pre_attn_scalar = 128;
  float softcap = 0;  // attn_logit_softcapping; <= 0 (null) = none
  int sliding_window = 0;
  int sliding_window_pattern = 1;
  std::vector<std::string> layer_types;  // "sliding_attention" / "full_attention"; may be empty
  float eps = 1e-6f;
  double rope_theta = 1e6;
  double rope_local_base_freq = 1e4;
  double rope_scaling_factor = 1.0;  // of the global layers (rope_scaling linear factor)

  // Layer i's settings: layer_types[i] when present, else full when (i+1) % pattern == 0.
  LayerSettings Layer(int index) const;
};

// Parses config.json text (a text_config object inside is preferred). INVALID_ARGUMENT, prefixed
// by `where`, for malformed JSON or missing/invalid sizes.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json, absl::string_view where);

// The configs of proto/models/gemma3.json ("spec", "gemma-3-270m", ..., "gemma-3-27b").
absl::StatusOr<ModelConfig> NamedModelConfig(const std::string& name);
std::vector<std::string> NamedModels();

// --layers: "A-B" (inclusive) or "A" (attngrad/wire/layer_range.h's span), or "" for every layer,
// against a model of `num_layers`.
absl::StatusOr<wire::LayerRange> ParseLayerRange(const std::string& text, int num_layers);

struct ServedLayer {
  LayerSettings settings;
  std::shared_ptr<const LayerWeights> weights;
};

struct ServedModel {
  std::string name;  // "" for a single layer
  int num_hidden_layers = 1;
  std::vector<ServedLayer> layers;  // ascending index, at least one
};

// Every layer in `range` of a Hugging Face model directory (config.json + model.safetensors or a
// sharded index), fp32 master copies.
absl::StatusOr<ServedModel> LoadModelDirectory(const std::string& directory,
                                               const std::string& layers);
// Random weights (SPEC section 3's distribution) of every layer in `range` of a named model;
// layer i drawn from seed + i.
absl::StatusOr<ServedModel> RandomModel(const std::string& model, std::uint64_t seed,
                                        const std::string& layers);
// The seed's single layer: one layer with the SPEC layer's settings (full causal, soft-cap 50,
// scaling 1/sqrt(head_dim), RoPE base 10000) served as index `index`.
ServedModel SingleLayerModel(LayerWeights weights, int index);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_WEIGHTS_MODEL_H_
