// attngrad::ForwardHost (the CPU backend's layer output A Woᵀ, forward.h) against the float64 loops
// of reference.cpp: the SPEC layer at a few tokens (soft-capped, full causal, and with a sliding
// window), small layers with a sliding window and without soft-capping (Gemma-3 as published),
// head_dim 256, odd S, a soft-cap that bites; then thread-count independence, overwritten output,
// untouched inputs, the argument checks (the backward's, named the same way) and the device entry
// points' argument handling (no GPU needed).
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/backward.h"
#include "attngrad/forward.h"
#include "problem.h"
#include "reference.h"

namespace attngrad_test {
namespace {

using attngrad::ForwardInputs;
using attngrad::LayerConfig;
using attngrad::Scalars;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::size_t OutputElements(const LayerConfig& config, int batch, int seq_len) {
  return static_cast<std::size_t>(batch) * seq_len * config.hidden_size;
}

struct ForwardCase {
  std::string name;
  LayerConfig config;
  int batch;
  int seq_len;
  Scalars scalars;
  ProblemOptions options;
  // The case is only meaningful when max |s| (step 4, before the cap) exceeds this.
  double min_max_abs_score;
};

std::vector<ForwardCase> ForwardCases() {
  const LayerConfig spec = LayerConfig::Gemma3_4B();
  const LayerConfig small = LayerConfig{64, 6, 2, 16};  // group 3, like the 4B model
  Scalars spec_window = Scalars();                      // SPEC's scalars, a local layer's window
  spec_window.sliding_window = 3;
  Scalars spec_uncapped_window = spec_window;
  spec_uncapped_window.softcap = 0.0f;
  Scalars uncapped = DefaultScalarsFor(16);
  uncapped.softcap = 0.0f;
  Scalars window4 = uncapped;
  window4.sliding_window = 4;
  Scalars window1 = uncapped;  // each query sees only its own key
  window1.sliding_window = 1;
  Scalars window37 = uncapped;
  window37.sliding_window = 37;
  Scalars head_dim_256 = uncapped;
  head_dim_256.scaling = 1.0f / 16.0f;
  head_dim_256.sliding_window = 3;
  Scalars capped;  // the cap bites, eps shows
  capped.scaling = 1.0f;
  capped.softcap = 5.0f;
  capped.eps = 1e-2f;
  ProblemOptions big_norm_weights;
  big_norm_weights.norm_weight_std = 0.5;
  return {
      {"Spec_B1_S1", spec, 1, 1, Scalars(), {}, 0},
      {"Spec_B1_S8", spec, 1, 8, Scalars(), {}, 0},
      {"Spec_B2_S5", spec, 2, 5, Scalars(), {}, 0},
      {"Spec_Window3_B2_S7", spec, 2, 7, spec_window, {}, 0},
      {"Spec_Window3_NoSoftcap_B1_S9", spec, 1, 9, spec_uncapped_window, {}, 0},
      {"Small_Window4_NoSoftcap_B2_S13", small, 2, 13, window4, {}, 0},
      {"Small_Window1_NoSoftcap_B2_S6", small, 2, 6, window1, {}, 0},
      {"Small_Window37_NoSoftcap_B1_S541", small, 1, 541, window37, {}, 0},
      {"Small_NoSoftcap_B3_S33", small, 3, 33, uncapped, {}, 0},
      {"Group4_NoSoftcap_B2_S10", LayerConfig{48, 8, 2, 12}, 2, 10, uncapped, {}, 0},
      {"HeadDim256_Window3_NoSoftcap_B2_S7", LayerConfig{64, 2, 1, 256}, 2, 7, head_dim_256, {}, 0},
      {"Small_SoftcapBites_B2_S13", small, 2, 13, capped, big_norm_weights, 5.0},
  };
}

class ForwardCaseTest : public ::testing::TestWithParam<ForwardCase> {};

// SPEC section 4's bar, and the CPU backend's own: the forward output's errors come from the same
// fp32 storage of steps 1-4 as the gradients' (plus one fp32 product, A Woᵀ, no longer than the
// backward's), so the bar of the backward's tests applies, conditioned on the largest score.
TEST_P(ForwardCaseTest, MatchesFloat64Loops) {
  const ForwardCase& c = GetParam();
  const Problem problem =
      MakeProblem(c.config, c.batch, c.seq_len, c.scalars, SeedOf(c.name), c.options);
  const Inputs64 wide = problem.Widened();
  const double max_abs_score = ReferenceMaxAbsScore(wide);
  if (c.min_max_abs_score > 0) {
    ASSERT_GT(max_abs_score, c.min_max_abs_score) << "this draw does not test what the case is for";
  }
  std::vector<float> got(OutputElements(c.config, c.batch, c.seq_len), kNaN);
  const attngrad::Status status = RunForwardHost(problem, got);
  ASSERT_TRUE(status.ok()) << status.message;
  const std::vector<double> want = ReferenceLayerOutput(wide);
  const std::string what =
      c.name + " output (" + Describe(c.config, c.batch, c.seq_len, c.scalars) + ")";
  EXPECT_TRUE(MeetsSpecBar(what, got, want));
  MatchStats stats;
  EXPECT_TRUE(Matches(what, got, want, ConditionedTolerance(max_abs_score), &stats));
  if (std::getenv("ATTNGRAD_TEST_VERBOSE") != nullptr) {
    std::printf("[stats] %s rel_norm_err %.3e max_err/rms %.3e rms %.3e\n", what.c_str(),
                stats.rel_norm_error, stats.max_abs_error_over_rms, stats.rms_ref);
  }
}

INSTANTIATE_TEST_SUITE_P(CpuForward, ForwardCaseTest, ::testing::ValuesIn(ForwardCases()),
                         [](const ::testing::TestParamInfo<ForwardCase>& info) {
                           return info.param.name;
                         });

// forward.h: the result does not depend on num_threads (bit for bit, 1, 2, 3, 7 and all).
TEST(CpuForward, ResultIsIndependentOfThreadCount) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  const int batch = 3, seq_len = 150;
  Scalars scalars = DefaultScalarsFor(16);
  scalars.sliding_window = 40;
  const Problem problem = MakeProblem(config, batch, seq_len, scalars, 93);
  std::vector<float> one(OutputElements(config, batch, seq_len), kNaN);
  ASSERT_TRUE(RunForwardHost(problem, one, 1).ok());
  for (int threads : {2, 3, 7, 0}) {
    std::vector<float> other(one.size(), kNaN);
    ASSERT_TRUE(RunForwardHost(problem, other, threads).ok());
    EXPECT_EQ(0, std::memcmp(one.data(), other.data(), one.size() * sizeof(float)))
        << "output differs between 1 and " << threads << " threads";
  }
}

// The output is overwritten whatever it held (NaN, 1e30), and the inputs are never written.
TEST(CpuForward, OverwritesTheOutputAndLeavesTheInputs) {
  const LayerConfig config = LayerConfig{64, 6, 2, 16};
  const Problem problem = MakeProblem(config, 2, 5, DefaultScalarsFor(16), 94);
  const Problem copy = problem;
  std::vector<float> from_nan(OutputElements(config, 2, 5), kNaN);
  std::vector<float> from_big(from_nan.size(), 1e30f);
  ASSERT_TRUE(RunForwardHost(problem, from_nan).ok());
  ASSERT_TRUE(RunForwardHost(problem, from_big).ok());
  EXPECT_EQ(from_nan, from_big);
  for (float v : from_nan) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(problem.hidden_states, copy.hidden_states);
  EXPECT_EQ(problem.cos, copy.cos);
  EXPECT_EQ(problem.sin, copy.sin);
  for (attngrad::Weight weight : attngrad::kAllWeights) {
    EXPECT_EQ(problem.weights[weight], copy.weights[weight]) << attngrad::WeightModuleName(weight);
  }
}

// ForwardInputs::Of takes the backward's inputs less grad_output.
TEST(CpuForward, InputsOfABackwardCallAreItsForwardPart) {
  const Problem problem = MakeProblem(LayerConfig{64, 6, 2, 16}, 1, 3, DefaultScalarsFor(16), 95);
  const attngrad::BackwardInputs backward = problem.Inputs();
  const ForwardInputs forward = ForwardInputs::Of(backward);
  EXPECT_EQ(forward.hidden_states, backward.hidden_states);
  EXPECT_EQ(forward.cos, backward.cos);
  EXPECT_EQ(forward.sin, backward.sin);
  for (attngrad::Weight weight : attngrad::kAllWeights) {
    EXPECT_EQ(forward.weights[weight], backward.weights[weight]);
  }
  EXPECT_FALSE(forward.AnyNull());
  EXPECT_TRUE(ForwardInputs().AnyNull());
}

// Bad configurations, shapes, scalars and pointers: INVALID_ARGUMENT naming the check (the
// backward's messages), and the output untouched.
TEST(CpuForward, InvalidArgumentsAreRejectedByName) {
  const LayerConfig good = LayerConfig{64, 6, 2, 16};
  const Problem problem = MakeProblem(good, 1, 4, DefaultScalarsFor(16), 96);
  const ForwardInputs in = ForwardInputs::Of(problem.Inputs());
  std::vector<float> output(OutputElements(good, 1, 4), 7.0f);
  const Scalars scalars = problem.scalars;
  auto call = [&](const LayerConfig& config, int batch, const Scalars& s, const ForwardInputs& i,
                  float* out) { return attngrad::ForwardHost(config, batch, 4, s, i, out); };
  auto expect_refused = [](const attngrad::Status& status, const char* message) {
    EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT) << message;
    EXPECT_STREQ(status.message, message);
  };
  expect_refused(call(good, 1, scalars, in, nullptr), "output is null");
  expect_refused(call(LayerConfig{64, 6, 4, 16}, 1, scalars, in, output.data()),
                 "LayerConfig is invalid (sizes must be positive, num_heads a multiple of "
                 "num_kv_heads, head_dim even)");
  expect_refused(call(good, 0, scalars, in, output.data()), "batch must be at least 1");
  Scalars bad_window = scalars;
  bad_window.sliding_window = -1;
  expect_refused(call(good, 1, bad_window, in, output.data()),
                 "scalars must be finite, with eps > 0 and sliding_window >= 0");
  ForwardInputs missing = in;
  missing.hidden_states = nullptr;
  expect_refused(call(good, 1, scalars, missing, output.data()), "hidden_states is null");
  missing = in;
  missing.sin = nullptr;
  expect_refused(call(good, 1, scalars, missing, output.data()), "sin is null");
  missing = in;
  missing.weights[attngrad::Weight::kOProj] = nullptr;
  expect_refused(call(good, 1, scalars, missing, output.data()), "weights[o_proj] is null");
  for (float v : output) ASSERT_EQ(v, 7.0f) << "output written by a refused call";
}

// The device entry points check their arguments before any device work (so also here, without a
// GPU): the same messages; a build without the CUDA backend says UNSUPPORTED for valid arguments
// and a workspace size of 0.
TEST(CpuForward, DeviceEntryPointsCheckTheirArguments) {
  const LayerConfig config = LayerConfig::Gemma3_4B();
  const Problem problem = MakeProblem(LayerConfig{64, 6, 2, 16}, 1, 2, DefaultScalarsFor(16), 97);
  const ForwardInputs in = ForwardInputs::Of(problem.Inputs());
  const auto precision = attngrad::Precision::kFp32;
  float output = 0.0f;
  attngrad::Status status =
      attngrad::ForwardDevice(config, 1, 2, Scalars(), precision, in, nullptr, nullptr, 0, nullptr);
  EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_STREQ(status.message, "output is null");
  status =
      attngrad::ForwardDevice(config, 0, 2, Scalars(), precision, in, &output, nullptr, 0, nullptr);
  EXPECT_STREQ(status.message, "batch must be at least 1");
  EXPECT_EQ(attngrad::ForwardWorkspaceSize(config, 0, 2, precision), 0u);
  const std::size_t need = attngrad::ForwardWorkspaceSize(config, 1, 2, precision);
  status = attngrad::ForwardDevice(config, 1, 2, Scalars(), precision, in, &output, nullptr, need,
                                   nullptr);
  if (need > 0) {  // the CUDA backend: the workspace is checked before any device work
    EXPECT_LT(need, attngrad::DeviceWorkspaceSize(config, 1, 2, precision));
    EXPECT_EQ(status.code, ATTNGRAD_WORKSPACE_TOO_SMALL);
    EXPECT_STREQ(status.message, "workspace is null");
  } else {
    EXPECT_EQ(attngrad::DeviceCount(), 0);
    EXPECT_EQ(status.code, ATTNGRAD_UNSUPPORTED);
  }
  EXPECT_EQ(output, 0.0f);
}

}  // namespace
}  // namespace attngrad_test
