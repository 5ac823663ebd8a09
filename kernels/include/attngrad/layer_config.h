// The shape of one attention layer (hidden size, head counts, head_dim): what every backend, the
// server and the clients size tensors by.
#ifndef ATTNGRAD_LAYER_CONFIG_H_
#define ATTNGRAD_LAYER_CONFIG_H_

#include "attngrad/attngrad.h"

namespace attngrad {

// Shape of one attention layer. Gemma3_4B() is the configuration of SPEC.md; the published Gemma-3
// models differ in these four numbers (proto/models/gemma3.json). The CPU backend serves any
// configuration; the GPU kernels support head_dim 128 and 256 (every published Gemma-3 model) and
// return ATTNGRAD_UNSUPPORTED otherwise.
struct ATTNGRAD_API LayerConfig {
  int hidden_size = 3072;
  int num_heads = 24;
  int num_kv_heads = 8;
  int head_dim = 128;

  static constexpr LayerConfig Gemma3_4B() { return LayerConfig{}; }
  constexpr int q_out() const { return num_heads * head_dim; }
  constexpr int kv_out() const { return num_kv_heads * head_dim; }
  constexpr int group_size() const { return num_heads / num_kv_heads; }
  // True when the numbers are positive, num_heads is a multiple of num_kv_heads and head_dim is
  // even.
  bool IsValid() const;
};

}  // namespace attngrad

#endif  // ATTNGRAD_LAYER_CONFIG_H_
