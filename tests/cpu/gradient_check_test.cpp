// Gradient check: analytic gradients against central finite differences (float64, Richardson-
// extrapolated) of L = sum(grad_output ⊙ layer_output), layer_output = A Woᵀ, for a sample of
// elements of each of the 7 gradients. The float64 loops (reference.cpp) must agree tightly; the
// fp32 CPU backend within 1e-3 relative.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/backward.h"
#include "problem.h"
#include "reference.h"

namespace attngrad_test {
namespace {

using attngrad::LayerConfig;
using attngrad::Scalars;

// The input whose gradient output `gradient_index` is (SPEC order of the outputs).
std::vector<double>& InputOf(Inputs64& in, int gradient_index) {
  if (gradient_index < kFirstWeightGradient) return in.hidden_states;
  return in.weights[attngrad::kAllWeights[gradient_index - kFirstWeightGradient]];
}

double Rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s / static_cast<double>(v.size()));
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// dL/d(input[element]) by central differences with steps h and h/2, Richardson-combined (O(h^4)).
double FiniteDifference(Inputs64& in, int gradient_index, std::size_t element, double h) {
  std::vector<double>& x = InputOf(in, gradient_index);
  const double saved = x[element];
  auto central = [&](double step) {
    x[element] = saved + step;
    const double plus = ReferenceLoss(in);
    x[element] = saved - step;
    const double minus = ReferenceLoss(in);
    x[element] = saved;
    return (plus - minus) / (2 * step);
  };
  const double coarse = central(h);
  const double fine = central(h / 2);
  return (4 * fine - coarse) / 3;
}

struct FdCase {
  std::string name;
  LayerConfig config;
  int batch;
  int seq_len;
  Scalars scalars;
  double norm_weight_std;
};

Scalars MakeScalars(float scaling, float softcap, float eps) {
  Scalars s;
  s.scaling = scaling;
  s.softcap = softcap;
  s.eps = eps;
  return s;
}

class GradientCheckTest : public ::testing::TestWithParam<FdCase> {};

TEST_P(GradientCheckTest, AnalyticMatchesFiniteDifferences) {
  const FdCase& c = GetParam();
  ProblemOptions options;
  options.norm_weight_std = c.norm_weight_std;
  const Problem problem = MakeProblem(c.config, c.batch, c.seq_len, c.scalars, 90210, options);
  Inputs64 in = problem.Widened();
  const Gradients<double> analytic = ReferenceBackward(in);
  Gradients<float> backend =
      MakeOutputBuffers(c.config, c.batch, c.seq_len, std::numeric_limits<float>::quiet_NaN());
  ASSERT_EQ(RunHost(problem, false, backend), ATTNGRAD_OK);

  std::mt19937_64 rng(12345);
  constexpr std::size_t kSamples = 16;
  for (int g = 0; g < kNumGradients; ++g) {
    const char* name = kGradientNames[static_cast<std::size_t>(g)];
    const std::vector<double>& a = analytic[g];
    const double scale = MaxAbs(a);
    ASSERT_GT(scale, 0.0) << name << " is all zeros: the check could not fail";
    // Sample elements: all of them when few, else random ones plus the largest.
    std::set<std::size_t> elements;
    if (a.size() <= kSamples) {
      for (std::size_t e = 0; e < a.size(); ++e) elements.insert(e);
    } else {
      std::uniform_int_distribution<std::size_t> pick(0, a.size() - 1);
      while (elements.size() < kSamples - 1) elements.insert(pick(rng));
      elements.insert(static_cast<std::size_t>(
          std::max_element(a.begin(), a.end(),
                           [](double x, double y) { return std::fabs(x) < std::fabs(y); }) -
          a.begin()));
    }
    const double h = 1e-3 * std::max(Rms(InputOf(in, g)), 1e-2);
    for (std::size_t e : elements) {
      const double fd = FiniteDifference(in, g, e, h);
      EXPECT_NEAR(a[e], fd, 1e-7 * scale + 1e-6 * std::fabs(fd))
          << c.name << ": float64 loops, " << name << "[" << e << "]";
      EXPECT_NEAR(static_cast<double>(backend[g][e]), fd, 1e-4 * scale + 1e-3 * std::fabs(fd))
          << c.name << ": CPU backend, " << name << "[" << e << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, GradientCheckTest,
    ::testing::Values(
        // Group 2, the soft-cap biting, a large eps and large norm weights.
        FdCase{"Group2_Capped", LayerConfig{12, 4, 2, 6}, 2, 4, MakeScalars(0.9f, 2.0f, 1e-2f),
               0.3},
        // Group 3 like the 4B model, benchmark-like scalars.
        FdCase{"Group3_Benchmark", LayerConfig{16, 3, 1, 8}, 1, 5,
               MakeScalars(0.35355339f, 50.0f, 1e-6f), 0.02},
        // Group 1.
        FdCase{"Group1", LayerConfig{8, 2, 2, 4}, 2, 3, MakeScalars(0.5f, 10.0f, 1e-5f), 0.1}),
    [](const ::testing::TestParamInfo<FdCase>& info) { return info.param.name; });

}  // namespace
}  // namespace attngrad_test
