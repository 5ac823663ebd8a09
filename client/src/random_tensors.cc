// SPEC section 3 random inputs and weights (the server's generator for the weights).
#include "random_tensors.h"

#include <cmath>

#include "attngrad/spec_random.h"
#include "attngrad/wire/tensor.h"

namespace attngrad {

WeightSet RandomWeights(const LayerConfig& config, uint64_t seed) {
  WeightSet weights;
  PerWeight<float*> data;
  for (Weight weight : kAllWeights) {
    HostTensor& tensor = weights[weight];
    tensor.shape = WeightShape(config, weight);
    tensor.data.resize(static_cast<size_t>(tensor.num_elements()));
    data[weight] = tensor.data.data();
  }
  FillRandomLayerWeights(config, seed, data);
  return weights;
}

void RotaryTables(int64_t batch, int64_t seq_len, int64_t head_dim, double theta,
                  std::vector<float>* cos, std::vector<float>* sin) {
  const int64_t half = head_dim / 2;
  cos->resize(static_cast<size_t>(batch * seq_len * head_dim));
  sin->resize(cos->size());
  for (int64_t s = 0; s < seq_len; ++s) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(s) * std::pow(theta, -2.0 * i / head_dim);
      const float c = static_cast<float>(std::cos(angle));
      const float n = static_cast<float>(std::sin(angle));
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t row = (b * seq_len + s) * head_dim;
        (*cos)[row + i] = (*cos)[row + i + half] = c;
        (*sin)[row + i] = (*sin)[row + i + half] = n;
      }
    }
  }
}

BackwardBatch BatchInputs::View() const {
  BackwardBatch view;
  view.batch = batch;
  view.seq_len = seq_len;
  view.hidden_states = hidden_states;
  view.grad_output = grad_output;
  view.cos = cos;
  view.sin = sin;
  return view;
}

BatchInputs RandomBatchInputs(const LayerConfig& config, int64_t batch, int64_t seq_len,
                              uint64_t seed) {
  // A seed space apart from the weights' (weights use the seed as it is).
  SpecNormalGenerator normal(seed ^ 0x5eed1234abcdef01ull);
  BatchInputs inputs;
  inputs.batch = batch;
  inputs.seq_len = seq_len;
  const size_t activations = static_cast<size_t>(batch * seq_len * config.hidden_size);
  inputs.hidden_states.resize(activations);
  inputs.grad_output.resize(activations);
  normal.Fill(inputs.hidden_states.data(), activations,
              1.0 / std::sqrt(static_cast<double>(config.hidden_size)));
  normal.Fill(inputs.grad_output.data(), activations, 1.0);
  RotaryTables(batch, seq_len, config.head_dim, 10000.0, &inputs.cos, &inputs.sin);
  return inputs;
}

void RoundToWireDType(v1::DType dtype, std::vector<float>* values) {
  if (dtype == v1::DTYPE_FLOAT32 || dtype == v1::DTYPE_UNSPECIFIED) return;
  std::string raw;
  wire::EncodeFromFloat(*values, dtype, &raw);
  // Decoding what was just encoded in a supported dtype cannot fail.
  wire::DecodeToFloat(raw, dtype, "rounded input", absl::MakeSpan(*values)).IgnoreError();
}

}  // namespace attngrad
