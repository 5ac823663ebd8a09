// The GPU entry points of backward.h in a build without CUDA (ATTNGRAD_CUDA=OFF or no nvcc): there
// is no device backend, so every call says ATTNGRAD_UNSUPPORTED and no device is reported.
#include "attngrad/backward.h"

namespace attngrad {

std::size_t DeviceWorkspaceSize(const LayerConfig&, int, int, Precision) { return 0; }

Status BackwardDevice(const LayerConfig&, int, int, const Scalars&, Precision, bool,
                      const BackwardInputs&, const BackwardOutputs&, void*, std::size_t, void*) {
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

int DeviceCount() { return 0; }

}  // namespace attngrad
