// The CPU device worker: attngrad::BackwardHost (FORWARD batches: attngrad::ForwardHost) on host
// memory. Its resident weights are the shared fp32 master copies themselves (every served layer;
// nothing to upload); its accumulator sets are host arrays per layer, allocated when a batch or a
// control first addresses them.
#ifndef ATTNGRAD_SERVER_CPU_WORKER_H_
#define ATTNGRAD_SERVER_CPU_WORKER_H_

#include <memory>
#include <vector>

#include "scheduling/device_worker.h"

namespace attngrad::server {

class CpuWorker final : public DeviceWorker {
 public:
  // num_threads: BackwardHost's thread count (0 = all hardware threads).
  CpuWorker(LayerSlots layers, int num_threads, ServerMetrics* metrics);
  ~CpuWorker() override;

  DeviceDescription Describe() const override;

 private:
  absl::Status Initialize() override;
  void Run() override;
  // The batch's stages: its inputs decoded (and checked finite) into hidden_states_ /
  // grad_output_, then the forward or the backward, whose answer is encoded into job.result.answer.
  void Compute(BatchJob& job);
  absl::Status DecodeInputs(BatchJob& job);
  absl::Status ComputeForward(BatchJob& job);
  absl::Status ComputeBackward(BatchJob& job);
  // Where a backward batch's weight gradients go: returned_gradients_ (RETURN, zeroed) or the
  // layer's scratch.
  LayerTensors* WeightGradientsOf(BatchJob& job, const LayerConfig& config);
  void EncodeBackwardAnswer(BatchJob& job, const LayerConfig& config);
  void UpdateMemoryUsed();
  void Control(WorkerControl& control);

  struct AccumulatorSet {
    LayerTensors gradients;
    long long batches = 0;
    long long tokens = 0;
  };
  AccumulatorSet& AccumulatorSetAt(int layer_slot, int index);

  LayerSlots layers_;
  const int num_threads_;
  // Per layer slot, per set; gradients empty until first used.
  std::vector<std::vector<AccumulatorSet>> accumulator_sets_;
  std::vector<LayerTensors> scratch_;  // per slot: weight gradients of duplicates, dropped
  // The batch being computed: its activations decoded to fp32, its outputs before they are
  // encoded into the answer (kept between batches, grown as they need).
  std::vector<float> hidden_states_, grad_output_, grad_hidden_states_;
  std::vector<float> output_;        // FORWARD
  LayerTensors returned_gradients_;  // RETURN
  // The answers' memory, reused once gRPC has sent them (see AnswerBuffer).
  std::shared_ptr<common::BufferPool> answer_pool_ = common::BufferPool::Create(kAnswerPoolBytes);
  long long memory_total_bytes_ = 0;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_CPU_WORKER_H_
