// gemm_algos: for every projection GEMM of the FP16 pipeline (SPEC section 2 steps 1, 5 and 9, the
// shapes backward_device.cu runs) at the 16 SPEC workloads, times each algorithm cuBLASLt's
// heuristic offers (its ranked list, up to 32), the way attngrad_bench times a call (L2 flushed
// before every iteration, warm-up, median of the timed iterations), and prints the heuristic's
// first choice next to the fastest one and that one's configuration. It says how much a tuned
// choice could save per workload; it changes nothing in the library.
//
// With --from-fp32 it instead compares, per workload, the FP16 pipeline's GEMMs on fp16 copies
// (plus the per-call conversion that makes them) with the same products on the fp32 tensors that
// cuBLASLt rounds to fp16 itself (CUBLAS_COMPUTE_32F_FAST_16F; separate Wq/Wk/Wv products).
//
// With --search it goes beyond the heuristic's list: every algorithm cuBLASLt has for these types
// (cublasLtMatmulAlgoGetIds), each tile it offers, split-K 1-16 with the deterministic reduction
// schemes (in place, or in the compute type in the workspace), and the heuristic's own choices
// with added split-K; each candidate cuBLASLt's check accepts is timed briefly, the six fastest
// and the heuristic's first again with --iters, and the fastest is printed as a GemmAlgorithm.
//
// Usage: gemm_algos [--workloads=B:S,...] [--iters=20] [--ranks=32] [--from-fp32 | --search]
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attngrad/cuda_resources.h"
#include "bench_check.h"
#include "cuda/projection_gemm.h"
#include "cuda/stages.h"

namespace {

using attngrad::cuda::GemmAlgorithm;
using attngrad::cuda::GemmArithmetic;
using attngrad::cuda::GemmPlan;
using attngrad::cuda::GemmSpec;

constexpr int kHidden = 3072, kQWidth = 3072, kKvWidth = 1024, kQkvWidth = 5120;

using Buffer = attngrad::cuda::DeviceBuffer<unsigned char>;

// `bytes` of device memory (exits on failure).
Buffer Bytes(std::size_t bytes) {
  Buffer buffer;
  CHECK_CUDA(Buffer::Create(bytes, &buffer));
  return buffer;
}

// The GEMMs of one FP16 call with T tokens (operands are uninitialised scratch of the right size:
// timing does not depend on the values' magnitudes beyond NaN-free, so they are zeroed).
struct NamedGemm {
  std::string name;
  GemmSpec spec;
};

// An fp16 GEMM spec (column-major, as projection_gemm.h describes it).
GemmSpec HalfSpec(bool transpose_a, bool transpose_b, int m, int n, int k, const void* a, int lda,
                  const void* b, int ldb, void* d, int ldd, bool d_is_half = false) {
  GemmSpec spec;
  spec.arithmetic = GemmArithmetic::kFp16;
  spec.transpose_a = transpose_a;
  spec.transpose_b = transpose_b;
  spec.m = m;
  spec.n = n;
  spec.k = k;
  spec.a = a;
  spec.lda = lda;
  spec.b = b;
  spec.ldb = ldb;
  spec.d = d;
  spec.ldd = ldd;
  spec.d_is_half = d_is_half;
  return spec;
}

std::vector<NamedGemm> PipelineGemms(int tokens, void* weights_half, void* activations_half,
                                     void* grad_qkv_half, void* output) {
  std::vector<NamedGemm> gemms;
  // qkv = X [Wq;Wk;Wv]^T
  gemms.push_back({"qkv", HalfSpec(true, false, kQkvWidth, tokens, kHidden, weights_half, kHidden,
                                   activations_half, kHidden, output, kQkvWidth)});
  // dA = dY Wo (fp16 out)
  gemms.push_back({"grad_attn", HalfSpec(false, false, kQWidth, tokens, kHidden, weights_half,
                                         kQWidth, activations_half, kHidden, output, kQWidth,
                                         /*d_is_half=*/true)});
  // dWo = dY^T A
  gemms.push_back({"grad_o", HalfSpec(false, true, kQWidth, kHidden, tokens, activations_half,
                                      kQWidth, activations_half, kHidden, output, kQWidth)});
  // dX = dqkv [Wq;Wk;Wv]
  gemms.push_back({"grad_x", HalfSpec(false, false, kHidden, tokens, kQkvWidth, weights_half,
                                      kHidden, grad_qkv_half, kQkvWidth, output, kHidden)});
  // dWq, dWk (dWv has dWk's shape) = dqkv[:, rows]^T X
  for (int rows : {kQWidth, kKvWidth}) {
    gemms.push_back({rows == kQWidth ? "grad_wq" : "grad_wk(x2)",
                     HalfSpec(false, true, kHidden, rows, tokens, activations_half, kHidden,
                              grad_qkv_half, kQkvWidth, output, kHidden)});
  }
  return gemms;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

std::string Initializer(const GemmAlgorithm& a) {
  char text[160];
  std::snprintf(text, sizeof text, "{%d, %u, %u, %d, %u, %u, %u, %u, %u}", a.id, a.tile, a.stages,
                a.split_k, a.reduction, a.swizzle, a.custom, static_cast<unsigned>(a.cluster),
                static_cast<unsigned>(a.inner_shape));
  return text;
}

bool SameAlgorithm(const GemmAlgorithm& x, const GemmAlgorithm& y) {
  return x.id == y.id && x.tile == y.tile && x.stages == y.stages && x.split_k == y.split_k &&
         x.reduction == y.reduction && x.swizzle == y.swizzle && x.custom == y.custom &&
         x.cluster == y.cluster && x.inner_shape == y.inner_shape;
}

// Candidates for one fp16 GEMM: the heuristic's list, that list with split-K added, and every
// algorithm id x tile x split-K cuBLASLt knows for these types (stages, cluster left to it).
std::vector<GemmAlgorithm> SearchCandidates(cublasLtHandle_t handle, const GemmSpec& spec) {
  std::vector<GemmAlgorithm> candidates;
  auto add = [&candidates](const GemmAlgorithm& a) {
    for (const GemmAlgorithm& seen : candidates) {
      if (SameAlgorithm(seen, a)) return;
    }
    candidates.push_back(a);
  };
  const int split_ks[] = {2, 3, 4, 6, 8, 12, 16};
  const std::uint32_t reductions[] = {CUBLASLT_REDUCTION_SCHEME_INPLACE,
                                      CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
  std::vector<GemmAlgorithm> heuristic;
  for (int rank = 0; rank < GemmPlan::kMaxHeuristicRank; ++rank) {
    GemmPlan plan;
    if (plan.Init(handle, spec, 256, rank) != ATTNGRAD_OK) break;
    heuristic.push_back(GemmAlgorithm::Of(plan.algo()));
    add(heuristic.back());
  }
  for (const GemmAlgorithm& base : heuristic) {
    for (int split : split_ks) {
      for (std::uint32_t reduction : reductions) {
        GemmAlgorithm a = base;
        a.split_k = split;
        a.reduction = reduction;
        add(a);
      }
    }
  }
  const cudaDataType_t output = spec.d_is_half ? CUDA_R_16F : CUDA_R_32F;
  int ids[256];
  int id_count = 0;
  cublasLtMatmulAlgoGetIds(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16F, output,
                           output, 256, ids, &id_count);
  for (int i = 0; i < id_count; ++i) {
    cublasLtMatmulAlgo_t algo;
    if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16F,
                               output, output, ids[i], &algo) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    std::size_t written = 0;
    std::uint32_t tiles[128];
    std::vector<std::uint32_t> tile_list = {0};
    if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, tiles, sizeof tiles,
                                          &written) == CUBLAS_STATUS_SUCCESS &&
        written >= sizeof(std::uint32_t)) {
      tile_list.assign(tiles, tiles + written / sizeof(std::uint32_t));
    }
    for (std::uint32_t tile : tile_list) {
      GemmAlgorithm a;
      a.id = ids[i];
      a.tile = tile;
      add(a);
      for (int split : {2, 4, 8}) {
        for (std::uint32_t reduction : reductions) {
          a.split_k = split;
          a.reduction = reduction;
          add(a);
        }
      }
    }
  }
  return candidates;
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<std::pair<int, int>> workloads = {
      {1, 128}, {1, 256}, {1, 512},  {1, 2048}, {2, 512}, {2, 541},  {2, 1024}, {2, 2048},
      {4, 128}, {4, 256}, {4, 1024}, {8, 128},  {8, 512}, {16, 256}, {32, 128}, {64, 256}};
  int iters = 20, ranks = GemmPlan::kMaxHeuristicRank;
  bool from_fp32 = false, search = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--from-fp32") {
      from_fp32 = true;
    } else if (arg == "--search") {
      search = true;
    } else if (arg.rfind("--iters=", 0) == 0) {
      iters = std::atoi(arg.c_str() + 8);
    } else if (arg.rfind("--ranks=", 0) == 0) {
      ranks = std::min(std::atoi(arg.c_str() + 8), GemmPlan::kMaxHeuristicRank);
    } else if (arg.rfind("--workloads=", 0) == 0) {
      workloads.clear();
      const char* cursor = arg.c_str() + 12;
      while (*cursor) {
        int b = 0, s = 0, used = 0;
        if (std::sscanf(cursor, "%d:%d%n", &b, &s, &used) != 2) break;
        workloads.emplace_back(b, s);
        cursor += used;
        if (*cursor == ',') ++cursor;
      }
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count < 1) {
    std::fprintf(stderr, "gemm_algos: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp properties{};
  CHECK_CUDA(cudaGetDeviceProperties(&properties, 0));
  std::printf("device: %s, cuBLASLt %zu\n", properties.name, cublasLtGetVersion());
  std::size_t max_tokens = 0;
  for (const auto& [b, s] : workloads) {
    max_tokens = std::max(max_tokens, static_cast<std::size_t>(b) * static_cast<std::size_t>(s));
  }
  const std::size_t flush_bytes = 2 * static_cast<std::size_t>(properties.l2CacheSize);
  const Buffer flush = Bytes(flush_bytes);
  const Buffer weights = Bytes(std::size_t{kQkvWidth} * kHidden * sizeof(__half));
  const Buffer activations = Bytes(max_tokens * kHidden * sizeof(__half));
  const Buffer grad_qkv = Bytes(max_tokens * kQkvWidth * sizeof(__half));
  const Buffer output =
      Bytes(std::max(max_tokens * kQkvWidth, std::size_t{kHidden} * kQWidth) * sizeof(float));
  const Buffer gemm_workspace = Bytes(attngrad::cuda::kGemmWorkspaceBytes);
  CHECK_CUDA(cudaMemset(weights.get(), 0, std::size_t{kQkvWidth} * kHidden * sizeof(__half)));
  CHECK_CUDA(cudaMemset(activations.get(), 0, max_tokens * kHidden * sizeof(__half)));
  CHECK_CUDA(cudaMemset(grad_qkv.get(), 0, max_tokens * kQkvWidth * sizeof(__half)));
  cublasLtHandle_t handle = nullptr;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  attngrad::cuda::Stream owned_stream;
  CHECK_CUDA(attngrad::cuda::Stream::Create(&owned_stream));
  const cudaStream_t stream = owned_stream.get();
  attngrad::cuda::Event owned_start, owned_stop;
  CHECK_CUDA(attngrad::cuda::Event::Create(&owned_start));
  CHECK_CUDA(attngrad::cuda::Event::Create(&owned_stop));
  const cudaEvent_t start = owned_start.get(), stop = owned_stop.get();

  if (from_fp32) {
    // fp32 operands: weights [5120 x 3072] (Wq|Wk|Wv rows) and [3072 x 3072] (Wo), activations.
    const Buffer weights32 = Bytes(std::size_t{kQkvWidth} * kHidden * sizeof(float));
    const Buffer wo32 = Bytes(std::size_t{kHidden} * kQWidth * sizeof(float));
    const Buffer x32 = Bytes(max_tokens * kHidden * sizeof(float));
    const Buffer qkv32 = Bytes(max_tokens * kQkvWidth * sizeof(float));
    const Buffer half_weights = Bytes(std::size_t{kQkvWidth + kHidden} * kHidden * sizeof(__half));
    CHECK_CUDA(cudaMemset(weights32.get(), 0, std::size_t{kQkvWidth} * kHidden * sizeof(float)));
    CHECK_CUDA(cudaMemset(wo32.get(), 0, std::size_t{kHidden} * kQWidth * sizeof(float)));
    CHECK_CUDA(cudaMemset(x32.get(), 0, max_tokens * kHidden * sizeof(float)));
    CHECK_CUDA(cudaMemset(qkv32.get(), 0, max_tokens * kQkvWidth * sizeof(float)));
    auto time_calls = [&](const std::function<void()>& enqueue) {
      std::vector<double> times;
      for (int i = 0; i < 3 + iters; ++i) {
        CHECK_CUDA(cudaMemsetAsync(flush.get(), i & 0xff, flush_bytes, stream));
        CHECK_CUDA(cudaEventRecord(start, stream));
        enqueue();
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 3) times.push_back(ms * 1e3);
      }
      return Median(times);
    };
    std::vector<std::unique_ptr<GemmPlan>> plans;
    auto run = [&](const GemmSpec& spec) {
      plans.push_back(std::make_unique<GemmPlan>());
      if (plans.back()->Init(handle, spec, 256) != ATTNGRAD_OK) {
        std::fprintf(stderr, "no algorithm for %dx%dx%d arithmetic %d\n", spec.m, spec.n, spec.k,
                     static_cast<int>(spec.arithmetic));
        std::exit(1);
      }
      const GemmPlan* plan = plans.back().get();
      return [plan, spec, &handle, &gemm_workspace, stream] {
        if (plan->Run(handle, spec, gemm_workspace.get(), stream) != ATTNGRAD_OK) std::exit(1);
      };
    };
    std::printf("%-7s %-10s %10s %10s\n", "BxS", "product", "fp16_us", "fp32in_us");
    for (const auto& [batch, seq_len] : workloads) {
      const int tokens = batch * seq_len;
      const std::vector<NamedGemm> half =
          PipelineGemms(tokens, weights.get(), activations.get(), grad_qkv.get(), output.get());
      // The conversion the FP16 pipeline does per call: X, dY and the 25.2 M weight elements.
      const std::size_t activation_elements = static_cast<std::size_t>(tokens) * kHidden;
      auto* half_base = reinterpret_cast<__half*>(half_weights.get());
      const attngrad::cuda::ConvertSegment segments[] = {
          {reinterpret_cast<const float*>(x32.get()), reinterpret_cast<__half*>(activations.get()),
           activation_elements, 1.f},
          {reinterpret_cast<const float*>(x32.get()), reinterpret_cast<__half*>(grad_qkv.get()),
           activation_elements, 1.f},
          {reinterpret_cast<const float*>(weights32.get()), half_base,
           std::size_t{kQkvWidth} * kHidden, 1.f},
          {reinterpret_cast<const float*>(wo32.get()), half_base + std::size_t{kQkvWidth} * kHidden,
           std::size_t{kHidden} * kQWidth, 1.f}};
      const double convert = time_calls([&] {
        if (attngrad::cuda::ConvertToHalf(segments, 4, stream) != ATTNGRAD_OK) std::exit(1);
      });
      double half_total = convert, fp32_total = 0;
      std::printf("%3dx%-4d %-10s %10.1f %10s\n", batch, seq_len, "convert", convert, "-");
      // fp32-operand forms of the same products (separate Wq, Wk, Wv as the caller stores them).
      const int rows[3] = {kQWidth, kKvWidth, kKvWidth};
      const float* w32 = reinterpret_cast<const float*>(weights32.get());
      float* qkv_out = reinterpret_cast<float*>(qkv32.get());
      for (const NamedGemm& gemm : half) {
        const double half_us = time_calls(run(gemm.spec));
        std::vector<std::function<void()>> calls;
        GemmSpec spec = gemm.spec;
        spec.arithmetic = GemmArithmetic::kFp16FromFp32;
        spec.d_is_half = false;
        if (gemm.name == "qkv") {  // three products into the columns of qkv
          int first = 0;
          for (int i = 0; i < 3; ++i) {
            GemmSpec part = spec;
            part.m = rows[i];
            part.a = w32 + static_cast<std::size_t>(first) * kHidden;
            part.b = x32.get();
            part.d = qkv_out + first;
            calls.push_back(run(part));
            first += rows[i];
          }
        } else if (gemm.name == "grad_x") {  // three products added in order
          int first = 0;
          for (int i = 0; i < 3; ++i) {
            GemmSpec part = spec;
            part.k = rows[i];
            part.a = w32 + static_cast<std::size_t>(first) * kHidden;
            part.b = qkv_out + first;
            part.beta = i == 0 ? 0.f : 1.f;
            calls.push_back(run(part));
            first += rows[i];
          }
        } else {
          spec.a = gemm.name == "grad_attn" ? wo32.get() : x32.get();
          spec.b = gemm.name == "grad_wq" || gemm.name == "grad_wk(x2)"
                       ? static_cast<const void*>(qkv_out)
                       : x32.get();
          spec.d = output.get();
          calls.push_back(run(spec));
        }
        const double fp32_us = time_calls([&] {
          for (auto& call : calls) call();
        });
        const double weight = gemm.name == "grad_wk(x2)" ? 2.0 : 1.0;
        half_total += weight * half_us;
        fp32_total += weight * fp32_us;
        std::printf("%3dx%-4d %-10s %10.1f %10.1f\n", batch, seq_len, gemm.name.c_str(), half_us,
                    fp32_us);
      }
      std::printf("%3dx%-4d %-10s %10.1f %10.1f\n", batch, seq_len, "TOTAL", half_total,
                  fp32_total);
      std::fflush(stdout);
    }
    cublasLtDestroy(handle);
    return 0;
  }

  // Times one plan the way attngrad_bench times a call; a negative time if it failed to run.
  auto time_plan = [&](const GemmPlan& plan, const GemmSpec& spec, int warmup, int timed) {
    std::vector<double> times;
    for (int i = 0; i < warmup + timed; ++i) {
      CHECK_CUDA(cudaMemsetAsync(flush.get(), i & 0xff, flush_bytes, stream));
      CHECK_CUDA(cudaEventRecord(start, stream));
      if (plan.Run(handle, spec, gemm_workspace.get(), stream) != ATTNGRAD_OK) {
        cudaGetLastError();
        return -1.0;
      }
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (i >= warmup) times.push_back(ms * 1e3);
    }
    return Median(times);
  };

  // One GEMM's outcome: the heuristic's first choice against the fastest found.
  struct Outcome {
    double first = 0, best = 0;
    int tried = 0;
    std::string best_text;
  };
  // Default mode: every rank of the heuristic's list.
  auto ranked = [&](const GemmSpec& spec) {
    Outcome outcome;
    outcome.best = 1e30;
    for (int rank = 0; rank < ranks; ++rank) {
      GemmPlan plan;
      if (plan.Init(handle, spec, 256, rank) != ATTNGRAD_OK) break;
      const double median = time_plan(plan, spec, 3, iters);
      if (median < 0) continue;
      ++outcome.tried;
      if (rank == 0) outcome.first = median;
      if (median < outcome.best) {
        outcome.best = median;
        outcome.best_text =
            "rank " + std::to_string(rank) + ": " + Initializer(GemmAlgorithm::Of(plan.algo())) +
            "  {id, tile, stages, split_k, reduction, swizzle, custom, cluster, inner}";
      }
    }
    return outcome;
  };
  // --search: every candidate timed briefly, the six fastest and the first choice again.
  auto searched = [&](const GemmSpec& spec) {
    Outcome outcome;
    std::vector<std::pair<double, GemmAlgorithm>> timed;
    for (const GemmAlgorithm& candidate : SearchCandidates(handle, spec)) {
      GemmPlan plan;
      if (plan.InitWithAlgorithm(handle, spec, candidate) != ATTNGRAD_OK) continue;
      const double us = time_plan(plan, spec, 2, 5);
      if (us > 0) timed.emplace_back(us, candidate);
    }
    std::sort(timed.begin(), timed.end(),
              [](const auto& x, const auto& y) { return x.first < y.first; });
    GemmPlan first_plan;
    if (first_plan.Init(handle, spec, 256) != ATTNGRAD_OK) std::exit(1);
    const GemmAlgorithm first_algorithm = GemmAlgorithm::Of(first_plan.algo());
    outcome.first = outcome.best = time_plan(first_plan, spec, 3, iters);
    GemmAlgorithm best_algorithm = first_algorithm;
    for (std::size_t i = 0; i < timed.size() && i < 6; ++i) {
      GemmPlan plan;
      if (plan.InitWithAlgorithm(handle, spec, timed[i].second) != ATTNGRAD_OK) continue;
      const double us = time_plan(plan, spec, 3, iters);
      if (us > 0 && us < outcome.best) {
        outcome.best = us;
        best_algorithm = timed[i].second;
      }
    }
    outcome.tried = static_cast<int>(timed.size());
    outcome.best_text =
        Initializer(best_algorithm) + "  (first " + Initializer(first_algorithm) +
        ")  {id, tile, stages, split_k, reduction, swizzle, custom, cluster, inner}";
    return outcome;
  };

  std::printf("%-7s %-12s %6s %9s %9s %6s  %s\n", "BxS", "gemm", "tried", "first_us", "best_us",
              "saved", "fastest");
  double log_ratio_sum = 0;
  for (const auto& [batch, seq_len] : workloads) {
    const int tokens = batch * seq_len;
    double first_total = 0, best_total = 0;
    for (const NamedGemm& gemm :
         PipelineGemms(tokens, weights.get(), activations.get(), grad_qkv.get(), output.get())) {
      const double weight = gemm.name == "grad_wk(x2)" ? 2.0 : 1.0;
      const Outcome outcome = search ? searched(gemm.spec) : ranked(gemm.spec);
      first_total += weight * outcome.first;
      best_total += weight * outcome.best;
      std::printf("%3dx%-4d %-12s %6d %9.1f %9.1f %5.1f%%  %s\n", batch, seq_len, gemm.name.c_str(),
                  outcome.tried, outcome.first, outcome.best,
                  100.0 * (1.0 - outcome.best / outcome.first), outcome.best_text.c_str());
      std::fflush(stdout);
    }
    std::printf("%3dx%-4d %-12s %6s %9.1f %9.1f %5.1f%%\n", batch, seq_len, "TOTAL", "",
                first_total, best_total, 100.0 * (1.0 - best_total / first_total));
    log_ratio_sum += std::log(best_total / first_total);
  }
  std::printf("geomean of best/first GEMM totals: %.3f\n",
              std::exp(log_ratio_sum / static_cast<double>(workloads.size())));
  cublasLtDestroy(handle);
  return 0;
}
