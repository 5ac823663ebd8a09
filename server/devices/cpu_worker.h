// The CPU device worker: attngrad::BackwardHost on host memory. Its resident weights are the shared
// fp32 master copy itself (nothing to upload); its accumulator sets are host arrays, allocated
// when a batch or a control first addresses them.
#ifndef ATTNGRAD_SERVER_CPU_WORKER_H_
#define ATTNGRAD_SERVER_CPU_WORKER_H_

#include <memory>
#include <vector>

#include "scheduling/device_worker.h"

namespace attngrad::server {

class CpuWorker final : public DeviceWorker {
 public:
  // num_threads: BackwardHost's thread count (0 = all hardware threads).
  CpuWorker(std::shared_ptr<const LayerWeights> weights, int num_threads, ServerMetrics* metrics);
  ~CpuWorker() override;

  DeviceDescription Describe() const override;

 private:
  absl::Status Initialize() override;
  void Run() override;
  void Compute(BatchJob& job);
  void Control(WorkerControl& control);

  struct AccumulatorSet {
    LayerTensors gradients;
    long long batches = 0;
    long long tokens = 0;
  };
  AccumulatorSet& AccumulatorSetAt(int index);

  std::shared_ptr<const LayerWeights> weights_;
  const int num_threads_;
  std::vector<AccumulatorSet> accumulator_sets_;  // gradients empty until first used
  LayerTensors scratch_;  // weight gradients of duplicates, dropped
  long long memory_total_bytes_ = 0;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_CPU_WORKER_H_
