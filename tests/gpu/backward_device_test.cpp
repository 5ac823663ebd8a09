// GPU backend (attngrad_backward) against the CPU reference backend (attngrad_backward_host) on
// small and odd shapes in every precision mode, under SPEC section 4's rule; accumulate; FP16 with
// grad_output far outside fp16's range; determinism (two calls bitwise equal); CUDA-graph capture;
// concurrent calls from two threads; bad arguments; prepared weights (bitwise equal to the plain
// call in every mode, shape, window and soft-cap setting, captured, re-prepared, misused).
// Skipped without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "attngrad/attngrad.h"
#include "attngrad/backward.h"
#include "attngrad/cuda_resources.h"
#include "attngrad/layer_weights.h"
#include "attngrad/prepared_weights.h"

namespace {

using attngrad::kAllWeights;
using attngrad::PerWeight;
using attngrad::Weight;
using attngrad::cuda::DeviceBuffer;

const attngrad::LayerConfig kConfig = attngrad::LayerConfig::Gemma3_4B();
constexpr float kScaling = 0.08838834764831845f;
constexpr float kSoftcap = 50.f;
constexpr float kEps = 1e-6f;

#define ASSERT_CUDA(expression) ASSERT_EQ((expression), cudaSuccess) << #expression

// Host tensors of one problem, drawn from SPEC section 3's distribution, except that cos/sin use
// positions that differ per sequence of the batch (offset 37*b) so that a kernel assuming one
// table for the whole batch fails. The seeds are fixed per test: every run draws the same inputs.
// The layer is the SPEC layer unless another configuration is given (weights ~ N(0, 2/hidden),
// hidden states ~ N(0, 1/hidden), RoPE base 10,000 over head_dim).
struct HostProblem {
  attngrad::LayerConfig config;
  int batch, seq_len;
  std::vector<float> grad_output, hidden_states, cos, sin;
  PerWeight<std::vector<float>> weights;

  HostProblem(int b, int s, unsigned seed, const attngrad::LayerConfig& layer = kConfig)
      : config(layer),
        batch(b),
        seq_len(s),
        weights(attngrad::ZeroWeights<std::vector<float>>(layer)) {
    const int hidden = config.hidden_size, head_dim = config.head_dim;
    std::mt19937 random(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const std::size_t tokens = static_cast<std::size_t>(b) * s;
    auto fill = [&](std::vector<float>& v, float scale) {
      for (auto& x : v) x = normal(random) * scale;
    };
    grad_output.resize(tokens * hidden);
    hidden_states.resize(tokens * hidden);
    fill(grad_output, 1.f);
    fill(hidden_states, 1.f / std::sqrt(static_cast<float>(hidden)));
    for (Weight weight : kAllWeights) {
      const bool norm = weight == Weight::kQNorm || weight == Weight::kKNorm;
      fill(weights[weight], norm ? 0.02f : std::sqrt(2.f / static_cast<float>(hidden)));
    }
    cos.resize(tokens * head_dim);
    sin.resize(tokens * head_dim);
    for (int bi = 0; bi < b; ++bi) {
      for (int si = 0; si < s; ++si) {
        for (int d = 0; d < head_dim; ++d) {
          const double inv_freq =
              std::pow(10000.0, -2.0 * (d % (head_dim / 2)) / static_cast<double>(head_dim));
          const double angle = (si + 37.0 * bi) * inv_freq;
          const std::size_t index = (static_cast<std::size_t>(bi) * s + si) * head_dim + d;
          cos[index] = static_cast<float>(std::cos(angle));
          sin[index] = static_cast<float>(std::sin(angle));
        }
      }
    }
  }
  std::size_t tokens() const { return static_cast<std::size_t>(batch) * seq_len; }
};

// The seven outputs, on the host: grad_hidden_states, then the weight gradients in Weight order.
constexpr int kOutputs = 1 + attngrad::kNumWeights;
struct HostGradients {
  std::vector<float> tensors[kOutputs];
  explicit HostGradients(std::size_t tokens, const attngrad::LayerConfig& config = kConfig) {
    tensors[0].assign(tokens * config.hidden_size, 0.f);
    for (Weight weight : kAllWeights) {
      tensors[1 + attngrad::IndexOf(weight)].assign(attngrad::WeightElements(config, weight), 0.f);
    }
  }
  PerWeight<float*> WeightGradients() {
    PerWeight<float*> gradients;
    for (Weight weight : kAllWeights)
      gradients[weight] = tensors[1 + attngrad::IndexOf(weight)].data();
    return gradients;
  }
};

std::string OutputName(int output) {
  if (output == 0) return "grad_hidden_states";
  return std::string("weight_gradients[") + attngrad::WeightModuleName(kAllWeights[output - 1]) +
         "]";
}

// Every element `value` (NaN poisons outputs so that an unwritten element fails).
HostGradients Filled(std::size_t tokens, float value,
                     const attngrad::LayerConfig& config = kConfig) {
  HostGradients result(tokens, config);
  for (auto& t : result.tensors) std::fill(t.begin(), t.end(), value);
  return result;
}

// Small random values: what accumulated outputs start from.
HostGradients RandomGradients(std::size_t tokens, unsigned seed) {
  HostGradients result(tokens);
  std::mt19937 random(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& t : result.tensors) {
    for (float& x : t) x = normal(random) * 0.05f;
  }
  return result;
}

HostGradients Scaled(HostGradients values, float factor) {
  for (auto& t : values.tensors) {
    for (float& x : t) x *= factor;
  }
  return values;
}

void ExpectBitwiseEqual(const HostGradients& a, const HostGradients& b, const std::string& what) {
  for (int i = 0; i < kOutputs; ++i) {
    EXPECT_EQ(std::memcmp(a.tensors[i].data(), b.tensors[i].data(), a.tensors[i].size() * 4), 0)
        << what << " " << OutputName(i);
  }
}

// A device buffer of `count` floats (a failed allocation fails the test).
DeviceBuffer<float> Allocate(std::size_t count) {
  DeviceBuffer<float> buffer;
  EXPECT_EQ(DeviceBuffer<float>::Create(count, &buffer), cudaSuccess);
  return buffer;
}

void CopyToDevice(const DeviceBuffer<float>& device, const std::vector<float>& host) {
  EXPECT_EQ(
      cudaMemcpy(device.get(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
      cudaSuccess);
}

DeviceBuffer<float> Upload(const std::vector<float>& host) {
  DeviceBuffer<float> buffer = Allocate(host.size());
  CopyToDevice(buffer, host);
  return buffer;
}

// A workspace of `bytes`.
DeviceBuffer<unsigned char> Workspace(std::size_t bytes) {
  DeviceBuffer<unsigned char> buffer;
  EXPECT_EQ(DeviceBuffer<unsigned char>::Create(bytes, &buffer), cudaSuccess);
  return buffer;
}

// What a call may change from a problem's own arguments (the bad-argument test).
struct CallChanges {
  int batch = -1;  // -1: the problem's
  float eps = kEps;
  bool null_hidden_states = false;
};

// A problem on the device plus output buffers.
struct DeviceProblem {
  const HostProblem& host;
  DeviceBuffer<float> grad_output, hidden_states, cos, sin;
  PerWeight<DeviceBuffer<float>> weights;
  DeviceBuffer<float> outputs[kOutputs];

  explicit DeviceProblem(const HostProblem& h)
      : host(h),
        grad_output(Upload(h.grad_output)),
        hidden_states(Upload(h.hidden_states)),
        cos(Upload(h.cos)),
        sin(Upload(h.sin)) {
    for (Weight weight : kAllWeights) weights[weight] = Upload(h.weights[weight]);
    HostGradients shapes(h.tokens(), h.config);
    for (int i = 0; i < kOutputs; ++i) outputs[i] = Allocate(shapes.tensors[i].size());
  }

  // New contents (a problem of the same shape) in the same input buffers.
  void LoadInputs(const HostProblem& h) {
    CopyToDevice(grad_output, h.grad_output);
    CopyToDevice(hidden_states, h.hidden_states);
    CopyToDevice(cos, h.cos);
    CopyToDevice(sin, h.sin);
    for (Weight weight : kAllWeights) CopyToDevice(weights[weight], h.weights[weight]);
  }

  void SetOutputs(const HostGradients& values) {
    for (int i = 0; i < kOutputs; ++i) CopyToDevice(outputs[i], values.tensors[i]);
  }
  HostGradients GetOutputs() const {
    HostGradients result(host.tokens(), host.config);
    for (int i = 0; i < kOutputs; ++i) {
      cudaMemcpy(result.tensors[i].data(), outputs[i].get(), result.tensors[i].size() * 4,
                 cudaMemcpyDeviceToHost);
    }
    return result;
  }

  attngrad::BackwardInputs Inputs() const {
    attngrad::BackwardInputs in;
    in.grad_output = grad_output.get();
    in.hidden_states = hidden_states.get();
    in.cos = cos.get();
    in.sin = sin.get();
    for (Weight weight : kAllWeights) in.weights[weight] = weights[weight].get();
    return in;
  }
  attngrad::BackwardOutputs Outputs() const {
    attngrad::BackwardOutputs out;
    out.grad_hidden_states = outputs[0].get();
    for (Weight weight : kAllWeights) {
      out.weight_gradients[weight] = outputs[1 + attngrad::IndexOf(weight)].get();
    }
    return out;
  }

  // Through the C ABI (what ctypes callers use).
  int Run(int precision, bool accumulate, void* workspace, std::size_t workspace_size,
          cudaStream_t stream = nullptr, const CallChanges& changes = CallChanges()) {
    const PerWeight<float*> w = attngrad::DataOf(weights);
    auto g = [this](Weight weight) { return outputs[1 + attngrad::IndexOf(weight)].get(); };
    return attngrad_backward(
        changes.batch >= 0 ? changes.batch : host.batch, host.seq_len, kScaling, kSoftcap,
        changes.eps, precision, accumulate ? 1 : 0, grad_output.get(),
        changes.null_hidden_states ? nullptr : hidden_states.get(), cos.get(), sin.get(),
        w[Weight::kQProj], w[Weight::kKProj], w[Weight::kVProj], w[Weight::kOProj],
        w[Weight::kQNorm], w[Weight::kKNorm], outputs[0].get(), g(Weight::kQProj),
        g(Weight::kKProj), g(Weight::kVProj), g(Weight::kOProj), g(Weight::kQNorm),
        g(Weight::kKNorm), workspace, workspace_size, stream);
  }
};

// CPU reference (fp32 OpenBLAS projections, double-accumulated attention).
HostGradients Reference(const HostProblem& p, bool accumulate, const HostGradients* initial,
                        const attngrad::Scalars& scalars = {kScaling, kSoftcap, kEps}) {
  HostGradients result = initial ? *initial : HostGradients(p.tokens(), p.config);
  attngrad::BackwardInputs in;
  in.grad_output = p.grad_output.data();
  in.hidden_states = p.hidden_states.data();
  in.cos = p.cos.data();
  in.sin = p.sin.data();
  in.weights = attngrad::DataOf(p.weights);
  attngrad::BackwardOutputs out;
  out.grad_hidden_states = result.tensors[0].data();
  out.weight_gradients = result.WeightGradients();
  const attngrad::Status status =
      attngrad::BackwardHost(p.config, p.batch, p.seq_len, scalars, accumulate, in, out);
  EXPECT_TRUE(status.ok()) << status.message;
  return result;
}

// SPEC section 4: >= 99% of elements within atol + 1e-3 |ref| (at most one miss for the head_dim-
// element norm-weight gradients), no NaN/Inf.
void ExpectMeetsBar(const HostGradients& got, const HostGradients& want, const std::string& what,
                    float atol = 0.0067f) {
  for (int i = 0; i < kOutputs; ++i) {
    const auto& g = got.tensors[i];
    const auto& w = want.tensors[i];
    std::size_t misses = 0, non_finite = 0;
    double worst = 0;
    for (std::size_t j = 0; j < g.size(); ++j) {
      if (!std::isfinite(g[j])) {
        ++non_finite;
        continue;
      }
      const double error = std::fabs(static_cast<double>(g[j]) - w[j]);
      worst = std::max(worst, error);
      if (error > atol + 1e-3 * std::fabs(w[j])) ++misses;
    }
    EXPECT_EQ(non_finite, 0u) << what << " " << OutputName(i);
    const bool norm_weight =
        i == 1 + attngrad::IndexOf(Weight::kQNorm) || i == 1 + attngrad::IndexOf(Weight::kKNorm);
    const std::size_t allowed = norm_weight ? 1 : g.size() / 100;
    EXPECT_LE(misses, allowed) << what << " " << OutputName(i) << ": " << misses << " of "
                               << g.size() << " elements miss; worst |error| " << worst;
  }
}

// Two BackwardDevice calls on the same buffers, outputs poisoned with NaN before each: the first
// meets SPEC section 4's bar against `want`, the second (a replay of the cached graph) is bitwise
// equal to the first.
void ExpectMeetsBarAndRepeatsBitwise(const HostProblem& host, DeviceProblem& device,
                                     const attngrad::Scalars& scalars,
                                     attngrad::Precision precision, const HostGradients& want,
                                     const std::string& what) {
  const std::size_t bytes =
      attngrad::DeviceWorkspaceSize(host.config, host.batch, host.seq_len, precision);
  ASSERT_GT(bytes, 0u) << what;
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  HostGradients first(host.tokens(), host.config);
  for (int call = 0; call < 2; ++call) {
    device.SetOutputs(Filled(host.tokens(), NAN, host.config));
    const attngrad::Status status = attngrad::BackwardDevice(
        host.config, host.batch, host.seq_len, scalars, precision, false, device.Inputs(),
        device.Outputs(), workspace.get(), bytes, nullptr);
    ASSERT_TRUE(status.ok()) << what << ": " << status.message;
    ASSERT_CUDA(cudaDeviceSynchronize());
    const HostGradients got = device.GetOutputs();
    if (call == 0) {
      ExpectMeetsBar(got, want, what);
      first = got;
    } else {
      for (int i = 0; i < kOutputs; ++i) {
        EXPECT_EQ(got.tensors[i], first.tensors[i])
            << what << " not deterministic, " << OutputName(i);
      }
    }
  }
}

class GpuBackwardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (attngrad_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct Shape {
  int batch, seq_len;
};

const int kModes[4] = {ATTNGRAD_PRECISION_AUTO, ATTNGRAD_PRECISION_FP32, ATTNGRAD_PRECISION_TF32,
                       ATTNGRAD_PRECISION_FP16};
const char* const kModeNames[4] = {"AUTO", "FP32", "TF32", "FP16"};

TEST_F(GpuBackwardTest, MatchesCpuBackendOnSmallAndOddShapesInEveryMode) {
  const Shape shapes[] = {{1, 1}, {1, 7}, {3, 7}, {2, 130}, {1, 541}};
  unsigned seed = 11;
  for (const Shape& shape : shapes) {
    const HostProblem host(shape.batch, shape.seq_len, seed++);
    const HostGradients want = Reference(host, false, nullptr);
    DeviceProblem device(host);
    for (int m = 0; m < 4; ++m) {
      const std::size_t bytes = attngrad_workspace_size(shape.batch, shape.seq_len, kModes[m]);
      ASSERT_GT(bytes, 0u);
      DeviceBuffer<unsigned char> workspace = Workspace(bytes);
      device.SetOutputs(Filled(host.tokens(), NAN));
      ASSERT_EQ(device.Run(kModes[m], false, workspace.get(), bytes), ATTNGRAD_OK);
      ASSERT_CUDA(cudaDeviceSynchronize());
      ExpectMeetsBar(device.GetOutputs(), want,
                     std::string(kModeNames[m]) + " B=" + std::to_string(shape.batch) +
                         " S=" + std::to_string(shape.seq_len));
    }
  }
}

TEST_F(GpuBackwardTest, AccumulateAddsWeightGradientsAndOverwritesGradHidden) {
  const HostProblem host(2, 33, 99);
  const HostGradients initial = RandomGradients(host.tokens(), 5);
  const HostGradients want = Reference(host, true, &initial);
  DeviceProblem device(host);
  for (int m = 0; m < 4; ++m) {
    const std::size_t bytes = attngrad_workspace_size(host.batch, host.seq_len, kModes[m]);
    DeviceBuffer<unsigned char> workspace = Workspace(bytes);
    device.SetOutputs(initial);
    ASSERT_EQ(device.Run(kModes[m], true, workspace.get(), bytes), ATTNGRAD_OK);
    ASSERT_CUDA(cudaDeviceSynchronize());
    ExpectMeetsBar(device.GetOutputs(), want, std::string("accumulate ") + kModeNames[m]);
  }
}

TEST_F(GpuBackwardTest, Fp16KeepsGradientsOfAnyMagnitudeInRange) {
  // The outputs are linear in grad_output, so the outputs for c * dY, divided by c, must meet the
  // bar against the reference for dY. c = 1e-7 (a loss averaged over many tokens) would put dY in
  // fp16's subnormals and c = 3e4 would overflow fp16 (max 65504) without the device-side scale.
  const HostProblem host(2, 97, 41);
  const HostGradients want = Reference(host, false, nullptr);
  const HostGradients initial = RandomGradients(host.tokens(), 6);
  const HostGradients want_accumulated = Reference(host, true, &initial);
  for (const float factor : {1e-7f, 3e4f}) {
    HostProblem scaled = host;
    for (float& x : scaled.grad_output) x *= factor;
    DeviceProblem device(scaled);
    auto unscaled = [&device, factor]() { return Scaled(device.GetOutputs(), 1.f / factor); };
    for (const int precision : {ATTNGRAD_PRECISION_AUTO, ATTNGRAD_PRECISION_FP16}) {
      const std::string what =
          "factor " + std::to_string(factor) + " precision " + std::to_string(precision);
      const std::size_t bytes = attngrad_workspace_size(host.batch, host.seq_len, precision);
      DeviceBuffer<unsigned char> workspace = Workspace(bytes);
      device.SetOutputs(Filled(host.tokens(), NAN));  // beta = 0 must not read the outputs
      ASSERT_EQ(device.Run(precision, false, workspace.get(), bytes), ATTNGRAD_OK);
      ASSERT_CUDA(cudaDeviceSynchronize());
      ExpectMeetsBar(unscaled(), want, what);

      device.SetOutputs(Scaled(initial, factor));
      ASSERT_EQ(device.Run(precision, true, workspace.get(), bytes), ATTNGRAD_OK);
      ASSERT_CUDA(cudaDeviceSynchronize());
      ExpectMeetsBar(unscaled(), want_accumulated, "accumulate " + what);
    }
  }
}

TEST_F(GpuBackwardTest, TwoCallsAreBitwiseEqual) {
  const HostProblem host(2, 300, 7);
  DeviceProblem device(host);
  for (int m = 0; m < 4; ++m) {
    const std::size_t bytes = attngrad_workspace_size(host.batch, host.seq_len, kModes[m]);
    DeviceBuffer<unsigned char> workspace = Workspace(bytes);
    ASSERT_EQ(device.Run(kModes[m], false, workspace.get(), bytes), ATTNGRAD_OK);
    const HostGradients first = device.GetOutputs();
    ASSERT_CUDA(cudaMemset(workspace.get(), 0x5a, bytes));  // stale data must not matter
    ASSERT_EQ(device.Run(kModes[m], false, workspace.get(), bytes), ATTNGRAD_OK);
    ExpectBitwiseEqual(first, device.GetOutputs(), kModeNames[m]);
  }
}

TEST_F(GpuBackwardTest, RepeatedCallsReplayAGraphThatReadsTheBuffersCurrentContents) {
  // The first call with these arguments runs directly, the second is captured into a graph and
  // launched, later ones replay it: all bitwise equal. Then new contents in the same buffers.
  const HostProblem host(2, 70, 31);
  DeviceProblem device(host);
  const int precision = ATTNGRAD_PRECISION_AUTO;
  const std::size_t bytes = attngrad_workspace_size(host.batch, host.seq_len, precision);
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  HostGradients first(host.tokens());
  for (int call = 0; call < 4; ++call) {
    device.SetOutputs(Filled(host.tokens(), NAN));
    ASSERT_EQ(device.Run(precision, false, workspace.get(), bytes), ATTNGRAD_OK);
    ASSERT_CUDA(cudaDeviceSynchronize());
    const HostGradients result = device.GetOutputs();
    if (call == 0) {
      first = result;
      continue;
    }
    ExpectBitwiseEqual(first, result, "call " + std::to_string(call));
  }
  const HostProblem other(2, 70, 32);
  device.LoadInputs(other);
  ASSERT_EQ(device.Run(precision, false, workspace.get(), bytes), ATTNGRAD_OK);
  ASSERT_CUDA(cudaDeviceSynchronize());
  ExpectMeetsBar(device.GetOutputs(), Reference(other, false, nullptr), "replay, new contents");
}

TEST_F(GpuBackwardTest, CapturedInACudaGraphGivesTheSameBits) {
  const HostProblem host(1, 200, 3);
  DeviceProblem device(host);
  const int precision = ATTNGRAD_PRECISION_AUTO;
  const std::size_t bytes = attngrad_workspace_size(host.batch, host.seq_len, precision);
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  attngrad::cuda::Stream owned_stream;
  ASSERT_CUDA(attngrad::cuda::Stream::Create(&owned_stream));
  const cudaStream_t stream = owned_stream.get();
  ASSERT_EQ(device.Run(precision, false, workspace.get(), bytes, stream), ATTNGRAD_OK);
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  const HostGradients direct = device.GetOutputs();
  device.SetOutputs(Filled(host.tokens(), 0.f));

  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const int status = device.Run(precision, false, workspace.get(), bytes, stream);
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(status, ATTNGRAD_OK);
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ExpectBitwiseEqual(direct, device.GetOutputs(), "replayed");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(GpuBackwardTest, ConcurrentCallsFromTwoThreadsMatchASingleCall) {
  // Two problems (different shapes, so different plans) on two streams from two host threads,
  // several times each, while the plan cache and the side-stream pool are shared.
  const HostProblem host_a(1, 96, 21), host_b(2, 45, 22);
  DeviceProblem device_a(host_a), device_b(host_b);
  const int precision = ATTNGRAD_PRECISION_AUTO;
  const std::size_t bytes_a = attngrad_workspace_size(1, 96, precision);
  const std::size_t bytes_b = attngrad_workspace_size(2, 45, precision);
  DeviceBuffer<unsigned char> workspace_a = Workspace(bytes_a), workspace_b = Workspace(bytes_b);
  ASSERT_EQ(device_a.Run(precision, false, workspace_a.get(), bytes_a), ATTNGRAD_OK);
  ASSERT_EQ(device_b.Run(precision, false, workspace_b.get(), bytes_b), ATTNGRAD_OK);
  ASSERT_CUDA(cudaDeviceSynchronize());
  const HostGradients alone_a = device_a.GetOutputs(), alone_b = device_b.GetOutputs();

  int status_a = ATTNGRAD_OK, status_b = ATTNGRAD_OK;
  auto worker = [precision](DeviceProblem* problem, void* workspace, std::size_t bytes,
                            int* status) {
    attngrad::cuda::Stream stream;
    if (attngrad::cuda::Stream::Create(&stream) != cudaSuccess) {
      *status = ATTNGRAD_CUDA_ERROR;
      return;
    }
    for (int i = 0; i < 5 && *status == ATTNGRAD_OK; ++i) {
      *status = problem->Run(precision, false, workspace, bytes, stream.get());
    }
    if (cudaStreamSynchronize(stream.get()) != cudaSuccess) *status = ATTNGRAD_CUDA_ERROR;
  };
  std::thread thread_a(worker, &device_a, workspace_a.get(), bytes_a, &status_a);
  std::thread thread_b(worker, &device_b, workspace_b.get(), bytes_b, &status_b);
  thread_a.join();
  thread_b.join();
  ASSERT_EQ(status_a, ATTNGRAD_OK);
  ASSERT_EQ(status_b, ATTNGRAD_OK);
  ExpectBitwiseEqual(alone_a, device_a.GetOutputs(), "problem a");
  ExpectBitwiseEqual(alone_b, device_b.GetOutputs(), "problem b");
}

TEST_F(GpuBackwardTest, BadArgumentsAreRejectedBeforeAnyLaunch) {
  const HostProblem host(1, 5, 1);
  DeviceProblem device(host);
  const int precision = ATTNGRAD_PRECISION_FP16;
  const std::size_t bytes = attngrad_workspace_size(1, 5, precision);
  ASSERT_GT(bytes, 0u);
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  device.SetOutputs(Filled(host.tokens(), 1234.5f));

  EXPECT_EQ(device.Run(precision, false, workspace.get(), bytes - 1), ATTNGRAD_WORKSPACE_TOO_SMALL);
  EXPECT_EQ(device.Run(precision, false, nullptr, bytes), ATTNGRAD_WORKSPACE_TOO_SMALL);
  EXPECT_EQ(device.Run(9, false, workspace.get(), bytes), ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(device.Run(precision, false, workspace.get(), bytes, nullptr, CallChanges{0}),
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(device.Run(precision, false, workspace.get(), bytes, nullptr,
                       CallChanges{-1, kEps, /*null_hidden_states=*/true}),
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(device.Run(precision, false, workspace.get(), bytes, nullptr, CallChanges{-1, -1.f}),
            ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_EQ(attngrad_workspace_size(0, 5, precision), 0u);
  EXPECT_EQ(attngrad_workspace_size(1, 5, 42), 0u);
  ASSERT_CUDA(cudaDeviceSynchronize());
  // Nothing was launched: every output still holds the sentinel.
  const HostGradients after = device.GetOutputs();
  for (int i = 0; i < kOutputs; ++i) {
    for (float x : after.tensors[i]) ASSERT_EQ(x, 1234.5f) << OutputName(i);
  }
}

TEST_F(GpuBackwardTest, WithoutSoftCapMatchesCpuBackend) {
  // softcap <= 0: no soft-capping (Gemma-3's published configurations), through the C++ API.
  const HostProblem host(2, 70, 17);
  DeviceProblem device(host);
  for (const float softcap : {0.f, -1.f}) {
    const attngrad::Scalars scalars{kScaling, softcap, kEps};
    const HostGradients want = Reference(host, false, nullptr, scalars);
    for (const auto precision : {attngrad::Precision::kFp16, attngrad::Precision::kFp32}) {
      const std::size_t bytes = attngrad::DeviceWorkspaceSize(kConfig, 2, 70, precision);
      DeviceBuffer<unsigned char> workspace = Workspace(bytes);
      device.SetOutputs(Filled(host.tokens(), NAN));
      const attngrad::Status status =
          attngrad::BackwardDevice(kConfig, 2, 70, scalars, precision, false, device.Inputs(),
                                   device.Outputs(), workspace.get(), bytes, nullptr);
      ASSERT_TRUE(status.ok()) << status.message;
      ASSERT_CUDA(cudaDeviceSynchronize());
      ExpectMeetsBar(device.GetOutputs(), want,
                     "softcap " + std::to_string(softcap) + " precision " +
                         std::to_string(static_cast<int>(precision)));
    }
  }
}

TEST_F(GpuBackwardTest, SlidingWindowMatchesCpuBackendInEveryModeAndIsDeterministic) {
  // Gemma-3's local layers: query i sees keys j with i - window < j <= i. Windows of 1 (a query
  // sees only itself), inside one tile, across tiles, and longer than the sequence; with and
  // without soft-capping; every precision mode; a second call is bitwise identical.
  struct WindowCase {
    int batch, seq_len, window;
    float softcap;
  };
  const WindowCase cases[] = {{1, 1, 1, kSoftcap},  {2, 7, 1, 0.f},          {3, 7, 7, kSoftcap},
                              {1, 300, 64, 0.f},    {2, 300, 100, kSoftcap}, {1, 1000, 100, 0.f},
                              {2, 1000, 1024, 0.f}, {1, 2500, 512, 0.f}};
  unsigned seed = 71;
  for (const WindowCase& c : cases) {
    const HostProblem host(c.batch, c.seq_len, seed++);
    attngrad::Scalars scalars{kScaling, c.softcap, kEps};
    scalars.sliding_window = c.window;
    const HostGradients want = Reference(host, false, nullptr, scalars);
    DeviceProblem device(host);
    for (int m = 0; m < 4; ++m) {
      ExpectMeetsBarAndRepeatsBitwise(
          host, device, scalars, static_cast<attngrad::Precision>(kModes[m]), want,
          std::string(kModeNames[m]) + " B=" + std::to_string(c.batch) +
              " S=" + std::to_string(c.seq_len) + " window=" + std::to_string(c.window) +
              " softcap=" + std::to_string(c.softcap));
    }
  }
}

TEST_F(GpuBackwardTest, Gemma3HeadDim256LayersMatchCpuBackendInEveryModeAndAreDeterministic) {
  // The published Gemma-3 models with head_dim 256 (hidden, heads / kv heads: 270M 640, 4/1; 1B
  // 1152, 4/1; 4B 2560, 8/4; 12B 3840, 16/8), scaling query_pre_attn_scalar^-0.5 = 1/16, no
  // soft-cap (one case with it), local layers (sliding window 512 or 1024) and global ones (full
  // causal), S = 1, 7, 1000, 2500, positions that differ per sequence; every precision mode; a
  // second call (a replay of the cached CUDA graph) is bitwise identical.
  struct Model {
    const char* name;
    attngrad::LayerConfig config;
    int window;
  };
  const Model models[] = {{"270m", {640, 4, 1, 256}, 512},
                          {"1b", {1152, 4, 1, 256}, 512},
                          {"4b", {2560, 8, 4, 256}, 1024},
                          {"12b", {3840, 16, 8, 256}, 1024}};
  struct LayerCase {
    int model, batch, seq_len;
    bool local;
    float softcap;
  };
  const LayerCase cases[] = {
      {0, 2, 1, true, 0.f},     {0, 3, 7, false, 0.f},    {0, 1, 1000, true, 0.f},
      {0, 1, 2500, true, 0.f},  {0, 1, 2500, false, 0.f}, {1, 1, 7, true, 0.f},
      {1, 2, 1000, false, 0.f}, {1, 1, 2500, true, 0.f},  {1, 2, 300, true, kSoftcap},
      {2, 2, 7, true, 0.f},     {2, 1, 1000, false, 0.f}, {2, 1, 2500, true, 0.f},
      {3, 1, 1, false, 0.f},    {3, 1, 7, true, 0.f},     {3, 1, 1000, true, 0.f},
      {3, 1, 1000, false, 0.f}};
  unsigned seed = 301;
  for (const LayerCase& c : cases) {
    const Model& model = models[c.model];
    const HostProblem host(c.batch, c.seq_len, seed++, model.config);
    attngrad::Scalars scalars{0.0625f, c.softcap, kEps};
    scalars.sliding_window = c.local ? model.window : 0;
    const HostGradients want = Reference(host, false, nullptr, scalars);
    DeviceProblem device(host);
    for (int m = 0; m < 4; ++m) {
      ExpectMeetsBarAndRepeatsBitwise(
          host, device, scalars, static_cast<attngrad::Precision>(kModes[m]), want,
          std::string(model.name) + (c.local ? " local " : " global ") + kModeNames[m] +
              " B=" + std::to_string(c.batch) + " S=" + std::to_string(c.seq_len) +
              " softcap=" + std::to_string(c.softcap));
    }
  }
}

TEST_F(GpuBackwardTest, CallsThatDifferOnlyInTheWindowAreNotConfused) {
  // Same buffers, shapes and precision, alternating windows: the pipeline's graph cache must tell
  // the calls apart (the window is part of its key).
  const HostProblem host(1, 300, 83);
  DeviceProblem device(host);
  const auto precision = attngrad::Precision::kFp16;
  const std::size_t bytes = attngrad::DeviceWorkspaceSize(kConfig, 1, 300, precision);
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  for (int round = 0; round < 2; ++round) {
    for (const int window : {0, 64, 0, 64}) {
      attngrad::Scalars scalars{kScaling, kSoftcap, kEps};
      scalars.sliding_window = window;
      device.SetOutputs(Filled(host.tokens(), NAN));
      const attngrad::Status status =
          attngrad::BackwardDevice(kConfig, 1, 300, scalars, precision, false, device.Inputs(),
                                   device.Outputs(), workspace.get(), bytes, nullptr);
      ASSERT_TRUE(status.ok()) << status.message;
      ASSERT_CUDA(cudaDeviceSynchronize());
      if (round == 1) {
        ExpectMeetsBar(device.GetOutputs(), Reference(host, false, nullptr, scalars),
                       "window " + std::to_string(window) + " after other windows");
      }
    }
  }
}

TEST_F(GpuBackwardTest, ErrorsNameTheCheckThatFailed) {
  const HostProblem host(1, 5, 2);
  DeviceProblem device(host);
  const auto precision = attngrad::Precision::kFp16;
  const std::size_t bytes = attngrad::DeviceWorkspaceSize(kConfig, 1, 5, precision);
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  auto call = [&](const attngrad::LayerConfig& config, const attngrad::BackwardInputs& in,
                  std::size_t workspace_size) {
    return attngrad::BackwardDevice(config, 1, 5, attngrad::Scalars{}, precision, false, in,
                                    device.Outputs(), workspace.get(), workspace_size, nullptr);
  };
  EXPECT_TRUE(call(kConfig, device.Inputs(), bytes).ok());
  ASSERT_CUDA(cudaDeviceSynchronize());

  attngrad::BackwardInputs in = device.Inputs();
  in.hidden_states = nullptr;
  attngrad::Status status = call(kConfig, in, bytes);
  EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_STREQ(status.message, "hidden_states is null");

  in = device.Inputs();
  in.weights[Weight::kVProj] = nullptr;
  EXPECT_STREQ(call(kConfig, in, bytes).message, "weights[v_proj] is null");

  in = device.Inputs();
  in.cos = device.cos.get() + 1;
  EXPECT_STREQ(call(kConfig, in, bytes).message, "cos is not 16-byte aligned");

  status = call(kConfig, device.Inputs(), bytes - 1);
  EXPECT_EQ(status.code, ATTNGRAD_WORKSPACE_TOO_SMALL);
  EXPECT_NE(std::string(status.message).find("DeviceWorkspaceSize"), std::string::npos)
      << status.message;

  attngrad::Scalars bad_window;
  bad_window.sliding_window = -1;
  status = attngrad::BackwardDevice(kConfig, 1, 5, bad_window, precision, false, device.Inputs(),
                                    device.Outputs(), workspace.get(), bytes, nullptr);
  EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT);

  attngrad::LayerConfig other_head_dim = kConfig;
  other_head_dim.head_dim = 64;
  status = call(other_head_dim, device.Inputs(), bytes);
  EXPECT_EQ(status.code, ATTNGRAD_UNSUPPORTED);
  EXPECT_STREQ(status.message, "the GPU kernels support head_dim 128 and 256 only");
}

// ---- Prepared weights (attngrad/prepared_weights.h) ------------------------------------------

// The outputs of one BackwardDevice call on `device`'s buffers (outputs poisoned with NaN first),
// with the weights prepared in `prepared` or, when it is null, converted by the call.
HostGradients RunDevice(DeviceProblem& device, const attngrad::Scalars& scalars,
                        attngrad::Precision precision, bool accumulate,
                        const attngrad::PreparedWeights* prepared, const HostGradients* initial,
                        const std::string& what) {
  const HostProblem& host = device.host;
  const std::size_t bytes =
      prepared != nullptr
          ? attngrad::DeviceWorkspaceSize(*prepared, host.batch, host.seq_len, precision)
          : attngrad::DeviceWorkspaceSize(host.config, host.batch, host.seq_len, precision);
  EXPECT_GT(bytes, 0u) << what;
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  // Stale workspace contents must not matter.
  EXPECT_EQ(cudaMemset(workspace.get(), 0x5a, bytes), cudaSuccess);
  device.SetOutputs(initial != nullptr ? *initial : Filled(host.tokens(), NAN, host.config));
  const attngrad::Status status =
      prepared != nullptr
          ? attngrad::BackwardDevice(*prepared, host.batch, host.seq_len, scalars, precision,
                                     accumulate, device.Inputs(), device.Outputs(), workspace.get(),
                                     bytes, nullptr)
          : attngrad::BackwardDevice(host.config, host.batch, host.seq_len, scalars, precision,
                                     accumulate, device.Inputs(), device.Outputs(), workspace.get(),
                                     bytes, nullptr);
  EXPECT_TRUE(status.ok()) << what << ": " << status.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  return device.GetOutputs();
}

attngrad::PreparedWeights Prepare(const DeviceProblem& device) {
  attngrad::PreparedWeights prepared;
  PerWeight<const float*> weights;
  for (Weight weight : kAllWeights) weights[weight] = device.weights[weight].get();
  const attngrad::Status status = prepared.Prepare(device.host.config, weights, nullptr);
  EXPECT_TRUE(status.ok()) << status.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return prepared;
}

TEST_F(GpuBackwardTest, PreparedWeightsGiveTheSameBitsInEveryModeShapeWindowAndSoftCap) {
  // Prepared and plain calls on the same inputs: bitwise equal outputs, first call (direct) and
  // three more (graph capture, then replays), in AUTO, FP32, TF32 and FP16; head_dim 128 (the
  // SPEC layer) and 256 (Gemma-3 12B's layer, 270M's with one kv head); full causal and sliding
  // windows; soft-cap on and off; overwrite and accumulate.
  struct Case {
    attngrad::LayerConfig config;
    int batch, seq_len, window;
    float scaling, softcap;
    bool accumulate;
  };
  const attngrad::LayerConfig hd256_12b{3840, 16, 8, 256}, hd256_270m{640, 4, 1, 256};
  const Case cases[] = {{kConfig, 1, 1, 0, kScaling, kSoftcap, false},
                        {kConfig, 1, 128, 0, kScaling, kSoftcap, false},
                        {kConfig, 2, 130, 64, kScaling, 0.f, false},
                        {kConfig, 3, 7, 0, kScaling, 0.f, true},
                        {kConfig, 1, 700, 512, kScaling, kSoftcap, true},
                        {hd256_12b, 1, 300, 0, 0.0625f, 0.f, false},
                        {hd256_12b, 2, 70, 64, 0.0625f, kSoftcap, true},
                        {hd256_270m, 1, 1000, 512, 0.0625f, 0.f, false}};
  unsigned seed = 501;
  for (const Case& c : cases) {
    const HostProblem host(c.batch, c.seq_len, seed++, c.config);
    DeviceProblem device(host);
    const attngrad::PreparedWeights prepared = Prepare(device);
    ASSERT_TRUE(prepared.ready());
    attngrad::Scalars scalars{c.scaling, c.softcap, kEps};
    scalars.sliding_window = c.window;
    HostGradients initial(host.tokens(), host.config);
    for (auto& tensor : initial.tensors) {
      for (std::size_t i = 0; i < tensor.size(); ++i) tensor[i] = 0.01f * static_cast<float>(i % 7);
    }
    for (int m = 0; m < 4; ++m) {
      const auto precision = static_cast<attngrad::Precision>(kModes[m]);
      const std::string what =
          std::string(kModeNames[m]) + " D=" + std::to_string(c.config.head_dim) +
          " B=" + std::to_string(c.batch) + " S=" + std::to_string(c.seq_len) +
          " window=" + std::to_string(c.window) + " softcap=" + std::to_string(c.softcap) +
          (c.accumulate ? " accumulate" : "");
      const HostGradients* start = c.accumulate ? &initial : nullptr;
      const HostGradients plain =
          RunDevice(device, scalars, precision, c.accumulate, nullptr, start, what + " plain");
      for (int call = 0; call < 4; ++call) {
        const HostGradients got = RunDevice(device, scalars, precision, c.accumulate, &prepared,
                                            start, what + " prepared");
        ExpectBitwiseEqual(plain, got, what + " prepared call " + std::to_string(call));
      }
    }
  }
}

TEST_F(GpuBackwardTest, PreparedWeightsCapturedInACallersGraphGiveTheSameBits) {
  const HostProblem host(1, 200, 3);
  DeviceProblem device(host);
  const attngrad::PreparedWeights prepared = Prepare(device);
  const auto precision = attngrad::Precision::kAuto;
  const attngrad::Scalars scalars{kScaling, kSoftcap, kEps};
  const HostGradients plain = RunDevice(device, scalars, precision, false, nullptr, nullptr, "");
  const std::size_t bytes = attngrad::DeviceWorkspaceSize(prepared, 1, 200, precision);
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  attngrad::cuda::Stream owned_stream;
  ASSERT_CUDA(attngrad::cuda::Stream::Create(&owned_stream));
  const cudaStream_t stream = owned_stream.get();
  device.SetOutputs(Filled(host.tokens(), NAN));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const attngrad::Status status =
      attngrad::BackwardDevice(prepared, 1, 200, scalars, precision, false, device.Inputs(),
                               device.Outputs(), workspace.get(), bytes, stream);
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(status.ok()) << status.message;
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ExpectBitwiseEqual(plain, device.GetOutputs(), "captured with prepared weights");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(GpuBackwardTest, PreparedWeightsFollowARePrepareAndRefuseOtherWeights) {
  // New contents in the same fp32 buffers: the prepared copies are what the FP16 calls read, so
  // they give the old weights' results until Prepare runs again, then the new ones' (bitwise equal
  // to plain calls), through the same cached graph (the pointers did not change).
  const HostProblem host(1, 64, 601), other(1, 64, 602);
  DeviceProblem device(host);
  attngrad::PreparedWeights prepared = Prepare(device);
  const void* copies = prepared.half_qkv();
  const auto precision = attngrad::Precision::kFp16;
  const attngrad::Scalars scalars{kScaling, kSoftcap, kEps};
  RunDevice(device, scalars, precision, false, &prepared, nullptr, "");  // direct
  RunDevice(device, scalars, precision, false, &prepared, nullptr, "");  // captured from here on
  device.LoadInputs(other);
  const HostGradients plain_other =
      RunDevice(device, scalars, precision, false, nullptr, nullptr, "plain, new weights");
  const HostGradients stale =
      RunDevice(device, scalars, precision, false, &prepared, nullptr, "not prepared again");
  EXPECT_NE(std::memcmp(stale.tensors[0].data(), plain_other.tensors[0].data(),
                        stale.tensors[0].size() * sizeof(float)),
            0)
      << "the FP16 call read the fp32 projection weights instead of the prepared copies";
  PerWeight<const float*> weights = prepared.source();
  ASSERT_TRUE(prepared.Prepare(host.config, weights, nullptr).ok());
  ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(prepared.half_qkv(), copies) << "a Prepare of the same configuration reallocated";
  ExpectBitwiseEqual(
      plain_other, RunDevice(device, scalars, precision, false, &prepared, nullptr, "re-prepared"),
      "after a second Prepare");

  // Other fp32 weights than the prepared ones, an empty object, a smaller workspace.
  const std::size_t bytes = attngrad::DeviceWorkspaceSize(prepared, 1, 64, precision);
  EXPECT_LT(bytes, attngrad::DeviceWorkspaceSize(kConfig, 1, 64, precision));
  EXPECT_EQ(attngrad::DeviceWorkspaceSize(prepared, 1, 64, attngrad::Precision::kFp32),
            attngrad::DeviceWorkspaceSize(kConfig, 1, 64, attngrad::Precision::kFp32));
  DeviceBuffer<unsigned char> workspace = Workspace(bytes);
  attngrad::BackwardInputs in = device.Inputs();
  in.weights[Weight::kKProj] = device.weights[Weight::kVProj].get();
  attngrad::Status status =
      attngrad::BackwardDevice(prepared, 1, 64, scalars, precision, false, in, device.Outputs(),
                               workspace.get(), bytes, nullptr);
  EXPECT_EQ(status.code, ATTNGRAD_INVALID_ARGUMENT);
  EXPECT_STREQ(status.message,
               "in.weights are not the weights the PreparedWeights were prepared from");
  const attngrad::PreparedWeights moved = std::move(prepared);
  EXPECT_TRUE(moved.ready());
  EXPECT_FALSE(prepared.ready());  // NOLINT(bugprone-use-after-move): moved-from is empty
  status = attngrad::BackwardDevice(prepared, 1, 64, scalars, precision, false, device.Inputs(),
                                    device.Outputs(), workspace.get(), bytes, nullptr);
  EXPECT_NE(status.code, ATTNGRAD_OK);
  status = attngrad::BackwardDevice(moved, 1, 64, scalars, precision, false, device.Inputs(),
                                    device.Outputs(), workspace.get(), bytes - 1, nullptr);
  EXPECT_EQ(status.code, ATTNGRAD_WORKSPACE_TOO_SMALL);
  ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
