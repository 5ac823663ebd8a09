// Wire dtype conversion on the GPU, for the GPU worker's copy-free batch path: fp16/bf16
// activations are widened to fp32 on the device after their copy in, and fp32 answers narrowed to
// fp16/bf16 on the device before their copy out (the host never converts). The same bit-level
// functions as the host's (attngrad/wire/dtype_bits.h), so the bits equal the CPU backend's.
#ifndef ATTNGRAD_SERVER_WIRE_CONVERT_H_
#define ATTNGRAD_SERVER_WIRE_CONVERT_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace attngrad::server {

enum class HalfFormat { kFloat16, kBFloat16 };

// destination[i] = source[i] widened, for i < count, queued on `stream`.
cudaError_t WidenToFloat(const std::uint16_t* source, HalfFormat format, std::size_t count,
                         float* destination, cudaStream_t stream);
// destination[i] = source[i] rounded to `format` (nearest, ties to even), queued on `stream`.
cudaError_t NarrowFromFloat(const float* source, HalfFormat format, std::size_t count,
                            std::uint16_t* destination, cudaStream_t stream);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_WIRE_CONVERT_H_
