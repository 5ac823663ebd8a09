// attngrad/wire/dtype.h: every fp16 and bf16 value widens and narrows back to its own bits, and
// narrowing matches a reference computed another way (double arithmetic: the nearest multiple of
// the format's quantum, ties to even) over fp32 values chosen to hit ties, subnormals and overflow.
#include "attngrad/wire/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/wire/dtype_bits.h"

namespace attngrad::wire {
namespace {

using bits::BitsOfFloat;
using bits::FloatOfBits;

// A 16-bit binary format with `mantissa_bits` stored bits and exponents down to `min_exponent`.
struct Format {
  int mantissa_bits;
  int min_exponent;
  int max_exponent;
};
constexpr Format kHalf{10, -14, 15};
constexpr Format kBFloat16{7, -126, 127};

// The value of `x` rounded to `format` (nearest, ties to even; +-Inf past the largest finite value
// and the midpoint above it), computed in double where every step is exact.
double ReferenceNarrow(float x, const Format& format) {
  const double value = x;
  const double magnitude = std::fabs(value);
  const double overflow =
      std::ldexp(2.0 - std::ldexp(1.0, -format.mantissa_bits - 1), format.max_exponent);
  if (magnitude >= overflow) return std::copysign(std::numeric_limits<double>::infinity(), value);
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude = f * 2^exponent, f in [0.5, 1)
  const int scale = std::max(exponent - 1, format.min_exponent) - format.mantissa_bits;
  const double units = std::ldexp(magnitude, -scale);  // exact: fewer than 53 significant bits
  return std::copysign(std::ldexp(std::nearbyint(units), scale), value);
}

// The value of fp16 bits by the textbook formula.
double ReferenceHalfValue(std::uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0x1f) {
    magnitude = mantissa == 0 ? std::numeric_limits<double>::infinity()
                              : std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

// Expects the narrowed value of x to be the reference's, sign of zero included.
void ExpectNarrowsLikeReference(float x) {
  if (std::isnan(x)) return;
  const float half = HalfToFloat(FloatToHalf(x));
  const double half_reference = ReferenceNarrow(x, kHalf);
  ASSERT_EQ(static_cast<double>(half), half_reference)
      << "fp16 of " << x << " (0x" << std::hex << BitsOfFloat(x) << ")";
  ASSERT_EQ(std::signbit(half), std::signbit(half_reference)) << x;
  const float bfloat = BFloat16ToFloat(FloatToBFloat16(x));
  const double bfloat_reference = ReferenceNarrow(x, kBFloat16);
  ASSERT_EQ(static_cast<double>(bfloat), bfloat_reference)
      << "bf16 of " << x << " (0x" << std::hex << BitsOfFloat(x) << ")";
  ASSERT_EQ(std::signbit(bfloat), std::signbit(bfloat_reference)) << x;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(v1::DTYPE_FLOAT32), 4u);
  EXPECT_EQ(DTypeSize(v1::DTYPE_FLOAT16), 2u);
  EXPECT_EQ(DTypeSize(v1::DTYPE_BFLOAT16), 2u);
  EXPECT_EQ(DTypeSize(v1::DTYPE_UNSPECIFIED), 0u);
  EXPECT_EQ(DTypeSize(99), 0u);
  EXPECT_TRUE(IsSupportedDType(v1::DTYPE_BFLOAT16));
  EXPECT_FALSE(IsSupportedDType(v1::DTYPE_UNSPECIFIED));
  EXPECT_EQ(DTypeName(v1::DTYPE_FLOAT32), "float32");
  EXPECT_EQ(DTypeName(v1::DTYPE_FLOAT16), "float16");
  EXPECT_EQ(DTypeName(v1::DTYPE_BFLOAT16), "bfloat16");
  EXPECT_EQ(DTypeName(v1::DTYPE_UNSPECIFIED), "unspecified");
  EXPECT_EQ(DTypeName(42), "dtype 42");
  for (int dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    absl::StatusOr<v1::DType> parsed = ParseDTypeName(DTypeName(dtype));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_EQ(*ParseDTypeName("BF16"), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(*ParseDTypeName("fp16"), v1::DTYPE_FLOAT16);
  EXPECT_FALSE(ParseDTypeName("int8").ok());
}

TEST(DTypeTest, EveryHalfWidensExactlyAndNarrowsBackToItsBits) {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto half = static_cast<std::uint16_t>(bits);
    const float value = HalfToFloat(half);
    const double reference = ReferenceHalfValue(half);
    if (std::isnan(reference)) {
      ASSERT_TRUE(std::isnan(value)) << bits;
      ASSERT_EQ(std::signbit(value), (bits & 0x8000u) != 0) << bits;
      // NaNs keep their sign and payload and come back quiet.
      ASSERT_EQ(FloatToHalf(value), bits | 0x0200u) << "NaN bits " << bits;
      continue;
    }
    ASSERT_EQ(static_cast<double>(value), reference) << "half bits " << bits;
    ASSERT_EQ(std::signbit(value), (bits & 0x8000u) != 0) << bits;
    ASSERT_EQ(FloatToHalf(value), bits) << "half bits " << bits << " value " << value;
  }
}

TEST(DTypeTest, EveryBFloat16WidensExactlyAndNarrowsBackToItsBits) {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto bfloat = static_cast<std::uint16_t>(bits);
    const float value = BFloat16ToFloat(bfloat);
    ASSERT_EQ(BitsOfFloat(value), bits << 16);
    if (std::isnan(value)) {
      ASSERT_EQ(FloatToBFloat16(value), bits | 0x0040u) << "NaN bits " << bits;
      continue;
    }
    ASSERT_EQ(FloatToBFloat16(value), bits) << "bf16 bits " << bits << " value " << value;
  }
}

TEST(DTypeTest, NarrowingMatchesTheReferenceAtTiesAndNeighbours) {
  // For every finite 16-bit value: the fp32 midpoints to its neighbours (exact ties) and the fp32
  // values one ulp either side of them, in both formats.
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float half = HalfToFloat(static_cast<std::uint16_t>(bits));
    const float half_next = HalfToFloat(static_cast<std::uint16_t>(bits + 1));
    if (std::isfinite(half) && std::isfinite(half_next) && (bits & 0x7fffu) != 0x7fffu) {
      const float tie = static_cast<float>((static_cast<double>(half) + half_next) / 2);
      ASSERT_EQ(static_cast<double>(tie), (static_cast<double>(half) + half_next) / 2);
      for (float x : {half, tie, std::nextafter(tie, 0.f), std::nextafter(tie, 2 * tie)}) {
        ExpectNarrowsLikeReference(x);
      }
    }
    const std::uint32_t bfloat = bits << 16;
    for (std::uint32_t below_and_above : {bfloat | 0x7fffu, bfloat | 0x8000u, bfloat | 0x8001u}) {
      ExpectNarrowsLikeReference(FloatOfBits(below_and_above));
    }
  }
  // Overflow edges, the smallest subnormals, and halfway to zero.
  for (float x :
       {65504.f, 65519.f, 65520.f, 65536.f, 1e30f, -65520.f, std::ldexp(1.f, -24),
        std::ldexp(1.f, -25), std::ldexp(1.5f, -25), std::ldexp(1.f, -26), std::ldexp(1.f, -149),
        std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(), -0.f}) {
    ExpectNarrowsLikeReference(x);
  }
  EXPECT_EQ(FloatToHalf(65520.f), 0x7c00);                         // the midpoint to 2^16: Inf
  EXPECT_EQ(FloatToHalf(65519.f), 0x7bff);                         // 65504
  EXPECT_EQ(FloatToHalf(1.f + std::ldexp(1.f, -11)), 0x3c00);      // tie to even (down)
  EXPECT_EQ(FloatToHalf(1.f + 3 * std::ldexp(1.f, -11)), 0x3c02);  // tie to even (up)
  EXPECT_EQ(FloatToHalf(std::ldexp(1.f, -25)), 0x0000);            // half the smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToBFloat16(1.f + std::ldexp(1.f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(1.f + 3 * std::ldexp(1.f, -8)), 0x3f82);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to Inf
}

TEST(DTypeTest, NarrowingMatchesTheReferenceOverManyFloats) {
  // A stride through all 2^32 bit patterns (every exponent, fp32 subnormals included) ...
  for (std::uint64_t bits = 0; bits < (std::uint64_t{1} << 32); bits += 4099) {
    ExpectNarrowsLikeReference(FloatOfBits(static_cast<std::uint32_t>(bits)));
  }
  // ... and random bit patterns.
  std::mt19937 engine(12345);
  for (int i = 0; i < 1000000; ++i) ExpectNarrowsLikeReference(FloatOfBits(engine()));
}

TEST(DTypeTest, NaNAndInfinityAreKept) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(nan))));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(-nan))));
  EXPECT_TRUE(std::signbit(HalfToFloat(FloatToHalf(-nan))));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(nan))));
  // A signalling NaN whose payload lies only in the bits narrowing drops stays a NaN.
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(FloatOfBits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(FloatOfBits(0x7f800001u)))));
  EXPECT_EQ(FloatToHalf(inf), 0x7c00);
  EXPECT_EQ(FloatToHalf(-inf), 0xfc00);
  EXPECT_EQ(FloatToBFloat16(inf), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-inf), 0xff80);
}

}  // namespace
}  // namespace attngrad::wire
