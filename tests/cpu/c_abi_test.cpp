// The C ABI of attngrad.h on the CPU: attngrad_backward_host for the 4B configuration against the
// float64 loops, accumulate through the ABI, every bad-argument path of attngrad_backward_host and
// attngrad_backward, attngrad_workspace_size on bad arguments, attngrad_status_string, and the
// _ex entry points that take any Gemma-3 layer.
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/attngrad.h"
#include "attngrad/backward.h"
#include "problem.h"
#include "reference.h"

namespace attngrad_test {
namespace {

using attngrad::LayerConfig;
using attngrad::Weight;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// One call's 17 pointers as an array, so that a test can set each one to NULL in turn.
struct AbiCall {
  int batch;
  int seq_len;
  float scaling;
  float softcap;
  float eps;
  int accumulate;
  const float* inputs[10];
  float* outputs[7];

  AbiCall(const Problem& p, Gradients<float>& out, int accumulate_flag)
      : batch(p.batch),
        seq_len(p.seq_len),
        scaling(p.scalars.scaling),
        softcap(p.scalars.softcap),
        eps(p.scalars.eps),
        accumulate(accumulate_flag),
        inputs{p.grad_output.data(),
               p.hidden_states.data(),
               p.cos.data(),
               p.sin.data(),
               p.weights[Weight::kQProj].data(),
               p.weights[Weight::kKProj].data(),
               p.weights[Weight::kVProj].data(),
               p.weights[Weight::kOProj].data(),
               p.weights[Weight::kQNorm].data(),
               p.weights[Weight::kKNorm].data()},
        outputs{out[0].data(), out[1].data(), out[2].data(), out[3].data(),
                out[4].data(), out[5].data(), out[6].data()} {}

  int Host() const {
    return attngrad_backward_host(batch, seq_len, scaling, softcap, eps, accumulate, inputs[0],
                                  inputs[1], inputs[2], inputs[3], inputs[4], inputs[5], inputs[6],
                                  inputs[7], inputs[8], inputs[9], outputs[0], outputs[1],
                                  outputs[2], outputs[3], outputs[4], outputs[5], outputs[6]);
  }
  int Device(int precision, void* workspace, size_t workspace_size) const {
    return attngrad_backward(batch, seq_len, scaling, softcap, eps, precision, accumulate,
                             inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
                             inputs[6], inputs[7], inputs[8], inputs[9], outputs[0], outputs[1],
                             outputs[2], outputs[3], outputs[4], outputs[5], outputs[6], workspace,
                             workspace_size, /*stream=*/nullptr);
  }
};

const char* const kInputNames[10] = {"grad_output",   "hidden_states", "cos",      "sin",
                                     "q_weight",      "k_weight",      "v_weight", "o_weight",
                                     "q_norm_weight", "k_norm_weight"};

// Full-size 4B buffers for B=1, S=2 (about 100 MB of weights), shared by the argument tests, so
// that a call that wrongly went ahead would still touch valid memory. The values do not matter
// here.
Problem ConstantProblem(const LayerConfig& config, int batch, int seq_len) {
  Problem p;
  p.config = config;
  p.batch = batch;
  p.seq_len = seq_len;
  const auto sizes = GradientSizes(config, batch, seq_len);
  const std::size_t rotary = static_cast<std::size_t>(batch) * seq_len * config.head_dim;
  p.grad_output.assign(sizes[0], 0.5f);
  p.hidden_states.assign(sizes[0], 0.01f);
  p.cos.assign(rotary, 1.0f);
  p.sin.assign(rotary, 0.0f);
  const attngrad::PerWeight<float> values = {{0.02f, -0.02f, 0.03f, 0.01f, 0.1f, -0.1f}};
  for (Weight weight : attngrad::kAllWeights) {
    p.weights[weight].assign(attngrad::WeightElements(config, weight), values[weight]);
  }
  return p;
}

class CAbiArguments : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    problem_ = new Problem(ConstantProblem(LayerConfig::Gemma3_4B(), 1, 2));
    out_ = new Gradients<float>(MakeOutputBuffers(LayerConfig::Gemma3_4B(), 1, 2, 3.0f));
  }
  static void TearDownTestSuite() {
    delete problem_;
    delete out_;
    problem_ = nullptr;
    out_ = nullptr;
  }
  static AbiCall Call() { return AbiCall(*problem_, *out_, 0); }
  static void ExpectOutputsUntouched() {
    for (int i = 0; i < kNumGradients; ++i) {
      for (float v : (*out_)[i]) {
        ASSERT_EQ(v, 3.0f) << kGradientNames[static_cast<std::size_t>(i)]
                           << " was written by a call that failed";
      }
    }
  }
  static Problem* problem_;
  static Gradients<float>* out_;
};
Problem* CAbiArguments::problem_ = nullptr;
Gradients<float>* CAbiArguments::out_ = nullptr;

TEST_F(CAbiArguments, BadShapeReturnsInvalidArgument) {
  for (int batch : {0, -1, INT_MIN}) {
    AbiCall c = Call();
    c.batch = batch;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT) << "batch " << batch;
  }
  for (int seq_len : {0, -1, INT_MIN}) {
    AbiCall c = Call();
    c.seq_len = seq_len;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT) << "seq_len " << seq_len;
  }
  {
    // B*S*3072 elements overflow size_t: rejected, not attempted.
    AbiCall c = Call();
    c.batch = INT_MAX;
    c.seq_len = INT_MAX;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT);
  }
  ExpectOutputsUntouched();
}

TEST_F(CAbiArguments, EachNullPointerReturnsInvalidArgument) {
  for (int i = 0; i < 10; ++i) {
    AbiCall c = Call();
    c.inputs[i] = nullptr;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT) << kInputNames[i] << " = NULL";
  }
  for (int i = 0; i < kNumGradients; ++i) {
    AbiCall c = Call();
    c.outputs[i] = nullptr;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT)
        << kGradientNames[static_cast<std::size_t>(i)] << " = NULL";
  }
  ExpectOutputsUntouched();
}

TEST_F(CAbiArguments, BadScalarsReturnInvalidArgument) {
  for (float bad : {kNaN, kInf, -kInf}) {
    AbiCall c = Call();
    c.softcap = bad;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT) << "softcap " << bad;
  }
  for (float bad : {kNaN, kInf, -kInf, 0.0f, -0.0f, -1.0f, -std::numeric_limits<float>::min()}) {
    AbiCall c = Call();
    c.eps = bad;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT) << "eps " << bad;
  }
  for (float bad : {kNaN, kInf, -kInf}) {
    AbiCall c = Call();
    c.scaling = bad;
    EXPECT_EQ(c.Host(), ATTNGRAD_INVALID_ARGUMENT) << "scaling " << bad;
  }
  ExpectOutputsUntouched();
}

// attngrad_backward: bad arguments are INVALID_ARGUMENT whether or not CUDA is built in; a valid
// call with too small a workspace is WORKSPACE_TOO_SMALL in a build with the CUDA backend (checked
// before any device work, so also on a machine without a GPU), UNSUPPORTED in a build without it.
TEST_F(CAbiArguments, DeviceEntryPointArgumentsAndWorkspace) {
  const int devices = attngrad_device_count();
  EXPECT_GE(devices, 0);
  {
    AbiCall c = Call();
    c.batch = 0;
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_INVALID_ARGUMENT);
    c = Call();
    c.seq_len = -3;
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_INVALID_ARGUMENT);
    c = Call();
    c.inputs[4] = nullptr;
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_INVALID_ARGUMENT);
    c = Call();
    c.outputs[0] = nullptr;
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_INVALID_ARGUMENT);
    c = Call();
    c.softcap = kNaN;
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_INVALID_ARGUMENT);
    c = Call();
    c.eps = 0.0f;
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_INVALID_ARGUMENT);
    c = Call();
    for (int precision : {-1, 4, 99}) {
      EXPECT_EQ(c.Device(precision, nullptr, 0), ATTNGRAD_INVALID_ARGUMENT)
          << "precision " << precision;
    }
  }
  // A build with the CUDA backend reports a positive workspace size (with or without a device);
  // a build without it reports 0, no device, and UNSUPPORTED.
  AbiCall c = Call();
  const size_t need = attngrad_workspace_size(1, 2, ATTNGRAD_PRECISION_FP32);
  if (need > 0) {
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, need - 1), ATTNGRAD_WORKSPACE_TOO_SMALL);
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_WORKSPACE_TOO_SMALL);
    const size_t need_fp16 = attngrad_workspace_size(1, 2, ATTNGRAD_PRECISION_FP16);
    ASSERT_GT(need_fp16, 0u);
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP16, nullptr, need_fp16 - 1),
              ATTNGRAD_WORKSPACE_TOO_SMALL);
  } else {
    EXPECT_EQ(devices, 0) << "devices reported, but attngrad_workspace_size says 0";
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_FP32, nullptr, 0), ATTNGRAD_UNSUPPORTED);
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_AUTO, nullptr, 0), ATTNGRAD_UNSUPPORTED);
    std::vector<unsigned char> workspace(1 << 20);
    EXPECT_EQ(c.Device(ATTNGRAD_PRECISION_TF32, workspace.data(), workspace.size()),
              ATTNGRAD_UNSUPPORTED);
  }
  ExpectOutputsUntouched();
}

TEST(CAbiWorkspace, SizeIsZeroForBadArguments) {
  EXPECT_EQ(attngrad_workspace_size(0, 128, ATTNGRAD_PRECISION_FP32), 0u);
  EXPECT_EQ(attngrad_workspace_size(1, 0, ATTNGRAD_PRECISION_FP32), 0u);
  EXPECT_EQ(attngrad_workspace_size(-1, 128, ATTNGRAD_PRECISION_FP32), 0u);
  EXPECT_EQ(attngrad_workspace_size(1, 128, -1), 0u);
  EXPECT_EQ(attngrad_workspace_size(1, 128, 4), 0u);
  EXPECT_EQ(attngrad_workspace_size(INT_MAX, INT_MAX, ATTNGRAD_PRECISION_FP32), 0u);
  if (attngrad_workspace_size(1, 1, ATTNGRAD_PRECISION_FP32) > 0) {  // built with CUDA
    for (int precision : {ATTNGRAD_PRECISION_AUTO, ATTNGRAD_PRECISION_FP32, ATTNGRAD_PRECISION_TF32,
                          ATTNGRAD_PRECISION_FP16}) {
      EXPECT_GT(attngrad_workspace_size(2, 541, precision), 0u) << "precision " << precision;
    }
  }
}

TEST(CAbiStatus, StringsNameEveryStatus) {
  EXPECT_STREQ(attngrad_status_string(ATTNGRAD_OK), "ATTNGRAD_OK");
  EXPECT_STREQ(attngrad_status_string(ATTNGRAD_INVALID_ARGUMENT), "ATTNGRAD_INVALID_ARGUMENT");
  EXPECT_STREQ(attngrad_status_string(ATTNGRAD_WORKSPACE_TOO_SMALL),
               "ATTNGRAD_WORKSPACE_TOO_SMALL");
  EXPECT_STREQ(attngrad_status_string(ATTNGRAD_CUDA_ERROR), "ATTNGRAD_CUDA_ERROR");
  EXPECT_STREQ(attngrad_status_string(ATTNGRAD_UNSUPPORTED), "ATTNGRAD_UNSUPPORTED");
  EXPECT_STREQ(attngrad_status_string(ATTNGRAD_INTERNAL), "ATTNGRAD_INTERNAL");
  for (int unknown : {-1, 6, 100, INT_MIN, INT_MAX})
    EXPECT_STREQ(attngrad_status_string(unknown), "unknown status") << unknown;
  // The enum values are part of the ABI.
  EXPECT_EQ(ATTNGRAD_OK, 0);
  EXPECT_EQ(ATTNGRAD_INVALID_ARGUMENT, 1);
  EXPECT_EQ(ATTNGRAD_WORKSPACE_TOO_SMALL, 2);
  EXPECT_EQ(ATTNGRAD_CUDA_ERROR, 3);
  EXPECT_EQ(ATTNGRAD_UNSUPPORTED, 4);
  EXPECT_EQ(ATTNGRAD_INTERNAL, 5);
  EXPECT_EQ(ATTNGRAD_PRECISION_AUTO, 0);
  EXPECT_EQ(ATTNGRAD_PRECISION_FP32, 1);
  EXPECT_EQ(ATTNGRAD_PRECISION_TF32, 2);
  EXPECT_EQ(ATTNGRAD_PRECISION_FP16, 3);
}

// attngrad_backward_host (the 4B configuration) against the float64 loops, with non-default
// scalars, and then accumulate through the ABI onto those results.
TEST(CAbiHost, Gemma4BMatchesFloat64LoopsAndAccumulates) {
  attngrad::Scalars scalars;
  scalars.scaling = 0.25f;
  scalars.softcap = 3.0f;
  scalars.eps = 1e-3f;
  ProblemOptions options;
  options.norm_weight_std = 0.3;
  const int batch = 2, seq_len = 4;
  const Problem problem =
      MakeProblem(LayerConfig::Gemma3_4B(), batch, seq_len, scalars, 4343, options);
  const Inputs64 wide = problem.Widened();
  ASSERT_GT(ReferenceMaxAbsScore(wide) / scalars.softcap, 1.0) << "the soft-cap does not bite";

  Gradients<float> got = MakeOutputBuffers(LayerConfig::Gemma3_4B(), batch, seq_len, kNaN);
  ASSERT_EQ(AbiCall(problem, got, 0).Host(), ATTNGRAD_OK);
  const Gradients<double> ref = ReferenceBackward(wide);
  EXPECT_TRUE(AllMatch("C ABI, Gemma3_4B, B 2, S 4, scaling 0.25, softcap 3, eps 1e-3", got, ref,
                       Tolerance()));

  // Accumulate onto the result itself: weight gradients double, grad_hidden_states stays.
  Gradients<float> acc = got;
  ASSERT_EQ(AbiCall(problem, acc, 1).Host(), ATTNGRAD_OK);
  EXPECT_EQ(acc[0], got[0]) << "grad_hidden_states must be overwritten, not accumulated";
  for (int i = 1; i < kNumGradients; ++i) {
    for (std::size_t e = 0; e < got[i].size(); ++e) {
      const double expect = 2.0 * got[i][e];
      ASSERT_NEAR(acc[i][e], expect, std::ldexp(std::fabs(expect), -21))
          << kGradientNames[static_cast<std::size_t>(i)] << "[" << e << "]";
    }
  }
}

// attngrad_backward_host_ex: a Gemma-3 layer of another shape (head_dim 256, 4/1 heads like the
// 1B), no soft-capping and a sliding window, against the float64 loops; the SPEC layer through the
// _ex entry is bit for bit attngrad_backward_host; null structs are invalid arguments.
attngrad_layer AbiLayerOf(const Problem& p) {
  return attngrad_layer{p.config.hidden_size, p.config.num_heads,      p.config.num_kv_heads,
                        p.config.head_dim,    p.scalars.scaling,       p.scalars.softcap,
                        p.scalars.eps,        p.scalars.sliding_window};
}

attngrad_inputs AbiInputsOf(const Problem& p) {
  return attngrad_inputs{p.grad_output.data(),
                         p.hidden_states.data(),
                         p.cos.data(),
                         p.sin.data(),
                         p.weights[Weight::kQProj].data(),
                         p.weights[Weight::kKProj].data(),
                         p.weights[Weight::kVProj].data(),
                         p.weights[Weight::kOProj].data(),
                         p.weights[Weight::kQNorm].data(),
                         p.weights[Weight::kKNorm].data()};
}

attngrad_outputs AbiOutputsOf(Gradients<float>& out) {
  return attngrad_outputs{out[0].data(), out[1].data(), out[2].data(), out[3].data(),
                          out[4].data(), out[5].data(), out[6].data()};
}

TEST(CAbiHostEx, AnyGemma3LayerMatchesFloat64Loops) {
  attngrad::Scalars scalars;
  scalars.scaling = 1.0f / 16.0f;
  scalars.softcap = 0.0f;
  scalars.sliding_window = 4;
  const LayerConfig config{64, 4, 1, 256};
  const Problem problem = MakeProblem(config, 2, 9, scalars, 4545);
  Gradients<float> got = MakeOutputBuffers(config, 2, 9, kNaN);
  const attngrad_layer layer = AbiLayerOf(problem);
  const attngrad_inputs inputs = AbiInputsOf(problem);
  const attngrad_outputs outputs = AbiOutputsOf(got);
  ASSERT_EQ(attngrad_backward_host_ex(&layer, 2, 9, 0, &inputs, &outputs), ATTNGRAD_OK);
  EXPECT_TRUE(AllMatch("C ABI _ex, head_dim 256, 4/1 heads, no soft-cap, window 4", got,
                       ReferenceBackward(problem.Widened()), Tolerance()));

  EXPECT_EQ(attngrad_backward_host_ex(nullptr, 2, 9, 0, &inputs, &outputs),
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(attngrad_backward_host_ex(&layer, 2, 9, 0, nullptr, &outputs),
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(attngrad_backward_host_ex(&layer, 2, 9, 0, &inputs, nullptr),
            ATTNGRAD_INVALID_ARGUMENT);
  attngrad_layer negative_window = layer;
  negative_window.sliding_window = -2;
  EXPECT_EQ(attngrad_backward_host_ex(&negative_window, 2, 9, 0, &inputs, &outputs),
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(attngrad_workspace_size_ex(nullptr, 1, 1, ATTNGRAD_PRECISION_AUTO), 0u);
  EXPECT_EQ(attngrad_workspace_size_ex(&negative_window, 1, 1, ATTNGRAD_PRECISION_AUTO), 0u);
}

TEST(CAbiHostEx, SpecLayerIsTheSeedsEntryPoint) {
  const Problem problem = MakeProblem(LayerConfig::Gemma3_4B(), 1, 3, attngrad::Scalars(), 4646);
  Gradients<float> seed = MakeOutputBuffers(LayerConfig::Gemma3_4B(), 1, 3, kNaN);
  Gradients<float> extended = MakeOutputBuffers(LayerConfig::Gemma3_4B(), 1, 3, kNaN);
  ASSERT_EQ(AbiCall(problem, seed, 0).Host(), ATTNGRAD_OK);
  const attngrad_layer layer = AbiLayerOf(problem);
  const attngrad_inputs inputs = AbiInputsOf(problem);
  const attngrad_outputs outputs = AbiOutputsOf(extended);
  ASSERT_EQ(attngrad_backward_host_ex(&layer, 1, 3, 0, &inputs, &outputs), ATTNGRAD_OK);
  for (int i = 0; i < kNumGradients; ++i) EXPECT_EQ(extended[i], seed[i]) << kGradientNames[i];
}

}  // namespace
}  // namespace attngrad_test
