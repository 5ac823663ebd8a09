// Tensors on the wire (attngrad.v1.Tensor: dtype, shape, raw little-endian bytes) to and from fp32
// host arrays, with the validation every request field gets: dtype known, shape as expected, byte
// count equal to product(shape) * element size, and (optionally) every value finite.
#ifndef ATTNGRAD_SERVER_TENSOR_CODEC_H_
#define ATTNGRAD_SERVER_TENSOR_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attngrad/v1/tensor.pb.h"

namespace attngrad::server {

// Bytes per element of a wire dtype; 0 for UNSPECIFIED and unknown values.
std::size_t DTypeSize(int dtype);
// "FLOAT32", "FLOAT16", "BFLOAT16" or "dtype N".
std::string DTypeName(int dtype);
// True for the dtypes the server accepts on the wire.
bool IsSupportedWireDType(int dtype);

// "[1,16,3072]".
std::string ShapeString(absl::Span<const std::int64_t> shape);

// Product of the dimensions; an error (naming `field`) when one is negative or the product overflows.
absl::StatusOr<std::int64_t> ElementCount(absl::Span<const std::int64_t> shape,
                                          const std::string& field);

// Checks `tensor` against the expected shape (every dimension; -1 = any positive value) and returns
// its shape. INVALID_ARGUMENT naming `field` when the dtype is not a wire dtype, the rank or a
// dimension differs, or raw_data does not hold exactly product(shape) elements.
absl::StatusOr<std::vector<std::int64_t>> CheckTensor(const v1::Tensor& tensor,
                                                      const std::string& field,
                                                      absl::Span<const std::int64_t> expected);

// Converts raw little-endian bytes of `dtype` to fp32 into `out` (out.size() elements; the byte
// count must match). With require_finite, INVALID_ARGUMENT naming `field` and the first non-finite
// element's index.
absl::Status DecodeToFloat(const std::string& raw, int dtype, const std::string& field,
                           bool require_finite, absl::Span<float> out);

// Appends `values` converted to `dtype` (a wire dtype) to `raw`.
void EncodeFromFloat(absl::Span<const float> values, int dtype, std::string* raw);

// Fills a Tensor with shape and the converted values.
void EncodeTensor(absl::Span<const float> values, absl::Span<const std::int64_t> shape, int dtype,
                  v1::Tensor* tensor);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_TENSOR_CODEC_H_
