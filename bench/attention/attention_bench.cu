// Device-side harness for the attention kernels alone (kernels/src/cuda/attention_*.cu): checks the
// forward (O, lse) and backward (dq', dk', dv) of every operand mode against a float64 evaluation
// of SPEC section 2 steps 4 and 6 on the GPU (naive kernels), checks determinism and that every
// output element is written, then times the forward and the backward on the 16 SPEC workload
// shapes.
//
// Build (here, no GPU needed):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Ikernels/include -Ikernels/src \
//     bench/attention/attention_bench.cu kernels/src/cuda/attention_forward.cu \
//     kernels/src/cuda/attention_backward.cu kernels/src/cuda/attention_backward_short.cu \
//     kernels/src/cuda/attention_forward_hopper.cu kernels/src/cuda/attention_backward_hopper.cu \
//     -o build-attn/attention_bench   (or the CMake target attngrad_attention_bench)
// Run: attention_bench [--check-only | --time-only] [--fp16-only] [--short-tiles]  (--fp16-only:
// the fp16 checks and the fp16 timing of the 16 workloads alone; --short-tiles: also the
// backward's tile choices at S <= 256)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../bench_check.h"
#include "attngrad/cuda_resources.h"
#include "cuda/attention.h"

using attngrad::cuda::AttentionForwardPath;
using attngrad::cuda::AttentionOperand;
using attngrad::cuda::AttentionProblem;
using attngrad::cuda::AttentionScores;
using attngrad::cuda::AttentionTiles;

namespace {

constexpr int kNumHeads = 24, kNumKvHeads = 8, kHeadDim = 128;
constexpr int kQkvWidth = (kNumHeads + 2 * kNumKvHeads) * kHeadDim;  // 5120, as the pipeline
constexpr int kOutWidth = kNumHeads * kHeadDim;

#define STATUS_CHECK(expr)                                                                 \
  do {                                                                                     \
    attngrad_status status_ = (expr);                                                      \
    if (status_ != ATTNGRAD_OK) {                                                          \
      std::fprintf(stderr, "%s:%d: %s returned %d\n", __FILE__, __LINE__, #expr, status_); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

// ---- float64 reference kernels (one block of 128 threads per row / key)
// ----------------------------
__device__ double BlockReduce(double value, bool is_max, double* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const double other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = is_max ? fmax(value, other) : value + other;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = value;
  __syncthreads();
  double result = scratch[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
    result = is_max ? fmax(result, scratch[w]) : result + scratch[w];
  __syncthreads();
  return result;
}

struct RefArgs {
  const double* qkv;   // [B*S, 5120]
  const double* dout;  // [B*S, 3072]
  double* out;         // [B*S, 3072]
  double* lse;         // [B, 24, S]
  double* delta;       // [B, 24, S]
  double* dq;          // [B*S, 3072]
  double* dk;          // [B*S, 1024]
  double* dv;          // [B*S, 1024]
  int batch, seq_len;
  double scaling, cap;
};

__device__ double Capped(const RefArgs& a, double s, double* t_out) {
  const double x = s * a.scaling;
  if (a.cap > 0) {
    const double t = tanh(x / a.cap);
    if (t_out) *t_out = t;
    return a.cap * t;
  }
  if (t_out) *t_out = 0;
  return x;
}

__global__ void RefForward(RefArgs a) {
  extern __shared__ double shared[];
  double* scores = shared;             // [S]
  double* q_row = scores + a.seq_len;  // [128]
  __shared__ double scratch[4];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / 3;
  const long long t0 = (long long)b * a.seq_len;
  q_row[threadIdx.x] = a.qkv[(t0 + i) * kQkvWidth + h * 128 + threadIdx.x];
  __syncthreads();
  double local_max = -1e300;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) {
    const double* k = a.qkv + (t0 + j) * kQkvWidth + 3072 + kvh * 128;
    double s = 0;
    for (int d = 0; d < 128; ++d) s += q_row[d] * k[d];
    scores[j] = Capped(a, s, nullptr);
    local_max = fmax(local_max, scores[j]);
  }
  const double row_max = BlockReduce(local_max, true, scratch);
  double local_sum = 0;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) local_sum += exp(scores[j] - row_max);
  const double lse = row_max + log(BlockReduce(local_sum, false, scratch));
  for (int j = threadIdx.x; j <= i; j += blockDim.x) scores[j] = exp(scores[j] - lse);
  __syncthreads();
  double o = 0;
  for (int j = 0; j <= i; ++j)
    o += scores[j] * a.qkv[(t0 + j) * kQkvWidth + 4096 + kvh * 128 + threadIdx.x];
  a.out[(t0 + i) * kOutWidth + h * 128 + threadIdx.x] = o;
  if (threadIdx.x == 0) a.lse[((long long)b * kNumHeads + h) * a.seq_len + i] = lse;
}

__global__ void RefQueryGradient(RefArgs a) {
  extern __shared__ double shared[];
  double* ds = shared;             // [S]
  double* q_row = ds + a.seq_len;  // [128]
  double* do_row = q_row + 128;    // [128]
  __shared__ double scratch[4];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / 3;
  const long long t0 = (long long)b * a.seq_len;
  const long long stat = ((long long)b * kNumHeads + h) * a.seq_len + i;
  q_row[threadIdx.x] = a.qkv[(t0 + i) * kQkvWidth + h * 128 + threadIdx.x];
  do_row[threadIdx.x] = a.dout[(t0 + i) * kOutWidth + h * 128 + threadIdx.x];
  const double delta = BlockReduce(
      do_row[threadIdx.x] * a.out[(t0 + i) * kOutWidth + h * 128 + threadIdx.x], false, scratch);
  if (threadIdx.x == 0) a.delta[stat] = delta;
  const double lse = a.lse[stat];
  for (int j = threadIdx.x; j <= i; j += blockDim.x) {
    const double* k = a.qkv + (t0 + j) * kQkvWidth + 3072 + kvh * 128;
    const double* v = a.qkv + (t0 + j) * kQkvWidth + 4096 + kvh * 128;
    double s = 0, dp = 0;
    for (int d = 0; d < 128; ++d) {
      s += q_row[d] * k[d];
      dp += do_row[d] * v[d];
    }
    double t;
    const double c = Capped(a, s, &t);
    const double p = exp(c - lse);
    ds[j] = p * (dp - delta) * (1 - t * t) * a.scaling;
  }
  __syncthreads();
  double dq = 0;
  for (int j = 0; j <= i; ++j)
    dq += ds[j] * a.qkv[(t0 + j) * kQkvWidth + 3072 + kvh * 128 + threadIdx.x];
  a.dq[(t0 + i) * kOutWidth + h * 128 + threadIdx.x] = dq;
}

__global__ void RefKeyValueGradient(RefArgs a) {
  extern __shared__ double shared[];
  double* p_col = shared;              // [S]
  double* ds_col = p_col + a.seq_len;  // [S]
  double* k_row = ds_col + a.seq_len;  // [128]
  double* v_row = k_row + 128;         // [128]
  const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const long long t0 = (long long)b * a.seq_len;
  k_row[threadIdx.x] = a.qkv[(t0 + j) * kQkvWidth + 3072 + kvh * 128 + threadIdx.x];
  v_row[threadIdx.x] = a.qkv[(t0 + j) * kQkvWidth + 4096 + kvh * 128 + threadIdx.x];
  __syncthreads();
  double dk = 0, dv = 0;
  for (int h = kvh * 3; h < kvh * 3 + 3; ++h) {
    for (int i = j + threadIdx.x; i < a.seq_len; i += blockDim.x) {
      const double* q = a.qkv + (t0 + i) * kQkvWidth + h * 128;
      const double* dout = a.dout + (t0 + i) * kOutWidth + h * 128;
      double s = 0, dp = 0;
      for (int d = 0; d < 128; ++d) {
        s += q[d] * k_row[d];
        dp += dout[d] * v_row[d];
      }
      const long long stat = ((long long)b * kNumHeads + h) * a.seq_len + i;
      double t;
      const double c = Capped(a, s, &t);
      const double p = exp(c - a.lse[stat]);
      p_col[i] = p;
      ds_col[i] = p * (dp - a.delta[stat]) * (1 - t * t) * a.scaling;
    }
    __syncthreads();
    for (int i = j; i < a.seq_len; ++i) {
      dv += p_col[i] * a.dout[(t0 + i) * kOutWidth + h * 128 + threadIdx.x];
      dk += ds_col[i] * a.qkv[(t0 + i) * kQkvWidth + h * 128 + threadIdx.x];
    }
    __syncthreads();
  }
  a.dk[(t0 + j) * 1024 + kvh * 128 + threadIdx.x] = dk;
  a.dv[(t0 + j) * 1024 + kvh * 128 + threadIdx.x] = dv;
}

// ---- helpers
// --------------------------------------------------------------------------------------
using attngrad::cuda::DeviceBuffer;

template <class T>
DeviceBuffer<T> Allocate(size_t count) {
  DeviceBuffer<T> buffer;
  CHECK_CUDA(DeviceBuffer<T>::Create(count, &buffer));
  return buffer;
}
template <class T>
void Upload(const DeviceBuffer<T>& buffer, const std::vector<T>& host) {
  CHECK_CUDA(cudaMemcpy(buffer.get(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
}
template <class T>
std::vector<T> Download(const DeviceBuffer<T>& buffer) {
  std::vector<T> host(buffer.size());
  CHECK_CUDA(cudaMemcpy(host.data(), buffer.get(), buffer.bytes(), cudaMemcpyDeviceToHost));
  return host;
}
template <class T>
void Poison(const DeviceBuffer<T>& buffer) {
  CHECK_CUDA(cudaMemset(buffer.get(), 0xff, buffer.bytes()));  // NaN for float
}

struct Errors {
  double rel_l2 = 0, max_rel = 0;  // max |out-ref| / max |ref|
  long long nonfinite = 0;
};

// floor: per-element magnitude below which the reference counts as 0 (dq, dk at S = 1 are exactly
// 0)
Errors Compare(const std::vector<float>& out, const std::vector<double>& ref, double floor = 1e-4) {
  double num = 0, den = 0, max_err = 0, max_ref = 0;
  Errors e;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++e.nonfinite;
      continue;
    }
    const double d = out[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    max_err = std::max(max_err, std::fabs(d));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  e.rel_l2 = std::sqrt(num / std::max(den, floor * floor * ref.size()));
  e.max_rel = max_err / std::max(max_ref, 1e-300);
  return e;
}

const char* Name(AttentionOperand op) {
  switch (op) {
    case AttentionOperand::kFp16: return "fp16";
    case AttentionOperand::kTf32: return "tf32";
    case AttentionOperand::kFp32: return "fp32";
  }
  return "?";
}

// Operands of one problem in the pipeline's layout, in the element type of the mode, plus the exact
// values as doubles for the reference.
struct Problem {
  int batch, seq_len;
  AttentionOperand op;
  size_t elem;
  DeviceBuffer<unsigned char> qkv, dout;  // element type of the mode
  DeviceBuffer<float> out, lse, dq, dk, dv;
  DeviceBuffer<__half> out_half;
  DeviceBuffer<unsigned char> workspace;
  AttentionProblem problem;

  Problem(int b, int s, AttentionOperand o, AttentionTiles tiles = AttentionTiles::kAuto)
      : batch(b),
        seq_len(s),
        op(o),
        elem(o == AttentionOperand::kFp16 ? 2 : 4),
        qkv(Allocate<unsigned char>((size_t)b * s * kQkvWidth * elem)),
        dout(Allocate<unsigned char>((size_t)b * s * kOutWidth * elem)),
        out(Allocate<float>((size_t)b * s * kOutWidth)),
        lse(Allocate<float>((size_t)b * kNumHeads * s)),
        dq(Allocate<float>((size_t)b * s * kOutWidth)),
        dk(Allocate<float>((size_t)b * s * 1024)),
        dv(Allocate<float>((size_t)b * s * 1024)),
        out_half(Allocate<__half>((size_t)b * s * kOutWidth)),
        workspace(Allocate<unsigned char>(WorkspaceFor(b, s, o, tiles))) {
    problem.tiles = tiles;
    problem.batch = b;
    problem.seq_len = s;
    problem.num_heads = kNumHeads;
    problem.num_kv_heads = kNumKvHeads;
    problem.scaling = 1.f / std::sqrt(128.f);
    problem.softcap = 50.f;
    problem.operand = o;
  }
  static size_t WorkspaceFor(int b, int s, AttentionOperand o, AttentionTiles tiles) {
    AttentionProblem p;
    p.tiles = tiles;
    p.batch = b;
    p.seq_len = s;
    p.num_heads = kNumHeads;
    p.num_kv_heads = kNumKvHeads;
    p.operand = o;
    return attngrad::cuda::AttentionBackwardWorkspaceSize(p);
  }
  const unsigned char* Q() const { return qkv.get(); }
  const unsigned char* K() const { return qkv.get() + 3072 * elem; }
  const unsigned char* V() const { return qkv.get() + 4096 * elem; }
  attngrad_status Forward(cudaStream_t stream) {
    return attngrad::cuda::AttentionForward(
        problem, Q(), kQkvWidth, K(), V(), kQkvWidth, out.get(),
        op == AttentionOperand::kFp16 ? out_half.get() : nullptr, lse.get(), stream);
  }
  attngrad_status Backward(cudaStream_t stream) {
    return attngrad::cuda::AttentionBackward(
        problem, Q(), kQkvWidth, K(), V(), kQkvWidth, out.get(), dout.get(), kOutWidth, lse.get(),
        dq.get(), dk.get(), dv.get(), workspace.get(), workspace.size(), stream);
  }
};

// Fills the operands with the benchmark's magnitudes: q', k' ~ N(0,1) (unit RMS after RMSNorm),
// v ~ N(0, 0.0255^2) (X Wv^T), dO ~ N(0, 1.4^2) (dY Wo); `scale_scores` multiplies q' to try
// sharper softmaxes. Returns the exact values (after rounding to the element type) as doubles.
void Fill(Problem& pr, std::mt19937_64& rng, double q_scale, std::vector<double>* qkv_exact,
          std::vector<double>* dout_exact) {
  std::normal_distribution<double> normal(0.0, 1.0);
  const size_t tokens = (size_t)pr.batch * pr.seq_len;
  qkv_exact->assign(tokens * kQkvWidth, 0.0);
  dout_exact->assign(tokens * kOutWidth, 0.0);
  for (size_t r = 0; r < tokens; ++r) {
    for (int c = 0; c < kQkvWidth; ++c) {
      double scale = c < 3072 ? q_scale : c < 4096 ? 1.0 : 0.0255;
      (*qkv_exact)[r * kQkvWidth + c] = normal(rng) * scale;
    }
    for (int c = 0; c < kOutWidth; ++c) (*dout_exact)[r * kOutWidth + c] = normal(rng) * 1.4;
  }
  auto upload = [&](std::vector<double>& exact, DeviceBuffer<unsigned char>& buffer) {
    if (pr.elem == 2) {
      std::vector<__half> h(exact.size());
      for (size_t i = 0; i < exact.size(); ++i) {
        h[i] = __double2half(exact[i]);
        exact[i] = (double)__half2float(h[i]);
      }
      CHECK_CUDA(cudaMemcpy(buffer.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    } else {
      std::vector<float> f(exact.size());
      for (size_t i = 0; i < exact.size(); ++i) {
        f[i] = (float)exact[i];
        exact[i] = f[i];
      }
      CHECK_CUDA(cudaMemcpy(buffer.get(), f.data(), f.size() * 4, cudaMemcpyHostToDevice));
    }
  };
  upload(*qkv_exact, pr.qkv);
  upload(*dout_exact, pr.dout);
}

const char* TilesName(AttentionTiles t) {
  switch (t) {
    case AttentionTiles::kAuto: return "auto";
    case AttentionTiles::kSmall: return "small";
    case AttentionTiles::kSmallSplit: return "split";
    case AttentionTiles::kShort: return "short";
    case AttentionTiles::kShortSplit: return "shortsplit";
    case AttentionTiles::kShortGrid: return "shortgrid";
  }
  return "?";
}

bool Check(int batch, int seq_len, AttentionOperand op, double q_scale, std::mt19937_64& rng,
           AttentionTiles tiles = AttentionTiles::kAuto) {
  Problem pr(batch, seq_len, op, tiles);
  std::vector<double> qkv_exact, dout_exact;
  Fill(pr, rng, q_scale, &qkv_exact, &dout_exact);
  const size_t tokens = (size_t)batch * seq_len;
  const DeviceBuffer<double> qkv_d = Allocate<double>(qkv_exact.size());
  const DeviceBuffer<double> dout_d = Allocate<double>(dout_exact.size());
  Upload(qkv_d, qkv_exact);
  Upload(dout_d, dout_exact);
  const DeviceBuffer<double> out_r = Allocate<double>(tokens * kOutWidth);
  const DeviceBuffer<double> lse_r = Allocate<double>((size_t)batch * kNumHeads * seq_len);
  const DeviceBuffer<double> delta_r = Allocate<double>((size_t)batch * kNumHeads * seq_len);
  const DeviceBuffer<double> dq_r = Allocate<double>(tokens * kOutWidth);
  const DeviceBuffer<double> dk_r = Allocate<double>(tokens * 1024);
  const DeviceBuffer<double> dv_r = Allocate<double>(tokens * 1024);
  RefArgs args{qkv_d.get(),   dout_d.get(), out_r.get(),        lse_r.get(),
               delta_r.get(), dq_r.get(),   dk_r.get(),         dv_r.get(),
               batch,         seq_len,      pr.problem.scaling, pr.problem.softcap};
  dim3 grid_q(seq_len, kNumHeads, batch), grid_kv(seq_len, kNumKvHeads, batch);
  CHECK_CUDA(cudaFuncSetAttribute(RefForward, cudaFuncAttributeMaxDynamicSharedMemorySize, 100000));
  CHECK_CUDA(
      cudaFuncSetAttribute(RefQueryGradient, cudaFuncAttributeMaxDynamicSharedMemorySize, 100000));
  CHECK_CUDA(cudaFuncSetAttribute(RefKeyValueGradient, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  100000));
  RefForward<<<grid_q, 128, (seq_len + 128) * 8>>>(args);
  CHECK_CUDA(cudaGetLastError());
  RefQueryGradient<<<grid_q, 128, (seq_len + 256) * 8>>>(args);
  CHECK_CUDA(cudaGetLastError());
  RefKeyValueGradient<<<grid_kv, 128, (2 * seq_len + 256) * 8>>>(args);
  CHECK_CUDA(cudaGetLastError());

  Poison(pr.out);
  Poison(pr.lse);
  Poison(pr.dq);
  Poison(pr.dk);
  Poison(pr.dv);
  STATUS_CHECK(pr.Forward(0));
  STATUS_CHECK(pr.Backward(0));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto out = Download(pr.out), lse = Download(pr.lse), dq = Download(pr.dq),
             dk = Download(pr.dk), dv = Download(pr.dv);
  // determinism: backward again (poisoned), bitwise equal
  Poison(pr.dq);
  Poison(pr.dk);
  Poison(pr.dv);
  STATUS_CHECK(pr.Backward(0));
  CHECK_CUDA(cudaDeviceSynchronize());
  const bool deterministic = std::memcmp(Download(pr.dq).data(), dq.data(), dq.size() * 4) == 0 &&
                             std::memcmp(Download(pr.dk).data(), dk.data(), dk.size() * 4) == 0 &&
                             std::memcmp(Download(pr.dv).data(), dv.data(), dv.size() * 4) == 0;
  const Errors e_out = Compare(out, Download(out_r)), e_lse = Compare(lse, Download(lse_r)),
               e_dq = Compare(dq, Download(dq_r), 1e-3), e_dk = Compare(dk, Download(dk_r), 1e-3),
               e_dv = Compare(dv, Download(dv_r));
  const double bound = op == AttentionOperand::kFp32   ? 2e-5
                       : op == AttentionOperand::kTf32 ? 3e-3
                                                       : 6e-3;
  bool ok = deterministic;
  for (const Errors* e : {&e_out, &e_lse, &e_dq, &e_dk, &e_dv})
    ok = ok && e->nonfinite == 0 && e->rel_l2 < bound;
  std::printf(
      "check %-4s %-5s B=%-2d S=%-5d qscale=%.1f | rel_l2 O %.2e lse %.2e dq %.2e dk %.2e dv %.2e "
      "| "
      "maxrel dq %.1e dk %.1e dv %.1e | nonfinite %lld | determ %s | %s\n",
      Name(op), TilesName(tiles), batch, seq_len, q_scale, e_out.rel_l2, e_lse.rel_l2, e_dq.rel_l2,
      e_dk.rel_l2, e_dv.rel_l2, e_dq.max_rel, e_dk.max_rel, e_dv.max_rel,
      e_out.nonfinite + e_lse.nonfinite + e_dq.nonfinite + e_dk.nonfinite + e_dv.nonfinite,
      deterministic ? "yes" : "NO", ok ? "PASS" : "FAIL");
  std::fflush(stdout);
  return ok;
}

double MedianMs(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Captures `body` on `stream` into a graph (global capture mode, as a caller of the pipeline
// would), replays it and returns the median GPU time of one replay in microseconds.
template <class Body>
double GraphMedianUs(cudaStream_t stream, Body body, int reps) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  body();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  attngrad::cuda::Event start, stop;
  CHECK_CUDA(attngrad::cuda::Event::Create(&start));
  CHECK_CUDA(attngrad::cuda::Event::Create(&stop));
  const cudaEvent_t e0 = start.get(), e1 = stop.get();
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    times.push_back(ms);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return MedianMs(times) * 1e3;
}

double Time(int batch, int seq_len, AttentionOperand op, std::mt19937_64& rng, int reps,
            AttentionTiles tiles = AttentionTiles::kAuto) {
  Problem pr(batch, seq_len, op, tiles);
  std::vector<double> a, b;
  Fill(pr, rng, 1.0, &a, &b);
  attngrad::cuda::Stream owned_stream;
  CHECK_CUDA(attngrad::cuda::Stream::Create(&owned_stream));
  const cudaStream_t stream = owned_stream.get();
  STATUS_CHECK(pr.Forward(stream));
  STATUS_CHECK(pr.Backward(stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double f_us = GraphMedianUs(
      stream, [&] { STATUS_CHECK(pr.Forward(stream)); }, reps);
  const double b_us = GraphMedianUs(
      stream, [&] { STATUS_CHECK(pr.Backward(stream)); }, reps);
  if (op == AttentionOperand::kFp16) {  // each forward kernel on its own (same call, same data)
    double path_us[3] = {0, 0, 0};
    const AttentionForwardPath paths[3] = {AttentionForwardPath::kPortable,
                                           AttentionForwardPath::kHopper,
                                           AttentionForwardPath::kShort};
    for (int i = 0; i < (seq_len <= 256 ? 3 : 2); ++i) {
      pr.problem.forward_path = paths[i];
      path_us[i] = GraphMedianUs(
          stream, [&] { STATUS_CHECK(pr.Forward(stream)); }, reps);
    }
    pr.problem.forward_path = AttentionForwardPath::kAuto;
    // The backward with dS stored (5 products) and recomputed (7), same call and data.
    double scores_us[2];
    const AttentionScores modes[2] = {AttentionScores::kStored, AttentionScores::kRecomputed};
    for (int i = 0; i < 2; ++i) {
      pr.problem.scores = modes[i];
      scores_us[i] = GraphMedianUs(
          stream, [&] { STATUS_CHECK(pr.Backward(stream)); }, reps);
    }
    pr.problem.scores = AttentionScores::kAuto;
    std::printf("backward fp16 B=%-2d S=%-5d dS stored %8.1f us  recomputed %8.1f us\n", batch,
                seq_len, scores_us[0], scores_us[1]);
    std::printf(
        "forward fp16 B=%-2d S=%-5d portable %8.1f us  hopper %8.1f us (%5.1f TFLOP/s)  short "
        "%8.1f us\n",
        batch, seq_len, path_us[0], path_us[1],
        2 * 2 * (double)batch * kNumHeads * 128.0 * seq_len * (seq_len + 1) / 2.0 /
            (path_us[1] * 1e-6) / 1e12,
        path_us[2]);
  }
  // causal MACs of one S x S x 128 product over all query heads (diagonal included)
  const double macs = (double)batch * kNumHeads * 128.0 * seq_len * (seq_len + 1) / 2.0;
  std::printf(
      "time %-4s %-5s B=%-2d S=%-5d fwd %8.1f us (%5.1f TFLOP/s)  bwd %8.1f us (%5.1f TFLOP/s of 5 "
      "products, %5.1f of 7 done)  total %8.1f us\n",
      Name(op), TilesName(tiles), batch, seq_len, f_us, 2 * 2 * macs / (f_us * 1e-6) / 1e12, b_us,
      2 * 5 * macs / (b_us * 1e-6) / 1e12, 2 * 7 * macs / (b_us * 1e-6) / 1e12, f_us + b_us);
  std::fflush(stdout);
  return f_us + b_us;
}

}  // namespace

int main(int argc, char** argv) {
  bool check = true, timing = true, fp16_only = false, short_tiles = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--check-only")) timing = false;
    if (!std::strcmp(argv[i], "--time-only")) check = false;
    if (!std::strcmp(argv[i], "--fp16-only")) fp16_only = true;
    if (!std::strcmp(argv[i], "--short-tiles")) short_tiles = true;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::mt19937_64 rng(20261129);
  int failures = 0;
  if (check) {
    const int shapes[][2] = {{1, 1}, {1, 7}, {2, 33}, {1, 128}, {2, 541}, {1, 2048}};
    for (AttentionOperand op :
         {AttentionOperand::kFp32, AttentionOperand::kTf32, AttentionOperand::kFp16}) {
      if (fp16_only && op != AttentionOperand::kFp16) continue;
      for (const auto& s : shapes) failures += !Check(s[0], s[1], op, 1.0, rng);
      failures += !Check(2, 541, op, 1.0, rng, AttentionTiles::kSmall);
    }
    failures += !Check(2, 541, AttentionOperand::kFp16, 1.0, rng, AttentionTiles::kSmallSplit);
    failures += !Check(3, 200, AttentionOperand::kFp16, 1.0, rng, AttentionTiles::kShort);
    failures += !Check(2, 256, AttentionOperand::kFp16, 4.0, rng, AttentionTiles::kShortSplit);
    failures += !Check(3, 200, AttentionOperand::kFp16, 4.0, rng, AttentionTiles::kShortGrid);
    // sharper softmax (larger logits, near the cap) and a batch of 2 at S=2048
    failures += !Check(1, 300, AttentionOperand::kFp16, 4.0, rng);
    if (!fp16_only) failures += !Check(1, 300, AttentionOperand::kTf32, 4.0, rng);
    failures += !Check(2, 2048, AttentionOperand::kFp16, 1.0, rng);
  }
  if (timing) {
    const int workloads[][2] = {{1, 128},  {1, 256},  {1, 512},  {1, 2048}, {2, 512},  {2, 541},
                                {2, 1024}, {2, 2048}, {4, 128},  {4, 256},  {4, 1024}, {8, 128},
                                {8, 512},  {16, 256}, {32, 128}, {64, 256}};
    for (AttentionOperand op : {AttentionOperand::kFp16, AttentionOperand::kTf32}) {
      if (fp16_only && op != AttentionOperand::kFp16) continue;
      double log_sum = 0;
      for (const auto& w : workloads) log_sum += std::log(Time(w[0], w[1], op, rng, 20));
      std::printf("geomean %s fwd+bwd over the 16 workloads: %.1f us\n", Name(op),
                  std::exp(log_sum / 16));
    }
    if (short_tiles) {  // the backward's choices at S <= 256, same call
      const int short_workloads[][2] = {{1, 128}, {4, 128}, {8, 128},  {32, 128},
                                        {1, 256}, {4, 256}, {16, 256}, {64, 256}};
      for (const auto& w : short_workloads) {
        for (AttentionTiles t : {AttentionTiles::kSmall, AttentionTiles::kSmallSplit,
                                 AttentionTiles::kShortSplit, AttentionTiles::kShortGrid}) {
          Time(w[0], w[1], AttentionOperand::kFp16, rng, 10, t);
        }
      }
    }
    if (fp16_only) {
      std::printf("%s: %d check failures\n", failures ? "FAIL" : "OK", failures);
      return failures ? 1 : 0;
    }
    const int variants[][2] = {{1, 128},  {1, 512}, {1, 2048}, {2, 1024},
                               {2, 2048}, {8, 512}, {64, 256}};
    for (const auto& w : variants) {
      for (AttentionTiles t : {AttentionTiles::kSmall, AttentionTiles::kSmallSplit}) {
        Time(w[0], w[1], AttentionOperand::kFp16, rng, 10, t);
      }
    }
    // Short sequences: the tiled kernels against the whole-sequence ones.
    const int short_workloads[][2] = {{1, 128}, {4, 128}, {8, 128},  {32, 128},
                                      {1, 256}, {4, 256}, {16, 256}, {64, 256}};
    for (const auto& w : short_workloads) {
      for (AttentionTiles t :
           {AttentionTiles::kSmall, AttentionTiles::kSmallSplit, AttentionTiles::kShort,
            AttentionTiles::kShortSplit, AttentionTiles::kShortGrid}) {
        Time(w[0], w[1], AttentionOperand::kFp16, rng, 10, t);
      }
    }
    Time(2, 2048, AttentionOperand::kFp32, rng, 3);
  }
  std::printf("%s: %d check failures\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
