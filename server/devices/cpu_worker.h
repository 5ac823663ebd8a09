// The CPU device worker: attngrad::BackwardHost on host memory. Its resident weights are the shared
// fp32 master copy itself (nothing to upload); its accumulators are host arrays.
#ifndef ATTNGRAD_SERVER_CPU_WORKER_H_
#define ATTNGRAD_SERVER_CPU_WORKER_H_

#include <memory>

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

  std::shared_ptr<const LayerWeights> weights_;
  const int num_threads_;
  LayerTensors accumulators_;
  LayerTensors scratch_;  // weight gradients of duplicates, dropped
  long long accumulated_batches_ = 0;
  long long accumulated_tokens_ = 0;
  long long memory_total_bytes_ = 0;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_CPU_WORKER_H_
