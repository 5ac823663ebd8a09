// config.json parsing (nlohmann::json without exceptions), layer ranges, and the three ways a
// served model is built.
#include "weights/model.h"

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attngrad/common/json_object.h"
#include "attngrad/common/read_file.h"
#include "attngrad/common/status_macros.h"
#include "weights/checkpoint_layer.h"
#include "weights/gemma3_models.h"

namespace attngrad::server {
namespace {

using Json = nlohmann::json;

// A positive integer field (required).
absl::StatusOr<int> PositiveInt(const Json& object, const char* key, absl::string_view where) {
  auto found = object.find(key);
  if (found == object.end() || !found->is_number_integer() || found->get<long long>() <= 0 ||
      found->get<long long>() > (1 << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" must be a positive integer"));
  }
  return static_cast<int>(found->get<long long>());
}

// An optional number field: `fallback` when missing; null gives `null_value`.
absl::StatusOr<double> Number(const Json& object, const char* key, double fallback,
                              double null_value, absl::string_view where) {
  auto found = object.find(key);
  if (found == object.end()) return fallback;
  if (found->is_null()) return null_value;
  if (!found->is_number() || !std::isfinite(found->get<double>())) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be a number"));
  }
  return found->get<double>();
}

absl::StatusOr<ModelConfig> ConfigFromJson(const Json& root, absl::string_view where) {
  const Json& text =
      root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
  ModelConfig config;
  if (text.contains("model_type") && text["model_type"].is_string()) {
    config.name = text["model_type"].get<std::string>();
  }
  ATTNGRAD_ASSIGN_OR_RETURN(config.layer.hidden_size, PositiveInt(text, "hidden_size", where));
  ATTNGRAD_ASSIGN_OR_RETURN(config.layer.num_heads,
                            PositiveInt(text, "num_attention_heads", where));
  ATTNGRAD_ASSIGN_OR_RETURN(config.layer.num_kv_heads,
                            PositiveInt(text, "num_key_value_heads", where));
  ATTNGRAD_ASSIGN_OR_RETURN(config.layer.head_dim, PositiveInt(text, "head_dim", where));
  ATTNGRAD_ASSIGN_OR_RETURN(config.num_hidden_layers,
                            PositiveInt(text, "num_hidden_layers", where));
  if (!config.layer.IsValid()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": invalid attention shape (heads ", config.layer.num_heads, " / kv heads ",
        config.layer.num_kv_heads, ", head_dim ", config.layer.head_dim, ")"));
  }
  // Defaults as transformers' Gemma3TextConfig has them.
  ATTNGRAD_ASSIGN_OR_RETURN(config.query_pre_attn_scalar,
                            Number(text, "query_pre_attn_scalar", 256, 256, where));
  if (!(config.query_pre_attn_scalar > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": query_pre_attn_scalar must be > 0"));
  }
  ATTNGRAD_ASSIGN_OR_RETURN(const double softcap,
                            Number(text, "attn_logit_softcapping", 0, 0, where));
  config.softcap = static_cast<float>(softcap);
  ATTNGRAD_ASSIGN_OR_RETURN(const double window, Number(text, "sliding_window", 4096, 0, where));
  if (window < 0 || window > (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": sliding_window must be >= 0"));
  }
  config.sliding_window = static_cast<int>(window);
  const char* pattern_key = text.contains("sliding_window_pattern") ? "sliding_window_pattern"
                                                                    : "_sliding_window_pattern";
  ATTNGRAD_ASSIGN_OR_RETURN(const double pattern, Number(text, pattern_key, 6, 1, where));
  config.sliding_window_pattern = pattern >= 1 ? static_cast<int>(pattern) : 1;
  if (text.contains("layer_types") && text["layer_types"].is_array()) {
    for (const Json& type : text["layer_types"]) {
      if (!type.is_string() || (type.get<std::string>() != "sliding_attention" &&
                                type.get<std::string>() != "full_attention")) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": layer_types holds ", type.dump(),
                         "; expected \"sliding_attention\" or \"full_attention\""));
      }
      config.layer_types.push_back(type.get<std::string>());
    }
    if (static_cast<int>(config.layer_types.size()) != config.num_hidden_layers) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": layer_types has ",
                                                     config.layer_types.size(), " entries for ",
                                                     config.num_hidden_layers, " layers"));
    }
  }
  ATTNGRAD_ASSIGN_OR_RETURN(const double eps, Number(text, "rms_norm_eps", 1e-6, 1e-6, where));
  config.eps = static_cast<float>(eps);
  ATTNGRAD_ASSIGN_OR_RETURN(config.rope_theta, Number(text, "rope_theta", 1e6, 1e6, where));
  ATTNGRAD_ASSIGN_OR_RETURN(config.rope_local_base_freq,
                            Number(text, "rope_local_base_freq", 1e4, 1e4, where));
  if (!(config.rope_theta > 0) || !(config.rope_local_base_freq > 0) || !(config.eps > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": rope_theta, rope_local_base_freq and rms_norm_eps must be > 0"));
  }
  if (text.contains("rope_scaling") && text["rope_scaling"].is_object()) {
    const Json& scaling = text["rope_scaling"];
    const std::string type = scaling.value("rope_type", scaling.value("type", std::string()));
    if (type != "linear" && type != "default") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": rope_scaling type \"", type, "\" is not supported (linear only)"));
    }
    ATTNGRAD_ASSIGN_OR_RETURN(config.rope_scaling_factor, Number(scaling, "factor", 1, 1, where));
    if (!(config.rope_scaling_factor > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": rope_scaling.factor must be > 0"));
    }
  }
  return config;
}

}  // namespace

LayerSettings ModelConfig::Layer(int index) const {
  LayerSettings settings;
  settings.index = index;
  const bool full = !layer_types.empty() && index < static_cast<int>(layer_types.size())
                        ? layer_types[static_cast<std::size_t>(index)] == "full_attention"
                        : (index + 1) % sliding_window_pattern == 0;
  settings.type = full || sliding_window <= 0 ? AttentionType::kFull : AttentionType::kSliding;
  settings.scalars.scaling = static_cast<float>(1.0 / std::sqrt(query_pre_attn_scalar));
  settings.scalars.softcap = softcap > 0 ? softcap : 0.f;
  settings.scalars.eps = eps;
  if (settings.type == AttentionType::kFull) {
    settings.scalars.sliding_window = 0;
    settings.rope_theta = rope_theta;
    settings.rope_scaling_factor = rope_scaling_factor;
  } else {
    settings.scalars.sliding_window = sliding_window;
    settings.rope_theta = rope_local_base_freq;
    settings.rope_scaling_factor = 1.0;
  }
  return settings;
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json, absl::string_view where) {
  ATTNGRAD_ASSIGN_OR_RETURN(const Json root, common::ParseJsonObject(json, where));
  return ConfigFromJson(root, where);
}

std::vector<std::string> NamedModels() {
  std::vector<std::string> names;
  const Json root = Json::parse(kGemma3ModelsJson, nullptr, /*allow_exceptions=*/false);
  if (!root.is_object() || !root.contains("models")) return names;
  for (const auto& [name, value] : root["models"].items()) names.push_back(name);
  return names;
}

absl::StatusOr<ModelConfig> NamedModelConfig(const std::string& name) {
  const Json root = Json::parse(kGemma3ModelsJson, nullptr, /*allow_exceptions=*/false);
  if (!root.is_object() || !root.contains("models") || !root["models"].contains(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model: unknown model \"", name, "\"; known: ", absl::StrJoin(NamedModels(), ", ")));
  }
  ATTNGRAD_ASSIGN_OR_RETURN(ModelConfig config,
                            ConfigFromJson(root["models"][name], absl::StrCat("model ", name)));
  config.name = name;
  return config;
}

absl::StatusOr<wire::LayerRange> ParseLayerRange(const std::string& text, int num_layers) {
  if (text.empty()) return wire::LayerRange{0, num_layers - 1, ""};
  const absl::StatusOr<wire::LayerRange> range = wire::ParseLayerSpan(text);
  if (!range.ok() || range->last >= num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers: \"", text, "\" is not a layer range A-B (or A) within 0-", num_layers - 1));
  }
  return range;
}

absl::StatusOr<ServedModel> LoadModelDirectory(const std::string& directory,
                                               const std::string& layers) {
  const std::string config_path = (std::filesystem::path(directory) / "config.json").string();
  ATTNGRAD_ASSIGN_OR_RETURN(const std::string text, common::ReadFileToString(config_path));
  ATTNGRAD_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, config_path));
  ATTNGRAD_ASSIGN_OR_RETURN(const wire::LayerRange range,
                            ParseLayerRange(layers, config.num_hidden_layers));
  ATTNGRAD_ASSIGN_OR_RETURN(const wire::SafetensorsCheckpoint checkpoint,
                            wire::SafetensorsCheckpoint::Open(directory));
  ServedModel model;
  model.name = config.name;
  model.num_hidden_layers = config.num_hidden_layers;
  for (int index = range.first; index <= range.last; ++index) {
    ATTNGRAD_ASSIGN_OR_RETURN(LayerWeights weights, LoadCheckpointLayer(checkpoint, index));
    const LayerConfig& found = weights.config;
    const LayerConfig& expected = config.layer;
    if (found.hidden_size != expected.hidden_size || found.num_heads != expected.num_heads ||
        found.num_kv_heads != expected.num_kv_heads || found.head_dim != expected.head_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(directory, ": layer ", index, "'s weights have hidden ", found.hidden_size,
                       ", heads ", found.num_heads, "/", found.num_kv_heads, ", head_dim ",
                       found.head_dim, " but config.json says ", expected.hidden_size, ", ",
                       expected.num_heads, "/", expected.num_kv_heads, ", ", expected.head_dim));
    }
    weights.source = absl::StrCat("safetensors:", directory, "#layer=", index);
    model.layers.push_back(
        ServedLayer{config.Layer(index), std::make_shared<const LayerWeights>(std::move(weights))});
  }
  return model;
}

absl::StatusOr<ServedModel> RandomModel(const std::string& name, std::uint64_t seed,
                                        const std::string& layers) {
  ATTNGRAD_ASSIGN_OR_RETURN(const ModelConfig config, NamedModelConfig(name));
  ATTNGRAD_ASSIGN_OR_RETURN(const wire::LayerRange range,
                            ParseLayerRange(layers, config.num_hidden_layers));
  ServedModel model;
  model.name = name;
  model.num_hidden_layers = config.num_hidden_layers;
  for (int index = range.first; index <= range.last; ++index) {
    LayerWeights weights =
        RandomLayerWeights(config.layer, seed + static_cast<std::uint64_t>(index));
    weights.source = absl::StrCat("random:model=", name, ",seed=", seed + index, "#layer=", index);
    model.layers.push_back(
        ServedLayer{config.Layer(index), std::make_shared<const LayerWeights>(std::move(weights))});
  }
  return model;
}

ServedModel SingleLayerModel(LayerWeights weights, int index) {
  ServedModel model;
  model.num_hidden_layers = index + 1;
  LayerSettings settings;
  settings.index = index;
  settings.scalars.scaling = 1.0f / std::sqrt(static_cast<float>(weights.config.head_dim));
  model.layers.push_back(
      ServedLayer{settings, std::make_shared<const LayerWeights>(std::move(weights))});
  return model;
}

}  // namespace attngrad::server
