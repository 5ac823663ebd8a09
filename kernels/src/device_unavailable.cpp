// The GPU entry points of backward.h, forward.h and prepared_weights.h in a build without CUDA
// (ATTNGRAD_CUDA=OFF or no nvcc): there is no device backend, so every call with valid arguments
// says ATTNGRAD_UNSUPPORTED (invalid ones are refused as the GPU backend refuses them) and no
// device is reported.
#include "attngrad/backward.h"
#include "attngrad/finite_check.h"
#include "attngrad/forward.h"
#include "attngrad/prepared_weights.h"

namespace attngrad {

std::size_t DeviceWorkspaceSize(const LayerConfig&, int, int, Precision) { return 0; }

Status BackwardDevice(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                      Precision, bool, const BackwardInputs& in, const BackwardOutputs& out, void*,
                      std::size_t, void*) {
  const Status arguments = CheckBackwardArguments(config, batch, seq_len, scalars, in, out);
  if (!arguments.ok()) return arguments;
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

int DeviceCount() { return 0; }

// Never called here: without CUDA a PreparedWeights never holds device memory.
void PreparedWeights::DeviceMemoryRelease::operator()(void*) const noexcept {}

Status PreparedWeights::Prepare(const LayerConfig&, const PerWeight<const float*>&, void*) {
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

std::size_t DeviceWorkspaceSize(const PreparedWeights&, int, int, Precision) { return 0; }

Status BackwardDevice(const PreparedWeights& weights, int batch, int seq_len,
                      const Scalars& scalars, Precision, bool, const BackwardInputs& in,
                      const BackwardOutputs& out, void*, std::size_t, void*) {
  const Status arguments =
      CheckBackwardArguments(weights.config(), batch, seq_len, scalars, in, out);
  if (!arguments.ok()) return arguments;
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

std::size_t ForwardWorkspaceSize(const LayerConfig&, int, int, Precision) { return 0; }

std::size_t ForwardWorkspaceSize(const PreparedWeights&, int, int, Precision) { return 0; }

Status ForwardDevice(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                     Precision, const ForwardInputs& in, float* output, void*, std::size_t, void*) {
  const Status arguments = CheckForwardArguments(config, batch, seq_len, scalars, in, output);
  if (!arguments.ok()) return arguments;
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

Status ForwardDevice(const PreparedWeights& weights, int batch, int seq_len, const Scalars& scalars,
                     Precision, const ForwardInputs& in, float* output, void*, std::size_t, void*) {
  const Status arguments =
      CheckForwardArguments(weights.config(), batch, seq_len, scalars, in, output);
  if (!arguments.ok()) return arguments;
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

Status CountNonFiniteDevice(const LayerConfig&, const float*, std::size_t,
                            const PerWeight<const float*>&, unsigned long long*, void*) {
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

Status CountOverflowingSumsDevice(const LayerConfig&, const PerWeight<const float*>&,
                                  const PerWeight<const float*>&, unsigned long long*, void*) {
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

Status AccumulateIfFiniteDevice(const LayerConfig&, const PerWeight<const float*>&,
                                const PerWeight<float*>&, const unsigned long long*, void*) {
  return {ATTNGRAD_UNSUPPORTED, "this build of attngrad has no CUDA backend"};
}

}  // namespace attngrad
