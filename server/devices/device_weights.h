// Weights by reference: a layer's six weights read from a same-host client's GPU memory (CUDA IPC
// regions) into GPU memory the server owns, on the GPU that holds them. The copy is checked for
// non-finite values on the device, so the client's memory is never read again once it returns:
// the client may update or free its tensors as soon as its upload is answered, and the server
// keeps serving that version if the client goes away.
#ifndef ATTNGRAD_SERVER_DEVICES_DEVICE_WEIGHTS_H_
#define ATTNGRAD_SERVER_DEVICES_DEVICE_WEIGHTS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "attngrad/backward.h"
#include "attngrad/layer_weights.h"
#include "attngrad/v1/attngrad.pb.h"
#include "rpc/regions.h"
#include "weights/served_weights.h"

namespace attngrad::server {

// One weight in a client's GPU memory: its bytes (WeightElements of `dtype`) and their dtype
// (float32, float16 or bfloat16).
struct DeviceWeightSource {
  RegionBytes bytes;
  v1::DType dtype = v1::DTYPE_FLOAT32;
};

// The six weights of `config` copied (fp16/bf16 widened) into a new server-owned fp32 allocation
// on the sources' GPU, which must be the same for all six (INVALID_ARGUMENT naming the region
// field otherwise). INVALID_ARGUMENT naming the weight when one holds NaN or Inf; INTERNAL or
// RESOURCE_EXHAUSTED for a CUDA failure. A build without CUDA: FAILED_PRECONDITION.
absl::StatusOr<std::shared_ptr<const DeviceLayerWeights>> CopyWeightsFromDevice(
    const LayerConfig& config, const PerWeight<DeviceWeightSource>& sources);

// Copies `bytes` bytes of host memory to a client's GPU memory (a CUDA IPC region slice of at
// least that size), synchronously. INTERNAL for a CUDA failure; a build without CUDA:
// FAILED_PRECONDITION.
absl::Status CopyToDeviceMemory(const RegionBytes& destination, const void* source,
                                std::size_t bytes);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_DEVICES_DEVICE_WEIGHTS_H_
