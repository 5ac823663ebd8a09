// CopyWeightsFromDevice: one server-owned allocation per upload on the sources' GPU, a
// device-to-device copy (or a widening kernel for fp16/bf16) per weight and the device finite
// check, all on a stream of the call's own, waited for before the weights are handed out.
#include "devices/device_weights.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/cuda_resources.h"
#include "attngrad/finite_check.h"
#include "devices/cuda_status.h"
#include "devices/wire_convert.h"

namespace attngrad::server {
namespace {

class OwnedDeviceWeights final : public DeviceLayerWeights {
 public:
  OwnedDeviceWeights(int cuda_device, cuda::DeviceBuffer<float> buffer)
      : cuda_device_(cuda_device), buffer_(std::move(buffer)) {}
  ~OwnedDeviceWeights() override {
    // The last holder may be any thread, with another current device.
    cudaSetDevice(cuda_device_);
  }
  int cuda_device() const override { return cuda_device_; }
  const float* data() const override { return buffer_.get(); }

 private:
  const int cuda_device_;
  cuda::DeviceBuffer<float> buffer_;
};

// The sources' one GPU; INVALID_ARGUMENT naming the region of a weight on another (or on none).
absl::StatusOr<int> DeviceOfSources(const PerWeight<DeviceWeightSource>& sources) {
  const int device = sources[Weight::kQProj].bytes.cuda_device();
  for (Weight weight : kAllWeights) {
    if (sources[weight].bytes.cuda_device() < 0 || sources[weight].bytes.cuda_device() != device) {
      return absl::InvalidArgumentError(
          absl::StrCat(WeightModuleName(weight),
                       ".region: the weights by reference must all lie in GPU memory "
                       "of one device (q_proj's is on cuda device ",
                       device, ")"));
    }
  }
  return device;
}

absl::Status QueueWidenedCopy(const DeviceWeightSource& source, std::size_t elements,
                              float* destination, cudaStream_t stream) {
  if (source.dtype == v1::DTYPE_FLOAT32) {
    return CudaStatus(cudaMemcpyAsync(destination, source.bytes.data, elements * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream),
                      "cudaMemcpyAsync(weights by reference)");
  }
  const HalfFormat format =
      source.dtype == v1::DTYPE_BFLOAT16 ? HalfFormat::kBFloat16 : HalfFormat::kFloat16;
  return CudaStatus(WidenToFloat(reinterpret_cast<const std::uint16_t*>(source.bytes.data), format,
                                 elements, destination, stream),
                    "WidenToFloat(weights by reference)");
}

// INVALID_ARGUMENT naming the first weight that holds NaN or Inf, after the copies on `stream`.
absl::Status CheckFiniteOnDevice(const LayerConfig& config, const PackedWeightLayout& layout,
                                 const float* weights, cudaStream_t stream) {
  cuda::DeviceBuffer<unsigned long long> counts;
  ATTNGRAD_CUDA_RETURN(cuda::DeviceBuffer<unsigned long long>::Create(kCheckedCounts, &counts));
  ATTNGRAD_CUDA_RETURN(
      cudaMemsetAsync(counts.get(), 0, kCheckedCounts * sizeof(unsigned long long), stream));
  const Status counted =
      CountNonFiniteDevice(config, nullptr, 0, layout.Pointers(weights), counts.get(), stream);
  if (!counted.ok()) return absl::InternalError(absl::StrCat("finite check: ", counted.message));
  NonFiniteCounts host{};
  ATTNGRAD_CUDA_RETURN(
      cudaMemcpyAsync(host.data(), counts.get(), sizeof(host), cudaMemcpyDeviceToHost, stream));
  ATTNGRAD_CUDA_RETURN(cudaStreamSynchronize(stream));
  for (Weight weight : kAllWeights) {
    if (host[CountIndexOf(weight)] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(WeightModuleName(weight), ".region: ", host[CountIndexOf(weight)],
                       " NaN or infinite values; nothing was changed"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const DeviceLayerWeights>> CopyWeightsFromDevice(
    const LayerConfig& config, const PerWeight<DeviceWeightSource>& sources) {
  ATTNGRAD_ASSIGN_OR_RETURN(const int device, DeviceOfSources(sources));
  ATTNGRAD_CUDA_RETURN(cudaSetDevice(device));
  const PackedWeightLayout layout(config);
  cuda::DeviceBuffer<float> buffer;
  if (cuda::DeviceBuffer<float>::Create(layout.total_elements, &buffer) != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("weights by reference: no room on cuda device ", device, " for a copy of ",
                     layout.total_elements * sizeof(float), " bytes"));
  }
  cuda::Stream stream;
  ATTNGRAD_CUDA_RETURN(cuda::Stream::Create(&stream));
  for (Weight weight : kAllWeights) {
    ATTNGRAD_RETURN_IF_ERROR(QueueWidenedCopy(sources[weight], WeightElements(config, weight),
                                              buffer.get() + layout.offsets[weight], stream.get()));
  }
  ATTNGRAD_RETURN_IF_ERROR(CheckFiniteOnDevice(config, layout, buffer.get(), stream.get()));
  return std::shared_ptr<const DeviceLayerWeights>(
      std::make_shared<OwnedDeviceWeights>(device, std::move(buffer)));
}

absl::Status CopyToDeviceMemory(const RegionBytes& destination, const void* source,
                                std::size_t bytes) {
  ATTNGRAD_CUDA_RETURN(cudaSetDevice(destination.cuda_device()));
  ATTNGRAD_CUDA_RETURN(cudaMemcpy(destination.data, source, bytes, cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return before the DMA lands (on the legacy stream): the
  // client reads the memory as soon as it is answered.
  ATTNGRAD_CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy));
  return absl::OkStatus();
}

}  // namespace attngrad::server
