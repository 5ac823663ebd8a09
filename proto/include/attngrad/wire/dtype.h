// The element types of attngrad.v1.DType on the wire: their sizes and names, and the one fp32 <->
// fp16/bf16 conversion client and server use (round to nearest, ties to even; Inf and NaN kept;
// subnormals exact).
#ifndef ATTNGRAD_WIRE_DTYPE_H_
#define ATTNGRAD_WIRE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attngrad/v1/tensor.pb.h"

namespace attngrad::wire {

// Bytes per element of a wire dtype: 4 for FLOAT32, 2 for FLOAT16 and BFLOAT16, 0 for UNSPECIFIED
// and values this build does not know. (An int, so that unknown enum values arriving on the wire
// can be passed as they are.)
std::size_t DTypeSize(int dtype);

// True for the dtypes client and server exchange (DTypeSize(dtype) != 0).
bool IsSupportedDType(int dtype);

// The one spelling of a wire dtype in messages and on command lines: "float32", "float16",
// "bfloat16", "unspecified", or "dtype N" for a value this build does not know.
std::string DTypeName(int dtype);

// The dtype named by DTypeName's spelling (case-insensitive; also "fp32", "fp16", "bf16");
// INVALID_ARGUMENT listing the accepted names otherwise.
absl::StatusOr<v1::DType> ParseDTypeName(absl::string_view name);

// IEEE binary16 bits <-> fp32. Widening is exact; narrowing rounds to nearest, ties to even,
// overflows to +-Inf, keeps Inf and NaN (a NaN stays a quiet NaN of the same sign).
float HalfToFloat(std::uint16_t bits);
std::uint16_t FloatToHalf(float value);

// bfloat16 bits (the top half of an fp32) <-> fp32, with the same rounding as FloatToHalf.
float BFloat16ToFloat(std::uint16_t bits);
std::uint16_t FloatToBFloat16(float value);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_DTYPE_H_
