// The six weights of one attention layer as fp32 host arrays (the master copy every device worker
// uploads), how to draw them at random (SPEC section 3) and how to check them against a
// configuration.
#ifndef ATTNGRAD_SERVER_WEIGHTS_SERVED_WEIGHTS_H_
#define ATTNGRAD_SERVER_WEIGHTS_SERVED_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attngrad/backward.h"
#include "attngrad/layer_weights.h"
#include "attngrad/v1/attngrad.pb.h"
#include "attngrad/wire/layer.h"

namespace attngrad::server {

// Six fp32 arrays (or six gradient arrays of the same shapes).
using LayerTensors = PerWeight<std::vector<float>>;

// OK when every array has the size `config` implies; else INVALID_ARGUMENT naming the weight.
absl::Status CheckShapes(const LayerTensors& tensors, const LayerConfig& config);

// A layer's fp32 weights in GPU memory the server owns (loaded by reference from a client's GPU
// memory: devices/device_weights.h), packed in PackedWeightLayout order on one CUDA device; the
// memory is freed when the last holder lets go.
class DeviceLayerWeights {
 public:
  virtual ~DeviceLayerWeights() = default;
  virtual int cuda_device() const = 0;
  virtual const float* data() const = 0;
};

struct LayerWeights {
  LayerConfig config;
  // The host master copy; six empty arrays when the weights are on a device (device_values).
  LayerTensors values;
  std::shared_ptr<const DeviceLayerWeights> device_values;
  std::string source;  // "random:seed=N", "safetensors:PATH#layer=I", "upload" or "cuda_ipc"

  bool on_device() const { return device_values != nullptr; }
};

// Random weights as in SPEC section 3, drawn by attngrad::FillRandomLayerWeights
// (attngrad/spec_random.h: the generator the clients use to reproduce them from the same seed).
LayerWeights RandomLayerWeights(const LayerConfig& config, std::uint64_t seed);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_WEIGHTS_SERVED_WEIGHTS_H_
