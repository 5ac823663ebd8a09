// The six weights of one attention layer as one indexed type: which they are (attngrad::Weight, in
// SPEC section 1's order, which is also attngrad.v1.WeightName's order minus one), their Hugging
// Face module names and shapes for a LayerConfig, and PerWeight<T>, six values of any type indexed
// by Weight (pointers for the backward call, host arrays for a server's master copy, tensors for a
// client). Everything that wires six weights, names them or sizes them goes through this header.
#ifndef ATTNGRAD_LAYER_WEIGHTS_H_
#define ATTNGRAD_LAYER_WEIGHTS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attngrad/layer_config.h"

namespace attngrad {

enum class Weight : int { kQProj = 0, kKProj, kVProj, kOProj, kQNorm, kKNorm };
inline constexpr int kNumWeights = 6;
inline constexpr std::array<Weight, kNumWeights> kAllWeights = {
    Weight::kQProj, Weight::kKProj, Weight::kVProj, Weight::kOProj, Weight::kQNorm, Weight::kKNorm};

constexpr int IndexOf(Weight weight) { return static_cast<int>(weight); }

// "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm": the Hugging Face module names.
constexpr const char* WeightModuleName(Weight weight) {
  constexpr const char* kNames[kNumWeights] = {"q_proj", "k_proj", "v_proj",
                                               "o_proj", "q_norm", "k_norm"};
  return kNames[IndexOf(weight)];
}

// The shape of a weight for `config`: q_proj [q_out, hidden], k_proj and v_proj [kv_out, hidden],
// o_proj [hidden, q_out], q_norm and k_norm [head_dim].
inline std::vector<std::int64_t> WeightShape(const LayerConfig& config, Weight weight) {
  switch (weight) {
    case Weight::kQProj: return {config.q_out(), config.hidden_size};
    case Weight::kKProj:
    case Weight::kVProj: return {config.kv_out(), config.hidden_size};
    case Weight::kOProj: return {config.hidden_size, config.q_out()};
    case Weight::kQNorm:
    case Weight::kKNorm: break;
  }
  return {config.head_dim};
}

// The element count of WeightShape(config, weight).
inline std::size_t WeightElements(const LayerConfig& config, Weight weight) {
  std::size_t count = 1;
  for (std::int64_t dimension : WeightShape(config, weight)) {
    count *= static_cast<std::size_t>(dimension);
  }
  return count;
}

// Six values of type T, one per weight, indexed by Weight; iterates in SPEC order.
template <typename T>
struct PerWeight {
  std::array<T, kNumWeights> items{};

  T& operator[](Weight weight) { return items[static_cast<std::size_t>(weight)]; }
  const T& operator[](Weight weight) const { return items[static_cast<std::size_t>(weight)]; }
  auto begin() { return items.begin(); }
  auto end() { return items.end(); }
  auto begin() const { return items.begin(); }
  auto end() const { return items.end(); }
};

// The data pointers of six arrays (std::vector or anything with data()).
template <typename Array>
auto DataOf(PerWeight<Array>& arrays) {
  PerWeight<decltype(arrays.items[0].data())> pointers;
  for (Weight weight : kAllWeights) pointers[weight] = arrays[weight].data();
  return pointers;
}
template <typename Array>
auto DataOf(const PerWeight<Array>& arrays) {
  PerWeight<decltype(arrays.items[0].data())> pointers;
  for (Weight weight : kAllWeights) pointers[weight] = arrays[weight].data();
  return pointers;
}

// The six weights packed one after another, in SPEC order, in one allocation of total_elements.
struct PackedWeightLayout {
  PerWeight<std::size_t> offsets;  // in elements
  std::size_t total_elements = 0;

  explicit PackedWeightLayout(const LayerConfig& config) {
    for (Weight weight : kAllWeights) {
      offsets[weight] = total_elements;
      total_elements += WeightElements(config, weight);
    }
  }
  // The six pointers into an allocation that starts at `base`.
  template <typename T>
  PerWeight<T*> Pointers(T* base) const {
    PerWeight<T*> pointers;
    for (Weight weight : kAllWeights) pointers[weight] = base + offsets[weight];
    return pointers;
  }
};

// Six arrays sized WeightElements(config, w) and value-initialised (zeros).
template <typename Array>
PerWeight<Array> ZeroWeights(const LayerConfig& config) {
  PerWeight<Array> arrays;
  for (Weight weight : kAllWeights) arrays[weight].resize(WeightElements(config, weight));
  return arrays;
}

}  // namespace attngrad

#endif  // ATTNGRAD_LAYER_WEIGHTS_H_
