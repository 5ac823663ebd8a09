// Element conversions between the wire dtypes of attngrad.v1.DType (fp32, fp16, bf16) and host fp32,
// and the raw-bytes <-> float helpers the client uses to pack and unpack v1.Tensor.
#ifndef ATTNGRAD_CLIENT_SRC_DTYPE_H_
#define ATTNGRAD_CLIENT_SRC_DTYPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attngrad/v1/tensor.pb.h"

namespace attngrad {

// Bytes per element of a wire dtype (0 for UNSPECIFIED or unknown).
int64_t DTypeSize(v1::DType dtype);
// "float32", "float16", "bfloat16" or "unspecified".
absl::string_view DTypeName(v1::DType dtype);

float HalfToFloat(uint16_t half);
uint16_t FloatToHalf(float value);  // round to nearest even; overflow to inf
float BFloat16ToFloat(uint16_t value);
uint16_t FloatToBFloat16(float value);  // round to nearest even

// Appends `values` encoded as `dtype` (little-endian) to `out`.
void EncodeFloats(absl::Span<const float> values, v1::DType dtype, std::string* out);
// Decodes `bytes` (a whole number of `dtype` elements) into `out`, which must hold exactly
// bytes.size() / DTypeSize(dtype) elements.
absl::Status DecodeFloats(absl::string_view bytes, v1::DType dtype, absl::Span<float> out);

// A v1.Tensor of `values` with `shape`, encoded as `dtype` (UNSPECIFIED = fp32).
v1::Tensor MakeTensor(absl::Span<const float> values, const std::vector<int64_t>& shape,
                      v1::DType dtype = v1::DTYPE_FLOAT32);

// Checks that `tensor` has `expected_shape` and the right byte count, then decodes it into `out`
// (resized). `what` names the tensor in errors.
absl::Status ReadTensor(const v1::Tensor& tensor, const std::vector<int64_t>& expected_shape,
                        absl::string_view what, std::vector<float>* out);

// "[2,16,3072]".
std::string ShapeString(absl::Span<const int64_t> shape);
int64_t NumElements(absl::Span<const int64_t> shape);

}  // namespace attngrad

#endif  // ATTNGRAD_CLIENT_SRC_DTYPE_H_
