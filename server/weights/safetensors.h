// Reading safetensors files (https://github.com/huggingface/safetensors: an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw data) and loading
// one Gemma-3 attention layer from them.
#ifndef ATTNGRAD_SERVER_SAFETENSORS_H_
#define ATTNGRAD_SERVER_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weights/layer_weights.h"

namespace attngrad::server {

struct SafetensorsEntry {
  std::string dtype;  // "F32", "F16", "BF16", ... as written in the header
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte offsets relative to the start of the data section
  std::uint64_t end = 0;
};

struct SafetensorsHeader {
  std::string path;
  std::uint64_t data_start = 0;  // 8 + header length
  std::uint64_t file_size = 0;
  std::map<std::string, SafetensorsEntry> tensors;
};

// Reads and checks the header (offsets inside the file, byte counts matching dtype and shape for
// the dtypes this reader knows).
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path);

// Reads one tensor as fp32 (F32, F16 and BF16 are supported).
absl::StatusOr<std::vector<float>> ReadSafetensorsTensor(const SafetensorsHeader& header,
                                                         const std::string& name);

// Loads the attention weights of decoder layer `layer` from a .safetensors file or from a sharded
// checkpoint's index (a .json file with a "weight_map"). Tensor names follow Hugging Face Gemma-3:
// model.layers.{layer}.self_attn.{q,k,v,o}_proj.weight and ...{q,k}_norm.weight, optionally behind
// a prefix (language_model.model.layers..., model.language_model.layers...). The layer
// configuration is read from the shapes (head_dim from q_norm; heads from the projections).
absl::StatusOr<LayerWeights> LoadSafetensorsLayer(const std::string& path, int layer);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_SAFETENSORS_H_
