// attngrad_bench: times attngrad_backward on the 16 SPEC workloads the SPEC section 5 way — L2
// flushed (a buffer of twice the L2 size written) before every iteration, 10 warm-up and 50 timed
// iterations, CUDA events around the call, median — and prints per workload the median µs, T_SOL,
// the ratio to SOL and the achieved TFLOP/s, then the geometric means. With --stages it also times
// each pipeline stage (events recorded between stages, everything on one stream) to say where the
// time goes. With --timeline it also replays the real two-stream schedule as a graph with an event
// after each stage on its stream and prints when each stage ended (the critical path). With
// --memory-rates it first measures the memory's write and copy rates (the byte floors' rates). With
// --host-ahead it also reports how long the host takes to enqueue one call and the call's time when
// the GPU is held busy (a spin kernel after the flush) until the whole call is enqueued: the
// difference to the median is time the GPU waited for the host. With --prepared the weights are
// prepared once per workload (attngrad/prepared_weights.h, outside the timed calls) and every call
// reads their fp16 copies instead of converting the weights (what a server with resident weights
// does); the rest of the timing is unchanged.
//
// Usage: attngrad_bench [--precision=auto|fp16|tf32|fp32] [--prepared] [--stages] [--timeline]
//                       [--host-ahead] [--memory-rates]
//                       [--warmup=10] [--iters=50] [--workloads=B:S,B:S,...]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "attngrad/attngrad.h"
#include "attngrad/backward.h"
#include "attngrad/cuda_resources.h"
#include "attngrad/layer_weights.h"
#include "attngrad/prepared_weights.h"
#include "bench_check.h"
#include "cuda/pipeline.h"
#include "cuda/projection_gemm.h"  // SideStream

namespace {

constexpr int kHidden = 3072;
constexpr int kQOut = 3072;
constexpr int kKvOut = 1024;
constexpr int kHeadDim = 128;

// Counter-based normal random numbers (splitmix64 + Box-Muller), so inputs are drawn on the device.
__device__ unsigned long long SplitMix(unsigned long long x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void FillNormal(float* data, std::size_t count, float scale, unsigned long long seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const unsigned long long bits = SplitMix(seed * 0x100000001B3ull + i);
    const float u1 = ((bits >> 40) + 1.0f) / 16777217.0f;
    const float u2 = ((bits & 0xFFFFFFull) + 0.5f) / 16777216.0f;
    data[i] = scale * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
  }
}

// cos/sin of SPEC section 3: positions 0..S-1, theta 10000, embedding [f, f], same for every batch.
// Holds the GPU for about `nanoseconds` (one thread).
__global__ void Spin(long long nanoseconds) {
  long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

__global__ void FillRotary(float* cos_out, float* sin_out, int batch, int seq_len) {
  const std::size_t count = static_cast<std::size_t>(batch) * seq_len * kHeadDim;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i % kHeadDim);
    const int position = static_cast<int>((i / kHeadDim) % seq_len);
    const double inv_freq = pow(10000.0, -2.0 * (d % 64) / 128.0);
    const double angle = position * inv_freq;
    cos_out[i] = static_cast<float>(cos(angle));
    sin_out[i] = static_cast<float>(sin(angle));
  }
}

using attngrad::kAllWeights;
using attngrad::PerWeight;
using attngrad::Weight;
using attngrad::cuda::DeviceBuffer;
using attngrad::cuda::Event;

// `count` elements on the device (exits on failure).
template <typename T>
DeviceBuffer<T> Allocate(std::size_t count) {
  DeviceBuffer<T> buffer;
  CHECK_CUDA(DeviceBuffer<T>::Create(count, &buffer));
  return buffer;
}

Event TimingEvent() {
  Event event;
  CHECK_CUDA(Event::Create(&event));
  return event;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The median time in ms of `operation` between two events on `stream` over `iters` runs after
// `warmup` more; `before(i)` runs ahead of run i, outside the events (the L2 flush).
template <class Before, class Operation>
double MedianEventMs(cudaStream_t stream, int warmup, int iters, Before before,
                     Operation operation) {
  const Event start = TimingEvent(), stop = TimingEvent();
  std::vector<double> times;
  for (int i = 0; i < warmup + iters; ++i) {
    before(i);
    CHECK_CUDA(cudaEventRecord(start.get(), stream));
    operation();
    CHECK_CUDA(cudaEventRecord(stop.get(), stream));
    CHECK_CUDA(cudaEventSynchronize(stop.get()));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    if (i >= warmup) times.push_back(ms);
  }
  return Median(times);
}

double Sol(int batch, int seq_len, double* macs_out) {
  const double tokens = static_cast<double>(batch) * seq_len;
  const double macs =
      tokens * 66060288.0 + static_cast<double>(batch) * seq_len * seq_len * 18432.0;
  const double weights = 2.0 * kHidden * kQOut + 2.0 * kKvOut * kHidden;
  const double elements = tokens * kHidden * 3 + tokens * kHeadDim * 2 + 2 * weights + 4 * kHeadDim;
  if (macs_out) *macs_out = macs;
  return std::max(macs / 494.7e12, elements * 2.0 / 4.8e12);
}

// Records an event after every stage of one call; stage names in order. Without `side` the
// pipeline serialises its stages on the caller's stream (--stages); with it the call runs its real
// two-stream schedule while the caller's stream is being captured, the events (on the stream each
// stage ran on) becoming record nodes of the graph, whose replays then say when each stage ended
// (--timeline); the names then say the stream.
class EventObserver : public attngrad::cuda::StageObserver {
 public:
  explicit EventObserver(std::vector<cudaEvent_t>* events,
                         const attngrad::cuda::SideStream* side = nullptr)
      : events_(events), side_(side) {}
  bool overlapped() const override { return side_ != nullptr; }
  void StageDone(const char* stage, cudaStream_t stream) override {
    if (next_ >= events_->size()) return;
    if (side_ == nullptr) {
      CHECK_CUDA(cudaEventRecord((*events_)[next_++], stream));
      names.push_back(stage);
      return;
    }
    CHECK_CUDA(cudaEventRecordWithFlags((*events_)[next_++], stream, cudaEventRecordExternal));
    names.push_back(std::string(stage) + (stream == side_->stream() ? "(side)" : "(lane)"));
  }
  std::vector<std::string> names;

 private:
  std::vector<cudaEvent_t>* events_;
  const attngrad::cuda::SideStream* side_;
  std::size_t next_ = 0;
};

// `count` timing events, owned by `owned`, and their handles.
std::vector<cudaEvent_t> TimingEvents(int count, std::vector<Event>* owned) {
  std::vector<cudaEvent_t> events;
  for (int i = 0; i < count; ++i) {
    owned->push_back(TimingEvent());
    events.push_back(owned->back().get());
  }
  return events;
}

struct Options {
  int precision = ATTNGRAD_PRECISION_AUTO;
  bool prepared = false;
  bool stages = false;
  bool timeline = false;
  bool memory_rates = false;
  bool host_ahead = false;
  int warmup = 10;
  int iters = 50;
  std::vector<std::pair<int, int>> workloads = {
      {1, 128}, {1, 256}, {1, 512},  {1, 2048}, {2, 512}, {2, 541},  {2, 1024}, {2, 2048},
      {4, 128}, {4, 256}, {4, 1024}, {8, 128},  {8, 512}, {16, 256}, {32, 128}, {64, 256}};
};

Options Parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&arg](const char* prefix) -> const char* {
      const std::size_t n = std::strlen(prefix);
      return arg.compare(0, n, prefix) == 0 ? arg.c_str() + n : nullptr;
    };
    if (const char* v = value("--precision=")) {
      const std::string p = v;
      options.precision = p == "fp16"   ? ATTNGRAD_PRECISION_FP16
                          : p == "tf32" ? ATTNGRAD_PRECISION_TF32
                          : p == "fp32" ? ATTNGRAD_PRECISION_FP32
                                        : ATTNGRAD_PRECISION_AUTO;
    } else if (arg == "--prepared") {
      options.prepared = true;
    } else if (arg == "--stages") {
      options.stages = true;
    } else if (arg == "--timeline") {
      options.timeline = true;
    } else if (arg == "--memory-rates") {
      options.memory_rates = true;
    } else if (arg == "--host-ahead") {
      options.host_ahead = true;
    } else if (const char* v = value("--warmup=")) {
      options.warmup = std::atoi(v);
    } else if (const char* v = value("--iters=")) {
      options.iters = std::atoi(v);
    } else if (const char* v = value("--workloads=")) {
      options.workloads.clear();
      std::string list = v;
      std::size_t start = 0;
      while (start < list.size()) {
        std::size_t end = list.find(',', start);
        if (end == std::string::npos) end = list.size();
        const std::string item = list.substr(start, end - start);
        const std::size_t colon = item.find(':');
        if (colon != std::string::npos) {
          options.workloads.emplace_back(std::atoi(item.c_str()),
                                         std::atoi(item.c_str() + colon + 1));
        }
        start = end + 1;
      }
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      std::exit(2);
    }
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = Parse(argc, argv);
  if (attngrad_device_count() < 1) {
    std::fprintf(stderr, "attngrad_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp properties{};
  CHECK_CUDA(cudaGetDeviceProperties(&properties, 0));
  std::printf("device: %s, %d SMs, L2 %d MiB; precision %d; weights %s\n", properties.name,
              properties.multiProcessorCount, properties.l2CacheSize >> 20, options.precision,
              options.prepared ? "prepared once (--prepared)" : "converted per call");
  const std::size_t flush_bytes = 2 * static_cast<std::size_t>(properties.l2CacheSize);
  const DeviceBuffer<unsigned char> flush = Allocate<unsigned char>(flush_bytes);
  attngrad::cuda::Stream owned_stream;
  CHECK_CUDA(attngrad::cuda::Stream::Create(&owned_stream));
  const cudaStream_t stream = owned_stream.get();

  if (options.memory_rates) {
    // The memory's own rates for the byte floors: a pure write stream (cudaMemsetAsync) and a
    // device-to-device copy (read + write), 1 GiB each, medians of 20.
    const std::size_t bytes = std::size_t{1} << 30;
    const DeviceBuffer<unsigned char> from = Allocate<unsigned char>(bytes),
                                      to = Allocate<unsigned char>(bytes);
    const auto nothing_before = [](int) {};
    auto rate = [&](auto operation) {  // seconds
      return 1e-3 * MedianEventMs(stream, 5, 20, nothing_before, operation);
    };
    const double write = rate([&] { CHECK_CUDA(cudaMemsetAsync(to.get(), 1, bytes, stream)); });
    const double copy = rate([&] {
      CHECK_CUDA(cudaMemcpyAsync(to.get(), from.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    std::printf(
        "memory: write %.2f TB/s (cudaMemsetAsync), copy %.2f TB/s read + write "
        "(cudaMemcpyAsync, 2 bytes moved per byte copied)\n",
        bytes / write / 1e12, 2.0 * bytes / copy / 1e12);
  }

  std::printf("%5s %5s %11s %9s %7s %8s\n", "B", "S", "median_us", "sol_us", "x_sol", "TFLOP/s");
  double log_time = 0, log_sol = 0;
  std::map<std::string, std::vector<double>> stage_log;  // stage -> per-workload median share
  std::vector<std::string> stage_order;
  std::vector<std::string> stage_rows;
  std::vector<std::string> timeline_rows;
  for (const std::pair<int, int>& workload : options.workloads) {
    const int batch = workload.first, seq_len = workload.second;  // captured by the lambdas below
    const std::size_t tokens = static_cast<std::size_t>(batch) * seq_len;
    const std::size_t activations = tokens * kHidden;
    const std::size_t rotary = tokens * kHeadDim;
    const attngrad::LayerConfig config = attngrad::LayerConfig::Gemma3_4B();
    const DeviceBuffer<float> x = Allocate<float>(activations), dy = Allocate<float>(activations),
                              cos_buffer = Allocate<float>(rotary),
                              sin_buffer = Allocate<float>(rotary),
                              dx = Allocate<float>(activations);
    PerWeight<DeviceBuffer<float>> weights, weight_gradients;
    for (Weight weight : kAllWeights) {
      weights[weight] = Allocate<float>(attngrad::WeightElements(config, weight));
      weight_gradients[weight] = Allocate<float>(attngrad::WeightElements(config, weight));
    }
    const unsigned long long seed = 1000ull * batch + seq_len;
    FillNormal<<<1024, 256, 0, stream>>>(x.get(), activations, 1.f / std::sqrt(3072.f), seed + 1);
    FillNormal<<<1024, 256, 0, stream>>>(dy.get(), activations, 1.f, seed + 2);
    const float w_scale = std::sqrt(2.f / 3072.f);
    for (Weight weight : kAllWeights) {  // seeds + 3 .. + 8 in SPEC order
      const bool norm = weight == Weight::kQNorm || weight == Weight::kKNorm;
      const std::size_t count = weights[weight].size();
      FillNormal<<<norm ? 1 : 1024, norm ? 128 : 256, 0, stream>>>(
          weights[weight].get(), count, norm ? 0.02f : w_scale,
          seed + 3 + attngrad::IndexOf(weight));
    }
    FillRotary<<<256, 256, 0, stream>>>(cos_buffer.get(), sin_buffer.get(), batch, seq_len);
    CHECK_CUDA(cudaGetLastError());
    const auto precision = static_cast<attngrad::Precision>(options.precision);
    attngrad::PreparedWeights prepared;
    if (options.prepared) {
      PerWeight<const float*> sources;
      for (Weight weight : kAllWeights) sources[weight] = weights[weight].get();
      const attngrad::Status status = prepared.Prepare(config, sources, stream);
      if (!status.ok()) {
        std::fprintf(stderr, "Prepare: %s\n", status.message);
        return 1;
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    const std::size_t workspace_bytes =
        options.prepared ? attngrad::DeviceWorkspaceSize(prepared, batch, seq_len, precision)
                         : attngrad_workspace_size(batch, seq_len, options.precision);
    const DeviceBuffer<unsigned char> workspace = Allocate<unsigned char>(workspace_bytes);

    attngrad::BackwardInputs in;
    in.grad_output = dy.get();
    in.hidden_states = x.get();
    in.cos = cos_buffer.get();
    in.sin = sin_buffer.get();
    attngrad::BackwardOutputs out;
    out.grad_hidden_states = dx.get();
    for (Weight weight : kAllWeights) {
      in.weights[weight] = weights[weight].get();
      out.weight_gradients[weight] = weight_gradients[weight].get();
    }

    // Timed through the public entry point (what a caller gets, graph replay of repeated calls
    // included); with a stage observer through the pipeline itself, everything on one stream.
    const attngrad::PreparedWeights* prepared_weights = options.prepared ? &prepared : nullptr;
    auto call = [&](attngrad::cuda::StageObserver* observer) {
      attngrad::Status status;
      if (observer != nullptr) {
        status = attngrad::cuda::RunBackwardPipeline(
            config, batch, seq_len, attngrad::Scalars{}, precision, /*accumulate=*/false, in, out,
            workspace.get(), workspace_bytes, stream, observer, /*side=*/nullptr, prepared_weights);
      } else if (prepared_weights != nullptr) {
        status = attngrad::BackwardDevice(*prepared_weights, batch, seq_len, attngrad::Scalars{},
                                          precision, /*accumulate=*/false, in, out, workspace.get(),
                                          workspace_bytes, stream);
      } else {
        status = attngrad::BackwardDevice(config, batch, seq_len, attngrad::Scalars{}, precision,
                                          /*accumulate=*/false, in, out, workspace.get(),
                                          workspace_bytes, stream);
      }
      if (!status.ok()) {
        std::fprintf(stderr, "B=%d S=%d: %s: %s\n", batch, seq_len,
                     attngrad_status_string(status.code), status.message);
        std::exit(1);
      }
    };
    const double median =  // µs
        MedianEventMs(
            stream, options.warmup, options.iters,
            [&](int i) { CHECK_CUDA(cudaMemsetAsync(flush.get(), i & 0xff, flush_bytes, stream)); },
            [&] { call(nullptr); }) *
        1e3;
    double macs = 0;
    const double sol = Sol(batch, seq_len, &macs) * 1e6;
    std::printf("%5d %5d %11.1f %9.1f %7.2f %8.1f\n", batch, seq_len, median, sol, median / sol,
                2.0 * macs / (median * 1e-6) / 1e12);
    std::fflush(stdout);
    log_time += std::log(median);
    log_sol += std::log(sol);
    const Event start = TimingEvent(), stop = TimingEvent();  // the host-ahead and stage timings

    if (options.host_ahead) {
      std::vector<double> enqueue_us, gpu_only_us;
      for (int i = 0; i < options.warmup + options.iters; ++i) {
        CHECK_CUDA(cudaMemsetAsync(flush.get(), i & 0xff, flush_bytes, stream));
        Spin<<<1, 1, 0, stream>>>(2000000);  // 2 ms: far more than one call takes to enqueue
        CHECK_CUDA(cudaEventRecord(start.get(), stream));
        const auto host_start = std::chrono::steady_clock::now();
        call(nullptr);
        const auto host_end = std::chrono::steady_clock::now();
        CHECK_CUDA(cudaEventRecord(stop.get(), stream));
        CHECK_CUDA(cudaEventSynchronize(stop.get()));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start.get(), stop.get()));
        if (i < options.warmup) continue;
        gpu_only_us.push_back(ms * 1e3);
        enqueue_us.push_back(
            std::chrono::duration<double, std::micro>(host_end - host_start).count());
      }
      std::printf(
          "      host-ahead: enqueue %.1f us on the host, %.1f us on the GPU when enqueued ahead "
          "(%.1f us less than the median)\n",
          Median(enqueue_us), Median(gpu_only_us), median - Median(gpu_only_us));
      std::fflush(stdout);
    }

    if (options.stages) {
      std::vector<Event> owned_events;
      std::vector<cudaEvent_t> events = TimingEvents(16, &owned_events);
      std::map<std::string, std::vector<double>> per_stage;
      std::vector<std::string> names;
      for (int i = 0; i < options.warmup / 2 + options.iters / 2; ++i) {
        CHECK_CUDA(cudaMemsetAsync(flush.get(), i & 0xff, flush_bytes, stream));
        CHECK_CUDA(cudaEventRecord(start.get(), stream));
        EventObserver observer(&events);
        call(&observer);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        names = observer.names;
        if (i < options.warmup / 2) continue;
        cudaEvent_t previous = start.get();
        for (std::size_t s = 0; s < names.size(); ++s) {
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, previous, events[s]));
          per_stage[names[s]].push_back(ms * 1e3);
          previous = events[s];
        }
      }
      std::string row = std::to_string(batch) + "x" + std::to_string(seq_len) + ":";
      for (const auto& name : names) {
        char cell[96];
        std::snprintf(cell, sizeof cell, " %s=%.1f", name.c_str(), Median(per_stage[name]));
        row += cell;
      }
      stage_rows.push_back(row);
    }

    if (options.timeline) {
      // The pipeline with its real streams captured once into a graph (as repeated calls replay
      // it), an event after each stage; per replay every stage's end, from the call's start.
      attngrad::cuda::SideStream side;
      if (side.Init() != ATTNGRAD_OK) {
        std::fprintf(stderr, "timeline: side streams could not be created\n");
        return 1;
      }
      std::vector<Event> owned_events;
      std::vector<cudaEvent_t> events = TimingEvents(24, &owned_events);
      EventObserver observer(&events, &side);
      CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      CHECK_CUDA(cudaEventRecordWithFlags(start.get(), stream, cudaEventRecordExternal));
      const attngrad::Status status = attngrad::cuda::RunBackwardPipeline(
          config, batch, seq_len, attngrad::Scalars{}, precision, /*accumulate=*/false, in, out,
          workspace.get(), workspace_bytes, stream, &observer, &side, prepared_weights);
      CHECK_CUDA(cudaEventRecordWithFlags(stop.get(), stream, cudaEventRecordExternal));
      cudaGraph_t graph = nullptr;
      CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
      if (!status.ok()) {
        std::fprintf(stderr, "timeline: %s\n", status.message);
        return 1;
      }
      cudaGraphExec_t exec = nullptr;
      CHECK_CUDA(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority));
      std::vector<std::vector<double>> ends(observer.names.size());
      std::vector<double> totals;
      for (int i = 0; i < options.warmup + options.iters; ++i) {
        CHECK_CUDA(cudaMemsetAsync(flush.get(), i & 0xff, flush_bytes, stream));
        CHECK_CUDA(cudaGraphLaunch(exec, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        if (i < options.warmup) continue;
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start.get(), stop.get()));
        totals.push_back(ms * 1e3);
        for (std::size_t s = 0; s < observer.names.size(); ++s) {
          CHECK_CUDA(cudaEventElapsedTime(&ms, start.get(), events[s]));
          ends[s].push_back(ms * 1e3);
        }
      }
      CHECK_CUDA(cudaGraphExecDestroy(exec));
      CHECK_CUDA(cudaGraphDestroy(graph));
      std::vector<std::pair<double, std::string>> rows;
      for (std::size_t s = 0; s < observer.names.size(); ++s) {
        rows.emplace_back(Median(ends[s]), observer.names[s]);
      }
      std::sort(rows.begin(), rows.end());
      std::string row = std::to_string(batch) + "x" + std::to_string(seq_len) +
                        " (stage ends, us from the start; total " +
                        std::to_string(static_cast<int>(Median(totals) + 0.5)) + "):";
      for (const auto& [end, name] : rows) {
        char cell[96];
        std::snprintf(cell, sizeof cell, " %s=%.1f", name.c_str(), end);
        row += cell;
      }
      timeline_rows.push_back(row);
    }
  }
  const double n = static_cast<double>(options.workloads.size());
  std::printf("geomean: %.1f us, SOL %.1f us, x_sol %.2f\n", std::exp(log_time / n),
              std::exp(log_sol / n), std::exp((log_time - log_sol) / n));
  if (options.stages) {
    std::printf("per-stage medians (us):\n");
    for (const auto& row : stage_rows) std::printf("  %s\n", row.c_str());
  }
  if (options.timeline) {
    std::printf("timeline (the real schedule replayed as a graph; medians):\n");
    for (const auto& row : timeline_rows) std::printf("  %s\n", row.c_str());
  }
  return 0;
}
