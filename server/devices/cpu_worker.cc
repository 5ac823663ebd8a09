// CPU worker: synchronous BackwardHost (or, FORWARD batches, ForwardHost) per batch. The
// activations are decoded from the received bytes (fp16/bf16 widened) on this thread, and the
// answer encoded in the response dtype here.
#include "devices/cpu_worker.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "attngrad/common/status_macros.h"
#include "attngrad/forward.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"
#include "scheduling/nonfinite_gradients.h"

namespace attngrad::server {
namespace {

// sums[w] += addends[w], element-wise.
void AddTo(LayerTensors& sums, const LayerTensors& addends) {
  for (Weight weight : kAllWeights) {
    std::vector<float>& sum = sums[weight];
    const std::vector<float>& addend = addends[weight];
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += addend[i];
  }
}

}  // namespace

CpuWorker::CpuWorker(LayerSlots layers, int num_threads, ServerMetrics* metrics)
    : DeviceWorker("cpu", metrics, 1), layers_(std::move(layers)), num_threads_(num_threads) {}

CpuWorker::~CpuWorker() { StopAndJoin(); }

absl::Status CpuWorker::Initialize() {
  scratch_.resize(layers_.size());
  accumulator_sets_.resize(layers_.size());
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  memory_total_bytes_ = pages > 0 && page_size > 0 ? static_cast<long long>(pages) * page_size : 0;
  metrics()->DeviceMemoryTotal(device()).Set(static_cast<double>(memory_total_bytes_));
  metrics()->DeviceMemoryUsed(device()).Set(0);
  return absl::OkStatus();
}

CpuWorker::AccumulatorSet& CpuWorker::AccumulatorSetAt(int layer_slot, int index) {
  const std::size_t position = static_cast<std::size_t>(std::max(0, index));
  std::vector<AccumulatorSet>& sets = accumulator_sets_[static_cast<std::size_t>(layer_slot)];
  if (sets.size() <= position) sets.resize(position + 1);
  AccumulatorSet& set = sets[position];
  if (set.gradients[Weight::kQProj].empty()) {
    set.gradients =
        ZeroWeights<std::vector<float>>(layers_[static_cast<std::size_t>(layer_slot)]->config);
  }
  return set;
}

DeviceDescription CpuWorker::Describe() const {
  DeviceDescription description;
  description.index = 0;
  description.name = "cpu";
  description.backend = "cpu";
  description.memory_total_bytes = memory_total_bytes_;
  return description;
}

void CpuWorker::Run() {
  while (std::optional<Item> item = Pop(/*wait=*/true)) {
    if (item->job != nullptr) {
      if (SkipIfUnobservable(item->job)) continue;
      Compute(*item->job);
      FinishJob(std::move(item->job));
    } else {
      Control(*item->control);
    }
  }
}

void CpuWorker::Compute(BatchJob& job) {
  const auto start = std::chrono::steady_clock::now();
  job.result.stages.queue = std::chrono::duration<double>(start - job.result.submitted).count();
  job.result.status = DecodeInputs(job);
  if (job.result.status.ok()) {
    job.result.status = job.forward() ? ComputeForward(job) : ComputeBackward(job);
  }
  job.result.stages.compute = SecondsSince(start);
  UpdateMemoryUsed();
}

absl::Status CpuWorker::DecodeInputs(BatchJob& job) {
  const std::size_t activations = job.activations();
  hidden_states_.resize(activations);
  absl::Status status = job.request.hidden_states.DecodeFinite(0, absl::MakeSpan(hidden_states_),
                                                               "hidden_states.raw_data");
  if (status.ok() && !job.forward()) {  // a FORWARD batch has no grad_output
    grad_output_.resize(activations);
    status = job.request.grad_output.DecodeFinite(0, absl::MakeSpan(grad_output_),
                                                  "grad_output.raw_data");
  }
  // The received bytes are no longer needed.
  job.request.hidden_states = WireTensor();
  job.request.grad_output = WireTensor();
  job.arrival.request_reservation.Release();
  return status;
}

absl::Status CpuWorker::ComputeForward(BatchJob& job) {
  const LayerWeights& weights = *layers_[static_cast<std::size_t>(job.request.layer_slot)];
  ForwardInputs in;
  in.hidden_states = hidden_states_.data();
  in.cos = job.request.cos.data();
  in.sin = job.request.sin.data();
  in.weights = DataOf(weights.values);
  output_.resize(job.activations());
  ATTNGRAD_RETURN_IF_ERROR(
      KernelStatus(ForwardHost(weights.config, job.request.batch, job.request.seq_len,
                               job.request.scalars, in, output_.data(), num_threads_),
                   "ForwardHost"));
  ATTNGRAD_RETURN_IF_ERROR(NonFiniteOutputStatus(CountNonFiniteValues(output_)));
  // The answer: the output alone, in the response dtype.
  job.result.answer.size = job.AnswerBytes();
  job.result.answer.bytes = answer_pool_->Acquire(job.result.answer.size);
  wire::EncodeFromFloat(output_, job.request.response_dtype, job.result.answer.bytes.data());
  return absl::OkStatus();
}

LayerTensors* CpuWorker::WeightGradientsOf(BatchJob& job, const LayerConfig& config) {
  const std::size_t slot = static_cast<std::size_t>(job.request.layer_slot);
  if (!job.request.return_weight_gradients) {  // scratch: dropped, or added once known to be finite
    if (scratch_[slot][Weight::kQProj].empty()) {
      scratch_[slot] = ZeroWeights<std::vector<float>>(config);
    }
    return &scratch_[slot];
  }
  if (returned_gradients_[Weight::kQProj].size() != WeightElements(config, Weight::kQProj) ||
      returned_gradients_[Weight::kQNorm].size() != WeightElements(config, Weight::kQNorm)) {
    returned_gradients_ = ZeroWeights<std::vector<float>>(config);
  } else {
    for (std::vector<float>& tensor : returned_gradients_) {
      std::fill(tensor.begin(), tensor.end(), 0.f);
    }
  }
  return &returned_gradients_;
}

absl::Status CpuWorker::ComputeBackward(BatchJob& job) {
  const LayerWeights& weights = *layers_[static_cast<std::size_t>(job.request.layer_slot)];
  const LayerConfig& config = weights.config;
  grad_hidden_states_.assign(job.activations(), 0.f);
  LayerTensors* gradients = WeightGradientsOf(job, config);
  const bool add = job.admission.accumulate && !job.request.return_weight_gradients;
  AccumulatorSet* accumulator_set =
      add ? &AccumulatorSetAt(job.request.layer_slot, job.admission.accumulator_set) : nullptr;
  BackwardInputs in;
  in.weights = DataOf(weights.values);
  in.grad_output = grad_output_.data();
  in.hidden_states = hidden_states_.data();
  in.cos = job.request.cos.data();
  in.sin = job.request.sin.data();
  BackwardOutputs out;
  out.grad_hidden_states = grad_hidden_states_.data();
  out.weight_gradients = DataOf(*gradients);
  // An ACCUMULATE batch is computed into scratch and added only once its gradients are known to be
  // finite (nonfinite_gradients.h), so a refused batch leaves the accumulators as they were.
  ATTNGRAD_RETURN_IF_ERROR(
      KernelStatus(BackwardHost(config, job.request.batch, job.request.seq_len, job.request.scalars,
                                /*accumulate=*/false, in, out, num_threads_),
                   "BackwardHost"));
  NonFiniteCounts counts = CountNonFiniteHost(grad_hidden_states_, *gradients);
  if (add) CountOverflowingSumsHost(accumulator_set->gradients, *gradients, &counts);
  ATTNGRAD_RETURN_IF_ERROR(NonFiniteGradientsStatus(counts));
  if (add) {
    AddTo(accumulator_set->gradients, *gradients);
    ++accumulator_set->batches;
    accumulator_set->tokens += job.tokens();
  }
  EncodeBackwardAnswer(job, config);
  return absl::OkStatus();
}

void CpuWorker::EncodeBackwardAnswer(BatchJob& job, const LayerConfig& config) {
  // grad_hidden_states, then (RETURN) the weight gradients, in the response dtype.
  job.result.answer.size = job.AnswerBytes();
  job.result.answer.bytes = answer_pool_->Acquire(job.result.answer.size);
  char* answer = job.result.answer.bytes.data();
  const std::size_t element_size = wire::DTypeSize(job.request.response_dtype);
  wire::EncodeFromFloat(grad_hidden_states_, job.request.response_dtype, answer);
  if (!job.request.return_weight_gradients) return;
  const PackedWeightLayout layout(config);
  for (Weight weight : kAllWeights) {
    wire::EncodeFromFloat(returned_gradients_[weight], job.request.response_dtype,
                          answer + (job.activations() + layout.offsets[weight]) * element_size);
  }
}

void CpuWorker::UpdateMemoryUsed() {
  // "Device memory used" of the CPU backend: this process's resident set.
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  long long total_pages = 0, resident_pages = 0;
  if (statm != nullptr) {
    if (std::fscanf(statm, "%lld %lld", &total_pages, &resident_pages) == 2) {
      metrics()->DeviceMemoryUsed(device()).Set(static_cast<double>(resident_pages) *
                                                static_cast<double>(sysconf(_SC_PAGESIZE)));
    }
    std::fclose(statm);
  }
}

void CpuWorker::Control(WorkerControl& control) {
  if (control.new_weights != nullptr) {
    layers_[static_cast<std::size_t>(control.layer_slot)] = control.new_weights;
  }
  AccumulatorSnapshot snapshot;
  if (control.read_accumulators || control.zero_accumulators) {
    AccumulatorSet& set = AccumulatorSetAt(control.layer_slot, control.accumulator_set);
    snapshot.batches = set.batches;
    snapshot.tokens = set.tokens;
    if (control.read_accumulators) snapshot.gradients = set.gradients;
    if (control.zero_accumulators) {
      for (std::vector<float>& tensor : set.gradients) std::fill(tensor.begin(), tensor.end(), 0.f);
      set.batches = 0;
      set.tokens = 0;
    }
  }
  FinishControl(control, absl::OkStatus(), std::move(snapshot));
}

}  // namespace attngrad::server
