// The C++ API of an installed libattngrad (attngrad/backward.h): the exported LayerConfig and
// argument checks resolve from the shared library and behave. Exit status 0 when all holds.
#include <cstdio>
#include <cstring>

#include <attngrad/backward.h>
#include <attngrad/layer_weights.h>

int main() {
  const attngrad::LayerConfig config{/*hidden_size=*/8, /*num_heads=*/2, /*num_kv_heads=*/1,
                                     /*head_dim=*/4};
  if (!config.IsValid()) {
    std::fprintf(stderr, "LayerConfig{8, 2, 1, 4} is not valid\n");
    return 1;
  }
  if (!attngrad::IsValidPrecision(ATTNGRAD_PRECISION_FP32) || attngrad::IsValidPrecision(-1)) {
    std::fprintf(stderr, "IsValidPrecision is wrong\n");
    return 1;
  }
  const attngrad::TensorSizes sizes = attngrad::SizesOf(config, /*batch=*/2, /*seq_len=*/3);
  if (sizes.activations != 2 * 3 * 8 || sizes.rotary != 2 * 3 * 4) {
    std::fprintf(stderr, "SizesOf: %zu activations, %zu rotary\n", sizes.activations, sizes.rotary);
    return 1;
  }
  // No tensors: the first check that fails names a null pointer.
  const attngrad::Status status = attngrad::CheckBackwardArguments(
      config, 2, 3, attngrad::Scalars{}, attngrad::BackwardInputs{}, attngrad::BackwardOutputs{});
  if (status.code != ATTNGRAD_INVALID_ARGUMENT || std::strlen(status.message) == 0) {
    std::fprintf(stderr, "CheckBackwardArguments on null tensors: %d \"%s\"\n",
                 static_cast<int>(status.code), status.message);
    return 1;
  }
  std::printf("C++ API: CheckBackwardArguments says \"%s\"; %d CUDA devices\n", status.message,
              attngrad::DeviceCount());
  return 0;
}
