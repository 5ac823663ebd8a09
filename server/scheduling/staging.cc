// CopyToStaging and StageOnArrival.
#include "scheduling/staging.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <tuple>
#include <vector>

#include "attngrad/common/status_macros.h"

namespace attngrad::server {

std::size_t StagedActivationTensors(const BatchJob& job) { return job.forward() ? 1 : 2; }

std::size_t StagingElements(const BatchJob& job) {
  return StagedActivationTensors(job) * job.activations() + job.request.cos.size() +
         job.request.sin.size();
}

absl::Status CopyToStaging(const BatchJob& job, float* staging, common::ParallelTasks* threads,
                           std::size_t part_bytes) {
  const std::size_t activations = job.activations();
  char* const hidden_region = reinterpret_cast<char*>(staging);
  char* const grad_region = reinterpret_cast<char*>(staging + activations);
  float* const cos_region = staging + StagedActivationTensors(job) * activations;
  float* const sin_region = cos_region + job.request.cos.size();
  struct Part {
    const WireTensor* tensor = nullptr;  // null: a rotary table
    const char* field = nullptr;
    std::size_t first = 0, count = 0;  // elements
    char* destination = nullptr;
    const std::vector<float>* table = nullptr;
  };
  std::vector<Part> parts;
  for (const auto& [tensor, field, region] :
       {std::tuple(&job.request.hidden_states, "hidden_states.raw_data", hidden_region),
        std::tuple(&job.request.grad_output, "grad_output.raw_data", grad_region)}) {
    if (tensor->cuda_device() >= 0) continue;  // GPU memory: read there by the worker
    if (tensor == &job.request.grad_output && job.forward()) continue;  // none in a FORWARD batch
    const std::size_t element_size = std::max<std::size_t>(1, tensor->element_size());
    const std::size_t per_part = std::max<std::size_t>(1, part_bytes / element_size);
    for (std::size_t first = 0; first < activations; first += per_part) {
      parts.push_back(Part{tensor, field, first, std::min(per_part, activations - first),
                           region + first * element_size, nullptr});
    }
  }
  parts.push_back(Part{nullptr, nullptr, 0, job.request.cos.size(),
                       reinterpret_cast<char*>(cos_region), &job.request.cos});
  parts.push_back(Part{nullptr, nullptr, 0, job.request.sin.size(),
                       reinterpret_cast<char*>(sin_region), &job.request.sin});
  std::vector<absl::Status> statuses(parts.size());
  auto copy_part = [&](std::size_t index) {
    const Part& part = parts[index];
    if (part.tensor == nullptr) {
      std::memcpy(part.destination, part.table->data(), part.count * sizeof(float));
      return;
    }
    statuses[index] = part.tensor->CopyFinite(part.first, part.count, part.destination, part.field);
  };
  if (threads != nullptr) {
    threads->Run(parts.size(), copy_part);
  } else {
    for (std::size_t index = 0; index < parts.size(); ++index) copy_part(index);
  }
  for (absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status StageOnArrival(common::BufferPool& pool, common::ParallelTasks& threads,
                            BatchJob& job) {
  if (job.request.hidden_states.cuda_device() >= 0 || job.request.grad_output.cuda_device() >= 0) {
    return absl::OkStatus();
  }
  const auto start = std::chrono::steady_clock::now();
  const std::size_t bytes = StagingElements(job) * sizeof(float);
  common::BufferPool::Buffer buffer = pool.Acquire(bytes);
  if (buffer.data() == nullptr) return absl::OkStatus();  // the worker stages it
  // Page-locked memory from cudaHostAlloc is page-aligned: floats may be written there.
  ATTNGRAD_RETURN_IF_ERROR(CopyToStaging(job, reinterpret_cast<float*>(buffer.data()), &threads,
                                         common::ParallelTasks::kCopyPartBytes));
  job.request.hidden_states.DropBytes();
  job.request.grad_output.DropBytes();
  job.arrival.staged_inputs = std::move(buffer);
  job.result.stages.copy_in =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return absl::OkStatus();
}

}  // namespace attngrad::server
