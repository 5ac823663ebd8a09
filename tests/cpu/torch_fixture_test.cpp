// Cross-check with PyTorch: tests/fixtures/*.bin hold small inputs and the float64 gradients (and
// layer output) that torch autograd computed from the forward alone
// (tests/fixtures/make_fixtures.py, which documents the file format). The CPU backend must match
// them like it matches the float64 loops, and the loops themselves must match them to float64
// rounding. The hf_* fixtures come from Hugging Face transformers' own Gemma3Attention with each
// published Gemma-3 model's heads, head_dim, scaling, no soft-capping and a sliding window
// (tests/fixtures/make_gemma3_fixtures.py); that module computes its RMSNorm and softmax in
// float32, so the loops match it to float32 rounding there.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/backward.h"
#include "problem.h"
#include "reference.h"

#ifndef ATTNGRAD_FIXTURE_DIR
#error "ATTNGRAD_FIXTURE_DIR must name tests/fixtures"
#endif

namespace attngrad_test {
namespace {

struct Fixture {
  Problem problem;
  Gradients<double> gradients;
  std::vector<double> layer_output;
};

// Reads `count` little-endian values of type T at `offset` (this suite runs on little-endian
// hosts).
template <typename T>
bool Take(const std::string& bytes, std::size_t& offset, std::size_t count, std::vector<T>& out) {
  if (offset + count * sizeof(T) > bytes.size()) return false;
  out.resize(count);
  std::memcpy(out.data(), bytes.data() + offset, count * sizeof(T));
  offset += count * sizeof(T);
  return true;
}

::testing::AssertionResult LoadFixture(const std::string& name, Fixture& f) {
  const std::string path = std::string(ATTNGRAD_FIXTURE_DIR) + "/" + name + ".bin";
  std::ifstream file(path, std::ios::binary);
  if (!file) return ::testing::AssertionFailure() << "cannot open " << path;
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (bytes.size() < 48 || bytes.compare(0, 8, "ATTNGFX1") != 0)
    return ::testing::AssertionFailure() << path << ": not an ATTNGFX1 fixture";
  std::int32_t ints[6];
  float scalars[3];
  std::int32_t sliding_window = 0;
  std::memcpy(ints, bytes.data() + 8, sizeof(ints));
  std::memcpy(scalars, bytes.data() + 32, sizeof(scalars));
  std::memcpy(&sliding_window, bytes.data() + 44, sizeof(sliding_window));
  Problem& p = f.problem;
  p.config.hidden_size = ints[0];
  p.config.num_heads = ints[1];
  p.config.num_kv_heads = ints[2];
  p.config.head_dim = ints[3];
  p.batch = ints[4];
  p.seq_len = ints[5];
  p.scalars.scaling = scalars[0];
  p.scalars.softcap = scalars[1];
  p.scalars.eps = scalars[2];
  p.scalars.sliding_window = sliding_window;
  if (!p.config.IsValid() || p.batch < 1 || p.seq_len < 1)
    return ::testing::AssertionFailure() << path << ": bad header";
  const auto sizes = GradientSizes(p.config, p.batch, p.seq_len);
  const std::size_t rotary = static_cast<std::size_t>(p.batch) * p.seq_len * p.config.head_dim;
  std::size_t offset = 48;
  bool ok = Take(bytes, offset, sizes[0], p.grad_output) &&
            Take(bytes, offset, sizes[0], p.hidden_states) && Take(bytes, offset, rotary, p.cos) &&
            Take(bytes, offset, rotary, p.sin);
  for (attngrad::Weight weight : attngrad::kAllWeights) {
    ok = ok && Take(bytes, offset, attngrad::WeightElements(p.config, weight), p.weights[weight]);
  }
  bool ok_out = ok;
  for (int i = 0; i < kNumGradients && ok_out; ++i)
    ok_out = Take(bytes, offset, sizes[static_cast<std::size_t>(i)], f.gradients[i]);
  ok_out = ok_out && Take(bytes, offset, sizes[0], f.layer_output);
  if (!ok_out || offset != bytes.size())
    return ::testing::AssertionFailure()
           << path << ": " << bytes.size() << " bytes, which does not match its header";
  return ::testing::AssertionSuccess();
}

class TorchFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TorchFixtureTest, CpuBackendMatchesTorchAutograd) {
  Fixture f;
  ASSERT_TRUE(LoadFixture(GetParam(), f));
  const Problem& p = f.problem;
  Gradients<float> got =
      MakeOutputBuffers(p.config, p.batch, p.seq_len, std::numeric_limits<float>::quiet_NaN());
  ASSERT_EQ(RunHost(p, false, got), ATTNGRAD_OK);
  EXPECT_TRUE(AllMatch(GetParam() + " (" + Describe(p.config, p.batch, p.seq_len, p.scalars) +
                           "): CPU backend vs torch",
                       got, f.gradients, Tolerance()));
}

TEST_P(TorchFixtureTest, Float64LoopsMatchTorchAutograd) {
  Fixture f;
  ASSERT_TRUE(LoadFixture(GetParam(), f));
  const Inputs64 in = f.problem.Widened();
  const bool float32_oracle = GetParam().rfind("hf_", 0) == 0;  // transformers' float32 internals
  Tolerance tight;
  tight.rel_norm = float32_oracle ? 1e-6 : 1e-12;
  tight.rtol = float32_oracle ? 1e-4 : 1e-9;
  tight.atol_rms = float32_oracle ? 1e-5 : 1e-11;
  EXPECT_TRUE(Matches("layer_output", ReferenceLayerOutput(in), f.layer_output, tight));
  EXPECT_TRUE(
      AllMatch(GetParam() + ": float64 loops vs torch", ReferenceBackward(in), f.gradients, tight));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TorchFixtureTest,
                         ::testing::Values("tiny_gqa", "tiny_capped", "tiny_mha",
                                           "hf_gemma_3_270m_local", "hf_gemma_3_270m_global",
                                           "hf_gemma_3_1b_local", "hf_gemma_3_1b_global",
                                           "hf_gemma_3_4b_local", "hf_gemma_3_4b_global",
                                           "hf_gemma_3_12b_local", "hf_gemma_3_27b_local"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace attngrad_test
