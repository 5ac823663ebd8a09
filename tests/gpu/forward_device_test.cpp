// attngrad::ForwardDevice (forward.h: the layer output A Woᵀ on the GPU) against the float64 loops
// of tests/cpu/reference.cpp, on SPEC section 3's inputs: the SPEC layer (soft-capped, full causal;
// and with a sliding window and no soft-cap) and small layers with a sliding window and no
// soft-cap (head_dim 128 and 256), in AUTO (bitwise the FP16 mode), FP32 and TF32; the
// PreparedWeights overload (bitwise the plain call in every mode); determinism and CUDA-graph
// capture; the errors, named like the backward's. Skipped without a GPU.
//
// The bar of each mode follows from its arithmetic. FP32: fp32 operands, fp32 products and sums,
// as the CPU backend (whose bar, ConditionedTolerance, applies). TF32 and FP16 (AUTO): every
// product's operands are rounded to a 10-bit mantissa (unit roundoff u = 2^-11) and accumulated in
// fp32. Along the way from the inputs to the output the values are rounded kRoundings times as
// operands: X and W{q,k,v} (the projections), q' and k' (the scores), v, P (the P v product), A and
// Wo (the o_proj product). Each moves the output by at most u relative, so the output's relative
// error norm is at most kRoundings·u, plus, as for fp32, the error of the scores that softmax turns
// into a relative error of P: two roundings of the largest score. An element may exceed the
// average by a few standard deviations: the elementwise bar is twice that, relative to the
// element and to the output's rms.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "attngrad/backward.h"
#include "attngrad/cuda_resources.h"
#include "attngrad/forward.h"
#include "attngrad/layer_weights.h"
#include "attngrad/prepared_weights.h"
#include "problem.h"
#include "reference.h"

namespace attngrad_test {
namespace {

using attngrad::ForwardInputs;
using attngrad::LayerConfig;
using attngrad::Precision;
using attngrad::Scalars;
using attngrad::Weight;
using attngrad::cuda::DeviceBuffer;

#define ASSERT_CUDA(expression) ASSERT_EQ((expression), cudaSuccess) << #expression

constexpr int kReducedPrecisionRoundings = 8;
constexpr double kTenBitUnitRoundoff = 0x1p-11;

// The bar of `precision` for a case whose largest score is max_abs_score (the file comment).
Tolerance ModeTolerance(Precision precision, double max_abs_score) {
  if (precision == Precision::kFp32) return ConditionedTolerance(max_abs_score);
  Tolerance tolerance;
  tolerance.rel_norm = (kReducedPrecisionRoundings + 2.0 * max_abs_score) * kTenBitUnitRoundoff;
  tolerance.rtol = 2.0 * tolerance.rel_norm;
  tolerance.atol_rms = 2.0 * tolerance.rel_norm;
  return tolerance;
}

const char* ModeName(Precision precision) {
  switch (precision) {
    case Precision::kAuto: return "AUTO";
    case Precision::kFp32: return "FP32";
    case Precision::kTf32: return "TF32";
    case Precision::kFp16: return "FP16";
  }
  return "?";
}

DeviceBuffer<float> Upload(const std::vector<float>& host) {
  DeviceBuffer<float> buffer;
  EXPECT_EQ(DeviceBuffer<float>::Create(host.size(), &buffer), cudaSuccess);
  EXPECT_EQ(
      cudaMemcpy(buffer.get(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
      cudaSuccess);
  return buffer;
}

// A problem's inputs on the device, and the output buffer.
struct DeviceForward {
  const Problem& host;
  DeviceBuffer<float> hidden_states, cos, sin;
  attngrad::PerWeight<DeviceBuffer<float>> weights;
  DeviceBuffer<float> output;
  std::size_t output_elements;

  explicit DeviceForward(const Problem& problem)
      : host(problem),
        hidden_states(Upload(problem.hidden_states)),
        cos(Upload(problem.cos)),
        sin(Upload(problem.sin)),
        output_elements(problem.hidden_states.size()) {
    for (Weight weight : attngrad::kAllWeights) weights[weight] = Upload(problem.weights[weight]);
    EXPECT_EQ(DeviceBuffer<float>::Create(output_elements, &output), cudaSuccess);
  }

  ForwardInputs Inputs() const {
    ForwardInputs in;
    in.hidden_states = hidden_states.get();
    in.cos = cos.get();
    in.sin = sin.get();
    for (Weight weight : attngrad::kAllWeights) in.weights[weight] = weights[weight].get();
    return in;
  }

  std::vector<float> Output() const {
    std::vector<float> result(output_elements);
    EXPECT_EQ(cudaMemcpy(result.data(), output.get(), output_elements * sizeof(float),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return result;
  }

  // Every output element NaN (all bits set), so that an element not written fails.
  void Poison() const {
    EXPECT_EQ(cudaMemset(output.get(), 0xff, output_elements * sizeof(float)), cudaSuccess);
  }
};

// The workspace of a call, plain or with prepared weights.
std::size_t WorkspaceBytes(const Problem& p, Precision precision,
                           const attngrad::PreparedWeights* prepared) {
  return prepared != nullptr
             ? attngrad::ForwardWorkspaceSize(*prepared, p.batch, p.seq_len, precision)
             : attngrad::ForwardWorkspaceSize(p.config, p.batch, p.seq_len, precision);
}

// One ForwardDevice call into the poisoned output, with stale bytes in a fresh workspace, then
// synchronised: the output.
std::vector<float> RunForward(const DeviceForward& device, Precision precision,
                              const attngrad::PreparedWeights* prepared, const std::string& what) {
  const Problem& p = device.host;
  const std::size_t bytes = WorkspaceBytes(p, precision, prepared);
  EXPECT_GT(bytes, 0u) << what;
  DeviceBuffer<unsigned char> workspace;
  EXPECT_EQ(DeviceBuffer<unsigned char>::Create(bytes, &workspace), cudaSuccess);
  EXPECT_EQ(cudaMemset(workspace.get(), 0x5a, bytes), cudaSuccess);
  device.Poison();
  const attngrad::Status status =
      prepared != nullptr ? attngrad::ForwardDevice(*prepared, p.batch, p.seq_len, p.scalars,
                                                    precision, device.Inputs(), device.output.get(),
                                                    workspace.get(), bytes, nullptr)
                          : attngrad::ForwardDevice(p.config, p.batch, p.seq_len, p.scalars,
                                                    precision, device.Inputs(), device.output.get(),
                                                    workspace.get(), bytes, nullptr);
  EXPECT_TRUE(status.ok()) << what << ": " << status.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  return device.Output();
}

attngrad::PreparedWeights Prepare(const DeviceForward& device) {
  attngrad::PreparedWeights prepared;
  const attngrad::Status status =
      prepared.Prepare(device.host.config, device.Inputs().weights, nullptr);
  EXPECT_TRUE(status.ok()) << status.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return prepared;
}

// SPEC section 4's bar and the mode's own (ModeTolerance).
void ExpectMeetsBars(const std::vector<float>& got, const std::vector<double>& want,
                     Precision precision, double max_abs_score, const std::string& what) {
  EXPECT_TRUE(MeetsSpecBar(what, got, want));
  MatchStats stats;
  EXPECT_TRUE(Matches(what, got, want, ModeTolerance(precision, max_abs_score), &stats));
  if (std::getenv("ATTNGRAD_TEST_VERBOSE") != nullptr) {
    std::printf("[stats] %s rel_norm_err %.3e max_err/rms %.3e rms %.3e max|s| %.2f\n",
                what.c_str(), stats.rel_norm_error, stats.max_abs_error_over_rms, stats.rms_ref,
                max_abs_score);
  }
}

class GpuForwardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (attngrad::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct ForwardCase {
  std::string name;
  LayerConfig config;
  int batch, seq_len;
  Scalars scalars;
};

std::vector<ForwardCase> ReferenceCases() {
  const LayerConfig spec = LayerConfig::Gemma3_4B();
  Scalars spec_window;  // SPEC's scalars with a local layer's window, no soft-cap
  spec_window.softcap = 0.0f;
  spec_window.sliding_window = 64;
  Scalars small_window = DefaultScalarsFor(128);
  small_window.softcap = 0.0f;
  small_window.sliding_window = 16;
  Scalars gemma_270m = DefaultScalarsFor(256);  // Gemma-3 270M's local layer
  gemma_270m.softcap = 0.0f;
  gemma_270m.sliding_window = 512;
  return {
      {"spec_B1_S1", spec, 1, 1, Scalars()},
      {"spec_B2_S37", spec, 2, 37, Scalars()},
      {"spec_B1_S300", spec, 1, 300, Scalars()},
      {"spec_window64_nosoftcap_B2_S130", spec, 2, 130, spec_window},
      {"small_window16_nosoftcap_B2_S100", LayerConfig{512, 4, 2, 128}, 2, 100, small_window},
      {"gemma270m_window512_nosoftcap_B1_S700", LayerConfig{640, 4, 1, 256}, 1, 700, gemma_270m},
  };
}

TEST_F(GpuForwardTest, MatchesTheFloat64ReferenceAndAutoIsFp16) {
  for (const ForwardCase& c : ReferenceCases()) {
    const Problem problem = MakeProblem(c.config, c.batch, c.seq_len, c.scalars, SeedOf(c.name));
    const Inputs64 wide = problem.Widened();
    const std::vector<double> want = ReferenceLayerOutput(wide);
    const double max_abs_score = ReferenceMaxAbsScore(wide);
    const DeviceForward device(problem);
    for (const Precision precision : {Precision::kAuto, Precision::kFp32, Precision::kTf32}) {
      const std::string what = c.name + " " + ModeName(precision);
      const std::vector<float> got = RunForward(device, precision, nullptr, what);
      ExpectMeetsBars(got, want, precision, max_abs_score, what);
      if (precision == Precision::kAuto) {
        EXPECT_EQ(got, RunForward(device, Precision::kFp16, nullptr, what)) << what << " vs FP16";
      }
    }
  }
}

TEST_F(GpuForwardTest, PreparedWeightsGiveThePlainCallsBitsInEveryMode) {
  Scalars gemma_270m = DefaultScalarsFor(256);
  gemma_270m.softcap = 0.0f;
  gemma_270m.sliding_window = 512;
  const ForwardCase cases[] = {
      {"prepared_spec_B1_S128", LayerConfig::Gemma3_4B(), 1, 128, Scalars()},
      {"prepared_gemma270m_B2_S600", LayerConfig{640, 4, 1, 256}, 2, 600, gemma_270m}};
  for (const ForwardCase& c : cases) {
    const Problem problem = MakeProblem(c.config, c.batch, c.seq_len, c.scalars, SeedOf(c.name));
    const Inputs64 wide = problem.Widened();
    const std::vector<double> want = ReferenceLayerOutput(wide);
    const double max_abs_score = ReferenceMaxAbsScore(wide);
    const DeviceForward device(problem);
    const attngrad::PreparedWeights prepared = Prepare(device);
    ASSERT_TRUE(prepared.ready());
    for (const Precision precision :
         {Precision::kAuto, Precision::kFp32, Precision::kTf32, Precision::kFp16}) {
      const std::string what = c.name + " " + ModeName(precision);
      const std::vector<float> plain = RunForward(device, precision, nullptr, what + " plain");
      const std::vector<float> got = RunForward(device, precision, &prepared, what + " prepared");
      EXPECT_EQ(0, std::memcmp(got.data(), plain.data(), got.size() * sizeof(float))) << what;
      ExpectMeetsBars(got, want, precision, max_abs_score, what + " prepared");
    }
  }
}

// A second call (stale workspace) and a call captured in the caller's CUDA graph give the first
// call's bits: the forward is deterministic, allocates nothing and synchronises nothing.
TEST_F(GpuForwardTest, RepeatsBitwiseAndCanBeCapturedInAGraph) {
  const Problem problem =
      MakeProblem(LayerConfig::Gemma3_4B(), 2, 70, Scalars(), SeedOf("repeats_and_captures"));
  const DeviceForward device(problem);
  attngrad::cuda::Stream owned_stream;
  ASSERT_CUDA(attngrad::cuda::Stream::Create(&owned_stream));
  const cudaStream_t stream = owned_stream.get();
  for (const Precision precision : {Precision::kAuto, Precision::kFp32}) {
    const std::string what = ModeName(precision);
    const std::vector<float> first = RunForward(device, precision, nullptr, what);
    EXPECT_EQ(first, RunForward(device, precision, nullptr, what)) << what << " second call";
    const std::size_t bytes = WorkspaceBytes(problem, precision, nullptr);
    DeviceBuffer<unsigned char> workspace;
    ASSERT_CUDA(DeviceBuffer<unsigned char>::Create(bytes, &workspace));
    device.Poison();
    ASSERT_CUDA(cudaDeviceSynchronize());
    cudaGraph_t graph = nullptr;
    ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const attngrad::Status status = attngrad::ForwardDevice(
        problem.config, problem.batch, problem.seq_len, problem.scalars, precision, device.Inputs(),
        device.output.get(), workspace.get(), bytes, stream);
    ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(status.ok()) << status.message;
    cudaGraphExec_t exec = nullptr;
    ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_EQ(first, device.Output()) << what << " captured";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST_F(GpuForwardTest, ErrorsNameTheCheckThatFailed) {
  const LayerConfig config = LayerConfig::Gemma3_4B();
  const Problem problem = MakeProblem(config, 1, 5, Scalars(), SeedOf("errors"));
  const DeviceForward device(problem);
  const Precision precision = Precision::kFp16;
  const std::size_t bytes = attngrad::ForwardWorkspaceSize(config, 1, 5, precision);
  ASSERT_GT(bytes, 0u);
  EXPECT_LT(bytes, attngrad::DeviceWorkspaceSize(config, 1, 5, precision));
  DeviceBuffer<unsigned char> workspace;
  ASSERT_CUDA(DeviceBuffer<unsigned char>::Create(bytes, &workspace));
  auto call = [&](const LayerConfig& layer, const ForwardInputs& in, float* output,
                  std::size_t size) {
    return attngrad::ForwardDevice(layer, 1, 5, Scalars(), precision, in, output, workspace.get(),
                                   size, nullptr);
  };
  EXPECT_TRUE(call(config, device.Inputs(), device.output.get(), bytes).ok());
  ASSERT_CUDA(cudaDeviceSynchronize());

  attngrad::Status status = call(config, device.Inputs(), nullptr, bytes);
  EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_STREQ(status.message, "output is null");
  ForwardInputs in = device.Inputs();
  in.weights[Weight::kVProj] = nullptr;
  EXPECT_STREQ(call(config, in, device.output.get(), bytes).message, "weights[v_proj] is null");
  in = device.Inputs();
  in.cos = device.cos.get() + 1;
  EXPECT_STREQ(call(config, in, device.output.get(), bytes).message, "cos is not 16-byte aligned");
  status = call(config, device.Inputs(), device.output.get(), bytes - 1);
  EXPECT_EQ(status.code, ATTNGRAD_WORKSPACE_TOO_SMALL);
  EXPECT_NE(std::string(status.message).find("ForwardWorkspaceSize"), std::string::npos)
      << status.message;
  LayerConfig other_head_dim = config;
  other_head_dim.head_dim = 64;
  status = call(other_head_dim, device.Inputs(), device.output.get(), bytes);
  EXPECT_EQ(status.code, ATTNGRAD_UNSUPPORTED);
  EXPECT_STREQ(status.message, "the GPU kernels support head_dim 128 and 256 only");
  EXPECT_EQ(attngrad::ForwardWorkspaceSize(other_head_dim, 1, 5, precision), 0u);

  // Prepared weights: a smaller workspace in FP16 (no fp16 weights in it), the same in FP32; the
  // fp32 weights must be the ones prepared; an empty object is refused.
  attngrad::PreparedWeights prepared = Prepare(device);
  const std::size_t prepared_bytes = attngrad::ForwardWorkspaceSize(prepared, 1, 5, precision);
  EXPECT_LT(prepared_bytes, bytes);
  EXPECT_EQ(attngrad::ForwardWorkspaceSize(prepared, 1, 5, Precision::kFp32),
            attngrad::ForwardWorkspaceSize(config, 1, 5, Precision::kFp32));
  in = device.Inputs();
  in.weights[Weight::kKProj] = device.weights[Weight::kVProj].get();
  status = attngrad::ForwardDevice(prepared, 1, 5, Scalars(), precision, in, device.output.get(),
                                   workspace.get(), bytes, nullptr);
  EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_STREQ(status.message,
               "in.weights are not the weights the PreparedWeights were prepared from");
  const attngrad::PreparedWeights moved = std::move(prepared);
  EXPECT_EQ(attngrad::ForwardWorkspaceSize(prepared, 1, 5, precision), 0u);                // NOLINT
  status = attngrad::ForwardDevice(prepared, 1, 5, Scalars(), precision, device.Inputs(),  // NOLINT
                                   device.output.get(), workspace.get(), bytes, nullptr);
  EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT);
  ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace attngrad_test
