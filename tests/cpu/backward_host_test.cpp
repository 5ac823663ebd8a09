// attngrad::BackwardHost (the CPU reference backend) against the float64 loops of reference.cpp:
// small configurations of several group sizes, odd S (1, 7, 541), B > 1 with cos/sin that differ
// per sequence, non-default scalars with a soft-cap that bites, the real Gemma-3 4B configuration
// at small S, accumulate, thread-count independence, untouched inputs and invalid configurations.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
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

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct SmallCase {
  std::string name;
  LayerConfig config;
  int batch;
  int seq_len;
  Scalars scalars;
  ProblemOptions options;
  // The case is only meaningful when max |s| (step 4, before the cap) exceeds this: softcap for the
  // cases where the cap must bite, a few hundred where softmax must be computed stably.
  double min_max_abs_score;
};

std::vector<SmallCase> SmallCases() {
  const LayerConfig small = LayerConfig{64, 6, 2, 16};  // group 3, like the 4B model
  Scalars capped;  // non-default scalars: the cap bites, eps shows
  capped.scaling = 1.0f;
  capped.softcap = 5.0f;
  capped.eps = 1e-2f;
  ProblemOptions big_norm_weights;
  big_norm_weights.norm_weight_std = 0.5;
  ProblemOptions same_positions;
  same_positions.distinct_positions = false;
  ProblemOptions padding_token;  // token 9 = (b 1, s 2) of a B 2, S 7 batch is all zeros
  padding_token.zero_token = 9;
  // Gemma-3 as published: no soft-capping (softcap 0), local layers with a sliding window.
  Scalars uncapped = DefaultScalarsFor(16);
  uncapped.softcap = 0.0f;
  Scalars window4 = uncapped;
  window4.sliding_window = 4;
  Scalars window1 = uncapped;  // each query sees only its own key
  window1.sliding_window = 1;
  Scalars capped_window = capped;
  capped_window.sliding_window = 5;
  Scalars wide_window = uncapped;  // wider than the sequence: the same as no window
  wide_window.sliding_window = 64;
  Scalars head_dim_256 = uncapped;
  head_dim_256.scaling = 1.0f / 16.0f;
  head_dim_256.sliding_window = 3;
  Scalars sharp;  // scores of several hundred, cap far away: softmax must be stable
  sharp.scaling = 60.0f;
  sharp.softcap = 1e4f;
  return {
      {"Group3_B1_S1", small, 1, 1, DefaultScalarsFor(16), {}, 0},
      {"Group3_B1_S7", small, 1, 7, DefaultScalarsFor(16), {}, 0},
      {"Group3_B2_S7", small, 2, 7, DefaultScalarsFor(16), {}, 0},
      {"Group3_B3_S33", small, 3, 33, DefaultScalarsFor(16), {}, 0},
      {"Group3_B2_S16_SamePositions", small, 2, 16, DefaultScalarsFor(16), same_positions, 0},
      {"Group3_B1_S541", small, 1, 541, DefaultScalarsFor(16), {}, 0},
      {"Group1_B2_S9", LayerConfig{32, 4, 4, 8}, 2, 9, DefaultScalarsFor(8), {}, 0},
      {"Group4_B2_S10", LayerConfig{48, 8, 2, 12}, 2, 10, DefaultScalarsFor(12), {}, 0},
      {"Group6_OneKvHead_B1_S5", LayerConfig{64, 6, 1, 16}, 1, 5, DefaultScalarsFor(16), {}, 0},
      {"HiddenNotQOut_B2_S6", LayerConfig{40, 4, 2, 16}, 2, 6, DefaultScalarsFor(16), {}, 0},
      {"SoftcapBites_B2_S13", small, 2, 13, capped, big_norm_weights, 5.0},
      {"SoftcapBites_Group4_B3_S8", LayerConfig{48, 8, 2, 12}, 3, 8, capped, big_norm_weights, 5.0},
      {"Group3_B4_S1", small, 4, 1, DefaultScalarsFor(16), {}, 0},
      {"PaddingTokenOfZeros_B2_S7", small, 2, 7, DefaultScalarsFor(16), padding_token, 0},
      {"LargeScores_B2_S9", small, 2, 9, sharp, {}, 300.0},
      {"NoSoftcap_B2_S13", small, 2, 13, uncapped, {}, 0},
      {"SlidingWindow4_B2_S13", small, 2, 13, window4, {}, 0},
      {"SlidingWindow1_B2_S6", small, 2, 6, window1, {}, 0},
      {"SlidingWindow5Capped_B3_S17", small, 3, 17, capped_window, big_norm_weights, 5.0},
      {"SlidingWindowWiderThanSequence_B2_S9", small, 2, 9, wide_window, {}, 0},
      {"HeadDim256_Window3_B2_S7", LayerConfig{64, 2, 1, 256}, 2, 7, head_dim_256, {}, 0},
  };
}

class SmallConfigTest : public ::testing::TestWithParam<SmallCase> {};

TEST_P(SmallConfigTest, MatchesFloat64Loops) {
  const SmallCase& c = GetParam();
  const Problem problem =
      MakeProblem(c.config, c.batch, c.seq_len, c.scalars, SeedOf(c.name), c.options);
  const Inputs64 wide = problem.Widened();
  const double max_abs_score = ReferenceMaxAbsScore(wide);
  if (c.min_max_abs_score > 0) {
    ASSERT_GT(max_abs_score, c.min_max_abs_score) << "this draw does not test what the case is for";
  }
  Gradients<float> got = MakeOutputBuffers(c.config, c.batch, c.seq_len, kNaN);
  ASSERT_EQ(RunHost(problem, /*accumulate=*/false, got), ATTNGRAD_OK);
  const Gradients<double> ref = ReferenceBackward(wide);
  EXPECT_TRUE(AllMatch(c.name + " (" + Describe(c.config, c.batch, c.seq_len, c.scalars) + ")", got,
                       ref, ConditionedTolerance(max_abs_score)));
}

INSTANTIATE_TEST_SUITE_P(CpuBackend, SmallConfigTest, ::testing::ValuesIn(SmallCases()),
                         [](const ::testing::TestParamInfo<SmallCase>& info) {
                           return info.param.name;
                         });

// The real configuration of SPEC section 1 at a few tokens (float64 loops over 3072 are fine here).
struct Gemma4BCase {
  int batch;
  int seq_len;
};

class Gemma4BTest : public ::testing::TestWithParam<Gemma4BCase> {};

TEST_P(Gemma4BTest, MatchesFloat64Loops) {
  const Gemma4BCase c = GetParam();
  const LayerConfig config = LayerConfig::Gemma3_4B();
  const Problem problem = MakeProblem(config, c.batch, c.seq_len, Scalars(),
                                      /*seed=*/1000 + 17 * c.batch + c.seq_len);
  Gradients<float> got = MakeOutputBuffers(config, c.batch, c.seq_len, kNaN);
  ASSERT_EQ(RunHost(problem, /*accumulate=*/false, got), ATTNGRAD_OK);
  const Gradients<double> ref = ReferenceBackward(problem.Widened());
  EXPECT_TRUE(AllMatch("Gemma3_4B (" + Describe(config, c.batch, c.seq_len, problem.scalars) + ")",
                       got, ref, Tolerance()));
}

INSTANTIATE_TEST_SUITE_P(CpuBackend, Gemma4BTest,
                         ::testing::Values(Gemma4BCase{1, 1}, Gemma4BCase{1, 8}, Gemma4BCase{2, 3},
                                           Gemma4BCase{2, 8}),
                         [](const ::testing::TestParamInfo<Gemma4BCase>& info) {
                           return "B" + std::to_string(info.param.batch) + "_S" +
                                  std::to_string(info.param.seq_len);
                         });

// cos/sin differ per sequence: the backend must use each sequence's own tables. The check is not
// vacuous: the reference with sequence 0's tables broadcast over the batch is detectably different.
TEST(CpuBackendRope, UsesEachSequencesOwnCosSin) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  const int batch = 3, seq_len = 12;
  const Problem problem = MakeProblem(config, batch, seq_len, DefaultScalarsFor(16), 82);
  Gradients<float> got = MakeOutputBuffers(config, batch, seq_len, kNaN);
  ASSERT_EQ(RunHost(problem, false, got), ATTNGRAD_OK);
  const Inputs64 own = problem.Widened();
  EXPECT_TRUE(AllMatch("own cos/sin", got, ReferenceBackward(own), Tolerance()));
  Inputs64 shared = own;
  const std::size_t per_sequence = static_cast<std::size_t>(seq_len) * config.head_dim;
  for (int b = 1; b < batch; ++b)
    for (std::size_t e = 0; e < per_sequence; ++e) {
      shared.cos[b * per_sequence + e] = own.cos[e];
      shared.sin[b * per_sequence + e] = own.sin[e];
    }
  EXPECT_FALSE(
      AllMatch("sequence 0's cos/sin for all", got, ReferenceBackward(shared), Tolerance()))
      << "the draw does not tell per-sequence cos/sin from shared ones";
}

// |x| * 2^-23: one unit in the last place of an fp32 number of magnitude |x| (upper bound).
double Ulp(double x) { return std::ldexp(std::fabs(x), -23); }

// accumulate: the six weight gradients are G + fresh result (up to the rounding of the additions,
// a few fp32 ulps of |G| + |fresh|), and grad_hidden_states is overwritten (here: it held NaN).
TEST(CpuBackendAccumulate, AddsToWeightGradientsAndOverwritesGradHiddenStates) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  const int batch = 2, seq_len = 11;
  const Problem problem = MakeProblem(config, batch, seq_len, DefaultScalarsFor(16), 77);
  Gradients<float> fresh = MakeOutputBuffers(config, batch, seq_len, kNaN);
  ASSERT_EQ(RunHost(problem, false, fresh), ATTNGRAD_OK);

  // G: random, on the scale of each fresh gradient, so that the sum is a real test.
  Gradients<float> start = MakeOutputBuffers(config, batch, seq_len, 0.0f);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal;
  for (int i = 1; i < kNumGradients; ++i) {
    double max_abs = 0;
    for (float v : fresh[i]) max_abs = std::max(max_abs, std::fabs(static_cast<double>(v)));
    for (float& v : start[i]) v = static_cast<float>(normal(rng) * max_abs);
  }
  Gradients<float> accumulated = start;
  accumulated[0].assign(accumulated[0].size(), kNaN);
  ASSERT_EQ(RunHost(problem, true, accumulated), ATTNGRAD_OK);

  for (std::size_t e = 0; e < fresh[0].size(); ++e) {
    ASSERT_TRUE(std::isfinite(accumulated[0][e]))
        << "grad_hidden_states[" << e << "] not overwritten";
    ASSERT_NEAR(accumulated[0][e], fresh[0][e], 4 * Ulp(fresh[0][e]))
        << "grad_hidden_states[" << e << "] with accumulate differs from the fresh result";
  }
  for (int i = 1; i < kNumGradients; ++i) {
    int misses = 0;
    for (std::size_t e = 0; e < fresh[i].size(); ++e) {
      const double g = start[i][e], r = fresh[i][e], a = accumulated[i][e];
      const double allowed = 4 * (Ulp(g) + Ulp(r) + Ulp(g + r));
      if (!(std::fabs(a - (g + r)) <= allowed)) {
        if (++misses <= 3) {
          ADD_FAILURE() << kGradientNames[static_cast<std::size_t>(i)] << "[" << e
                        << "]: accumulate gave " << a << ", G + fresh = " << g + r << " (G " << g
                        << ", fresh " << r << ")";
        }
      }
    }
    EXPECT_EQ(misses, 0) << kGradientNames[static_cast<std::size_t>(i)];
  }

  // Accumulating twice from zero is twice the fresh result (exactly representable doubling).
  Gradients<float> twice = MakeOutputBuffers(config, batch, seq_len, 0.0f);
  ASSERT_EQ(RunHost(problem, true, twice), ATTNGRAD_OK);
  ASSERT_EQ(RunHost(problem, true, twice), ATTNGRAD_OK);
  for (int i = 1; i < kNumGradients; ++i)
    for (std::size_t e = 0; e < fresh[i].size(); ++e)
      ASSERT_NEAR(twice[i][e], 2.0 * fresh[i][e], 8 * Ulp(fresh[i][e]))
          << kGradientNames[static_cast<std::size_t>(i)] << "[" << e << "]";
}

// Without accumulate, the weight gradients are overwritten too (the buffers held NaN and 1e30).
TEST(CpuBackendAccumulate, WithoutAccumulateEveryOutputIsOverwritten) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  const Problem problem = MakeProblem(config, 1, 9, DefaultScalarsFor(16), 78);
  Gradients<float> from_nan = MakeOutputBuffers(config, 1, 9, kNaN);
  Gradients<float> from_big = MakeOutputBuffers(config, 1, 9, 1e30f);
  ASSERT_EQ(RunHost(problem, false, from_nan), ATTNGRAD_OK);
  ASSERT_EQ(RunHost(problem, false, from_big), ATTNGRAD_OK);
  for (int i = 0; i < kNumGradients; ++i)
    EXPECT_EQ(from_nan[i], from_big[i]) << kGradientNames[static_cast<std::size_t>(i)];
  for (int i = 0; i < kNumGradients; ++i)
    for (float v : from_nan[i])
      ASSERT_TRUE(std::isfinite(v)) << kGradientNames[static_cast<std::size_t>(i)];
}

// backward.h: "The result does not depend on [num_threads]": bit-identical for 1, 2, 3 and 7
// threads. A sliding window changes the result only where a query has keys beyond it: a window at
// least as long as the sequence is bit for bit full causal attention; a shorter one differs from
// it.
TEST(CpuBackendSlidingWindow, MattersOnlyBeyondTheWindow) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  Scalars full = DefaultScalarsFor(16);
  full.softcap = 0.0f;
  const Problem causal = MakeProblem(config, 2, 11, full, 91);
  Gradients<float> causal_out = MakeOutputBuffers(config, 2, 11, kNaN);
  ASSERT_EQ(RunHost(causal, false, causal_out), ATTNGRAD_OK);

  Problem as_long = causal;
  as_long.scalars.sliding_window = 11;
  Gradients<float> as_long_out = MakeOutputBuffers(config, 2, 11, kNaN);
  ASSERT_EQ(RunHost(as_long, false, as_long_out), ATTNGRAD_OK);
  for (int i = 0; i < kNumGradients; ++i)
    EXPECT_EQ(as_long_out[i], causal_out[i]) << kGradientNames[i];

  Problem shorter = causal;
  shorter.scalars.sliding_window = 10;
  Gradients<float> shorter_out = MakeOutputBuffers(config, 2, 11, kNaN);
  ASSERT_EQ(RunHost(shorter, false, shorter_out), ATTNGRAD_OK);
  EXPECT_NE(shorter_out[0], causal_out[0])
      << "window 10 of 11 tokens must change grad_hidden_states";
}

// A negative window is an invalid argument; softcap 0 (no capping) is valid.
TEST(CpuBackendSlidingWindow, NegativeWindowIsRefused) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  Problem problem = MakeProblem(config, 1, 4, DefaultScalarsFor(16), 92);
  problem.scalars.softcap = 0.0f;
  Gradients<float> out = MakeOutputBuffers(config, 1, 4, 0.0f);
  EXPECT_EQ(RunHost(problem, false, out), ATTNGRAD_OK);
  problem.scalars.sliding_window = -1;
  EXPECT_EQ(RunHost(problem, false, out), ATTNGRAD_INVALID_ARGUMENT);
}

TEST(CpuBackendThreads, ResultIsIndependentOfThreadCount) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  const int batch = 3, seq_len = 150;  // more than one 64-token chunk per sequence
  const Problem problem = MakeProblem(config, batch, seq_len, DefaultScalarsFor(16), 79);
  Gradients<float> one = MakeOutputBuffers(config, batch, seq_len, kNaN);
  ASSERT_EQ(RunHost(problem, false, one, 1), ATTNGRAD_OK);
  for (int threads : {2, 3, 7, 0}) {
    Gradients<float> other = MakeOutputBuffers(config, batch, seq_len, kNaN);
    ASSERT_EQ(RunHost(problem, false, other, threads), ATTNGRAD_OK);
    for (int i = 0; i < kNumGradients; ++i) {
      ASSERT_EQ(0, std::memcmp(one[i].data(), other[i].data(), one[i].size() * sizeof(float)))
          << kGradientNames[static_cast<std::size_t>(i)] << " differs between 1 and " << threads
          << " threads";
    }
  }
}

// SPEC section 1: inputs are never written.
TEST(CpuBackendInputs, AreNotWritten) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  const Problem problem = MakeProblem(config, 2, 5, DefaultScalarsFor(16), 80);
  const Problem copy = problem;
  Gradients<float> out = MakeOutputBuffers(config, 2, 5, 0.0f);
  ASSERT_EQ(RunHost(problem, true, out), ATTNGRAD_OK);
  EXPECT_EQ(problem.grad_output, copy.grad_output);
  EXPECT_EQ(problem.hidden_states, copy.hidden_states);
  EXPECT_EQ(problem.cos, copy.cos);
  EXPECT_EQ(problem.sin, copy.sin);
  for (attngrad::Weight weight : attngrad::kAllWeights) {
    EXPECT_EQ(problem.weights[weight], copy.weights[weight]) << attngrad::WeightModuleName(weight);
  }
}

// Invalid configurations, shapes, scalars and pointers through the C++ API: INVALID_ARGUMENT and
// the outputs untouched.
TEST(CpuBackendArguments, InvalidArgumentsAreRejected) {
  const LayerConfig good = LayerConfig{64, 6, 2, 16};
  const Problem problem = MakeProblem(good, 1, 4, DefaultScalarsFor(16), 81);
  Gradients<float> out = MakeOutputBuffers(good, 1, 4, 7.0f);
  const attngrad::BackwardInputs in = problem.Inputs();
  const attngrad::BackwardOutputs outs = OutputsOf(out);
  const Scalars scalars = problem.scalars;

  const std::vector<LayerConfig> bad_configs = {
      LayerConfig{0, 6, 2, 16},   LayerConfig{64, 0, 2, 16},  LayerConfig{64, 6, 0, 16},
      LayerConfig{64, 6, 2, 0},   LayerConfig{64, 6, 4, 16},  // heads not a multiple of kv heads
      LayerConfig{64, 6, 2, 15},                              // odd head_dim
      LayerConfig{-64, 6, 2, 16}, LayerConfig{64, -6, -2, 16}};
  for (const LayerConfig& c : bad_configs) {
    EXPECT_FALSE(c.IsValid());
    EXPECT_EQ(attngrad::BackwardHost(c, 1, 4, scalars, false, in, outs).code,
              ATTNGRAD_INVALID_ARGUMENT)
        << Describe(c, 1, 4, scalars);
  }
  EXPECT_EQ(attngrad::BackwardHost(good, 0, 4, scalars, false, in, outs).code,
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(attngrad::BackwardHost(good, 1, 0, scalars, false, in, outs).code,
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(attngrad::BackwardHost(good, -2, 4, scalars, false, in, outs).code,
            ATTNGRAD_INVALID_ARGUMENT);

  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {kNaN, inf, -inf}) {
    Scalars s = scalars;
    s.scaling = bad;
    EXPECT_EQ(attngrad::BackwardHost(good, 1, 4, s, false, in, outs).code,
              ATTNGRAD_INVALID_ARGUMENT)
        << "scaling " << bad;
  }
  for (float bad : {kNaN, inf, -inf}) {
    Scalars s = scalars;
    s.softcap = bad;
    EXPECT_EQ(attngrad::BackwardHost(good, 1, 4, s, false, in, outs).code,
              ATTNGRAD_INVALID_ARGUMENT)
        << "softcap " << bad;
  }
  for (float bad : {kNaN, inf, -inf, 0.0f, -1.0f}) {
    Scalars s = scalars;
    s.eps = bad;
    EXPECT_EQ(attngrad::BackwardHost(good, 1, 4, s, false, in, outs).code,
              ATTNGRAD_INVALID_ARGUMENT)
        << "eps " << bad;
  }
  {
    attngrad::BackwardInputs missing = in;
    missing.cos = nullptr;
    EXPECT_EQ(attngrad::BackwardHost(good, 1, 4, scalars, false, missing, outs).code,
              ATTNGRAD_INVALID_ARGUMENT);
    attngrad::BackwardOutputs missing_out = outs;
    missing_out.weight_gradients[attngrad::Weight::kKNorm] = nullptr;
    EXPECT_EQ(attngrad::BackwardHost(good, 1, 4, scalars, false, in, missing_out).code,
              ATTNGRAD_INVALID_ARGUMENT);
  }
  for (int i = 0; i < kNumGradients; ++i)
    for (float v : out[i])
      ASSERT_EQ(v, 7.0f) << kGradientNames[static_cast<std::size_t>(i)] << " written";
}

}  // namespace
}  // namespace attngrad_test
