// libFuzzer target: wire tensor decoding. The first byte picks the dtype (any int, known or not),
// the next ones a shape of up to 4 small dimensions checked against a partly wildcarded expected
// shape, the rest is raw_data; CheckTensor, DecodeTensor, DecodeToFloat and CheckFinite must return
// a status (never crash, never read or write outside their buffers).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attngrad/v1/tensor.pb.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  attngrad::v1::Tensor tensor;
  // dtype: small values reach the known ones and their neighbours; 0xff an arbitrary large one.
  const int dtype = data[0] == 0xff ? 123456 : static_cast<int>(data[0] % 8) - 1;
  tensor.set_dtype(static_cast<attngrad::v1::DType>(dtype));
  const int rank = data[1] % 5;
  std::size_t at = 2;
  std::vector<std::int64_t> expected;
  for (int d = 0; d < rank && at < size; ++d, ++at) {
    // Signed, so negative and zero dimensions occur; 0x80..0xff map to large values.
    const std::int8_t byte = static_cast<std::int8_t>(data[at]);
    const std::int64_t dimension = byte >= -4 ? byte : (std::int64_t{1} << (-byte % 63));
    tensor.add_shape(dimension);
    expected.push_back(d % 2 == 0 ? -1 : dimension);
  }
  tensor.set_raw_data(std::string(reinterpret_cast<const char*>(data) + at, size - at));

  (void)attngrad::wire::NumElements(tensor.shape());
  (void)attngrad::wire::ShapeString(tensor.shape());
  (void)attngrad::wire::CheckTensor(tensor, "fuzz", expected);
  std::vector<float> decoded;
  if (attngrad::wire::DecodeTensor(tensor, "fuzz", expected, &decoded).ok()) {
    (void)attngrad::wire::CheckFinite(decoded, "fuzz");
    // Round trip: encoding what was decoded must decode to the same values (NaN payloads aside).
    std::string raw;
    attngrad::wire::EncodeFromFloat(decoded, dtype, &raw);
    std::vector<float> again(decoded.size());
    const int encoded_dtype =
        attngrad::wire::IsSupportedDType(dtype) ? dtype : attngrad::v1::DTYPE_FLOAT32;
    if (!attngrad::wire::DecodeToFloat(raw, encoded_dtype, "fuzz", absl::MakeSpan(again)).ok()) {
      __builtin_trap();
    }
    for (std::size_t i = 0; i < decoded.size(); ++i) {
      if (decoded[i] == decoded[i] && again[i] != decoded[i]) __builtin_trap();
    }
  }
  // Decoding the raw bytes directly, into a span of the size the bytes imply and of a wrong size.
  const std::size_t element = attngrad::wire::DTypeSize(dtype);
  if (element != 0) {
    std::vector<float> out(tensor.raw_data().size() / element);
    (void)attngrad::wire::DecodeToFloat(tensor.raw_data(), dtype, "fuzz", absl::MakeSpan(out));
    std::vector<float> wrong(out.size() + 1);
    if (attngrad::wire::DecodeToFloat(tensor.raw_data(), dtype, "fuzz", absl::MakeSpan(wrong))
            .ok()) {
      __builtin_trap();  // a size mismatch must be an error
    }
  }
  return 0;
}
