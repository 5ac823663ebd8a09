// The GPU backward pipeline of SPEC section 2 as one function, with an optional observer told after
// each stage (the benchmark records CUDA events there to say where the time goes). Internal to
// kernels/ and bench/; the public entry point is attngrad::BackwardDevice (backward.h).
#ifndef ATTNGRAD_KERNELS_CUDA_PIPELINE_H_
#define ATTNGRAD_KERNELS_CUDA_PIPELINE_H_

#include <cuda_runtime.h>

#include <cstddef>

#include "attngrad/backward.h"
#include "attngrad/prepared_weights.h"

namespace attngrad::cuda {

// Called on the host after each stage has been enqueued on `stream` (before the next one is).
// A serialising observer (the default) gets every stage on the caller's stream, one after the
// other, so that the time between two stages is the first one's alone; an overlapped one gets the
// real schedule (lane and side stream, as backward_device.cu draws it), each stage on the stream
// it ran on, so that stage end times show the critical path.
class StageObserver {
 public:
  virtual ~StageObserver() = default;
  virtual void StageDone(const char* stage, cudaStream_t stream) = 0;
  virtual bool overlapped() const { return false; }
};

// The mode a call runs in: AUTO resolves to FP16, the fastest mode, which meets SPEC section 4 on
// all 16 workloads (bench/RESULTS.md, bench/history/RESULTS-log.md; TF32 was measured slower at
// every size, even at B*S = 128 where the FP16 mode's weight conversion costs most).
Precision ResolvePrecision(Precision precision, int batch, int seq_len);

// Enqueues the whole pipeline on `stream`: forked onto the two streams of `side` when given, else
// of one leased from the device's pool, and joined back (with a serialising observer everything
// runs on `stream`). The Status names the check or the stage that failed. With `prepared` (its
// config must be `config`, in.weights its source()) the FP16 mode reads its fp16 weights instead of
// converting them, and the workspace is DeviceWorkspaceSize(*prepared, ...).
class SideStream;
Status RunBackwardPipeline(const LayerConfig& config, int batch, int seq_len,
                           const Scalars& scalars, Precision precision, bool accumulate,
                           const BackwardInputs& in, const BackwardOutputs& out, void* workspace,
                           std::size_t workspace_size, cudaStream_t stream, StageObserver* observer,
                           SideStream* side = nullptr, const PreparedWeights* prepared = nullptr);

}  // namespace attngrad::cuda

#endif  // ATTNGRAD_KERNELS_CUDA_PIPELINE_H_
