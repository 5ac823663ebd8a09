// attngrad.v1.Tensor (dtype, shape, raw little-endian bytes) to and from fp32 host arrays, with the
// checks every tensor on the wire gets: a known dtype, the expected shape, a byte count equal to
// product(shape) * element size; errors are INVALID_ARGUMENT naming the field and the expected
// shape. Also the safetensors spelling of the wire dtypes.
#ifndef ATTNGRAD_WIRE_TENSOR_H_
#define ATTNGRAD_WIRE_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attngrad/v1/tensor.pb.h"

namespace attngrad::wire {

// "[2,16,3072]".
std::string ShapeString(absl::Span<const std::int64_t> shape);

// The product of the dimensions, or -1 when one is negative or the product exceeds 2^60 (so that
// it times an element size still fits in an int64).
std::int64_t NumElements(absl::Span<const std::int64_t> shape);
// NumElements, with INVALID_ARGUMENT naming `field` where it is -1.
absl::StatusOr<std::int64_t> ElementCount(absl::Span<const std::int64_t> shape,
                                          absl::string_view field);

// Checks `shape` against `expected` (same rank; each dimension equal, or >= 1 where expected is -1,
// which errors write "*").
absl::Status CheckShape(absl::Span<const std::int64_t> shape, absl::string_view field,
                        absl::Span<const std::int64_t> expected);

// Checks a tensor's dtype, its shape against `expected` (as CheckShape) and its byte count, and
// returns its shape.
absl::StatusOr<std::vector<std::int64_t>> CheckTensor(const v1::Tensor& tensor,
                                                      absl::string_view field,
                                                      absl::Span<const std::int64_t> expected);
// The same checks on a tensor's parts: its dtype, its shape and the byte count of its raw data
// (for a tensor whose raw data was kept out of the parsed message, see server/rpc/raw_request.h).
absl::StatusOr<std::vector<std::int64_t>> CheckTensor(int dtype,
                                                      absl::Span<const std::int64_t> shape,
                                                      std::size_t raw_bytes,
                                                      absl::string_view field,
                                                      absl::Span<const std::int64_t> expected);

// Converts raw little-endian elements of `dtype` to fp32 into `out`, which must hold exactly
// raw.size() / DTypeSize(dtype) elements.
absl::Status DecodeToFloat(absl::string_view raw, int dtype, absl::string_view field,
                           absl::Span<float> out);
// The same on raw elements held in pieces, in order (e.g. the slices a message arrived in; an
// element may straddle two pieces): out.size() elements, exactly as many as the pieces hold.
absl::Status DecodePiecesToFloat(absl::Span<const absl::string_view> pieces, int dtype,
                                 absl::string_view field, absl::Span<float> out);
// Bytes [offset, offset + size) of the pieces taken in order, as pieces of the same memory (fewer
// bytes when the pieces end first): to decode a large tensor in parts on several threads.
std::vector<absl::string_view> PiecesRange(absl::Span<const absl::string_view> pieces,
                                           std::size_t offset, std::size_t size);
// INVALID_ARGUMENT naming `field` and the first element that is Inf or NaN, if any; elements are
// numbered from `first_index` (for a tensor checked in parts).
absl::Status CheckFinite(absl::Span<const float> values, absl::string_view field,
                         std::size_t first_index = 0);
// The same on raw little-endian elements of a wire dtype, checked on their bits (the message
// equals CheckFinite's on the decoded values).
absl::Status CheckFiniteRaw(absl::string_view raw, int dtype, absl::string_view field,
                            std::size_t first_index = 0);

// Copies the raw little-endian elements of `dtype` in `source` (whole elements) to `destination`
// and returns whether every one of them is finite (checked on their bits, as CheckFiniteRaw), in
// one pass over the bytes. On x86-64 the stores bypass the cache (non-temporal), for a large copy
// into memory the CPU does not read again (the server's page-locked staging, read by the GPU's
// DMA): no read-for-ownership of the destination and no second pass to check. The copy is
// complete (and visible to other threads) when it returns, whatever the answer.
bool CopyAndCheckFinite(absl::string_view source, int dtype, char* destination);
// Copies the pieces' bytes, in order, to `destination` (as many bytes as they hold). `streaming`:
// with the same non-temporal stores as CopyAndCheckFinite for pieces of 4 KiB and more, for a copy
// larger than the caches keep into memory the CPU does not read again soon (the client's large
// answers into its caller's buffers); else memcpy. Complete (and visible to other threads) when it
// returns.
void CopyPieces(absl::Span<const absl::string_view> pieces, char* destination, bool streaming);

// CheckTensor, then DecodeToFloat into `out` (resized to the tensor's element count).
absl::Status DecodeTensor(const v1::Tensor& tensor, absl::string_view field,
                          absl::Span<const std::int64_t> expected, std::vector<float>* out);

// Appends `values` converted to `dtype` to `raw` (fp32 for any dtype but FLOAT16 and BFLOAT16).
void EncodeFromFloat(absl::Span<const float> values, int dtype, std::string* raw);
// The same into `out`, which holds values.size() * DTypeSize(dtype) bytes (fp32 for a dtype that
// is not FLOAT16 or BFLOAT16: 4 bytes each).
void EncodeFromFloat(absl::Span<const float> values, int dtype, char* out);

// Sets `tensor` to `values` with `shape`, converted to `dtype` (FLOAT32 where it is not a
// supported wire dtype).
void EncodeTensor(absl::Span<const float> values, absl::Span<const std::int64_t> shape, int dtype,
                  v1::Tensor* tensor);
v1::Tensor MakeTensor(absl::Span<const float> values, absl::Span<const std::int64_t> shape,
                      int dtype = v1::DTYPE_FLOAT32);

// The wire dtype of a safetensors dtype string ("F32", "F16", "BF16"); UNSPECIFIED otherwise.
v1::DType DTypeFromSafetensors(absl::string_view safetensors_dtype);
// "F32", "F16" or "BF16" for a wire dtype; "" otherwise.
absl::string_view SafetensorsDTypeName(int dtype);

}  // namespace attngrad::wire

#endif  // ATTNGRAD_WIRE_TENSOR_H_
