// Random numbers drawn the way SPEC section 3 says, reproducible from a seed on every platform (up
// to the C library's log/sin/cos): the one generator behind the server's --weights=random, the
// CLI's inputs and weights, and anything else that must reproduce them.
#ifndef ATTNGRAD_SPEC_RANDOM_H_
#define ATTNGRAD_SPEC_RANDOM_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>

#include "attngrad/backward.h"

namespace attngrad {

// Standard normal deviates: std::mt19937_64(seed); Box-Muller pairs r*cos(2 pi u2), r*sin(2 pi u2)
// with r = sqrt(-2 ln(1 - u1)) from two consecutive 53-bit uniforms u = (draw >> 11) * 2^-53, in
// double; both deviates of a pair are used, the cosine one first.
class SpecNormalGenerator {
 public:
  explicit SpecNormalGenerator(std::uint64_t seed) : engine_(seed) {}

  double Next() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    const double u1 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(1.0 - u1));
    spare_ = radius * std::sin(kTwoPi * u2);
    have_spare_ = true;
    return radius * std::cos(kTwoPi * u2);
  }

  // out[i] = Next() * scale, rounded to fp32, for i in [0, count).
  void Fill(float* out, std::size_t count, double scale) {
    for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<float>(Next() * scale);
  }

 private:
  std::mt19937_64 engine_;
  bool have_spare_ = false;
  double spare_ = 0.0;  // the sine deviate of the last pair
};

// The six weights of a layer as SPEC section 3 draws them: each projection randn * sqrt(2 /
// hidden), the norm weights randn * 0.02, from one SpecNormalGenerator(seed) filling q, k, v, o,
// q_norm, k_norm in that order, each row-major. Each pointer holds WeightElements(config, w)
// elements.
inline void FillRandomLayerWeights(const LayerConfig& config, std::uint64_t seed,
                                   const PerWeight<float*>& weights) {
  SpecNormalGenerator normal(seed);
  const double projection_scale = std::sqrt(2.0 / config.hidden_size);
  for (Weight weight : kAllWeights) {
    const bool is_norm = weight == Weight::kQNorm || weight == Weight::kKNorm;
    normal.Fill(weights[weight], WeightElements(config, weight), is_norm ? 0.02 : projection_scale);
  }
}

}  // namespace attngrad

#endif  // ATTNGRAD_SPEC_RANDOM_H_
