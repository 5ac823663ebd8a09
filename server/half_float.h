// Conversions between fp32 and the two 16-bit wire dtypes (IEEE binary16 and bfloat16), bit exact:
// widening is exact; narrowing rounds to nearest, ties to even, and keeps NaN/Inf.
#ifndef ATTNGRAD_SERVER_HALF_FLOAT_H_
#define ATTNGRAD_SERVER_HALF_FLOAT_H_

#include <cstdint>

namespace attngrad::server {

float HalfToFloat(std::uint16_t half);
std::uint16_t FloatToHalf(float value);
float BFloat16ToFloat(std::uint16_t bits);
std::uint16_t FloatToBFloat16(float value);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_HALF_FLOAT_H_
