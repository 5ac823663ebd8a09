// Deterministic random inputs and weights drawn as SPEC section 3 says, for the CLI, the benchmark
// and the tests. Weights come from attngrad::FillRandomLayerWeights (attngrad/spec_random.h), the
// generator behind the server's --weights=random too, so a client with --weights_seed=N holds
// exactly the weights of a server started with --weights=random --weights_seed=N.
#ifndef ATTNGRAD_CLIENT_SRC_RANDOM_TENSORS_H_
#define ATTNGRAD_CLIENT_SRC_RANDOM_TENSORS_H_

#include <cstdint>
#include <vector>

#include "attngrad/backward.h"
#include "attngrad/client.h"

namespace attngrad {

// Projection weights randn * sqrt(2/hidden), norm weights randn * 0.02 (FillRandomLayerWeights).
WeightSet RandomWeights(const LayerConfig& config, uint64_t seed);

// cos/sin [batch, seq_len, head_dim] of positions 0..S-1 (the same for every sequence), rope theta
// `theta`: inv_freq_i = theta^(-2i/head_dim), embedding [f, f], computed in double, rounded to
// fp32.
void RotaryTables(int64_t batch, int64_t seq_len, int64_t head_dim, double theta,
                  std::vector<float>* cos, std::vector<float>* sin);

// The host data of one batch and a BackwardBatch view of it.
struct BatchInputs {
  int64_t batch = 0;
  int64_t seq_len = 0;
  std::vector<float> hidden_states;  // [B,S,hidden]
  std::vector<float> grad_output;    // [B,S,hidden]
  std::vector<float> cos;            // [B,S,head_dim]
  std::vector<float> sin;            // [B,S,head_dim]

  // A batch whose spans point into this object (which must outlive its use).
  BackwardBatch View() const;
};

// SPEC section 3: hidden_states = randn/sqrt(hidden), grad_output = randn, cos/sin of positions
// 0..S-1 with theta 10000. Seed `seed` (a stream of its own, independent of the weights' seeds).
BatchInputs RandomBatchInputs(const LayerConfig& config, int64_t batch, int64_t seq_len,
                              uint64_t seed);

// Rounds `values` in place to what they become on the wire in `dtype` (float16 / bfloat16: the
// nearest representable value; float32: unchanged), through the wire library's own conversion, so
// that a reference computed from them is the reference of what the server receives.
void RoundToWireDType(v1::DType dtype, std::vector<float>* values);

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_SRC_RANDOM_TENSORS_H_
