// E4M3 encoding and blockwise power-of-two scaling (mok/fp8.hpp), on the CPU: every code
// round-trips, rounding is to nearest with ties to even, large values saturate, a block's
// scale fits its largest magnitude, quantization error stays within half a quantum, and the
// conversion to MXFP8 changes no value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "mok/error.hpp"
#include "mok/fp8.hpp"

namespace mok::fp8 {
namespace {

TEST(Fp8, EveryFiniteCodeRoundTrips) {
  int finite = 0;
  for (int b = 0; b < 256; ++b) {
    const float v = decode_e4m3(static_cast<std::uint8_t>(b));
    if (std::isnan(v)) {
      EXPECT_TRUE((b & 0x7f) == 0x7f) << b;
      continue;
    }
    ++finite;
    EXPECT_EQ(encode_e4m3(v), b) << "code " << b << " = " << v;
  }
  EXPECT_EQ(finite, 254);  // two NaNs (S.1111.111), no infinities
}

TEST(Fp8, KnownValues) {
  EXPECT_EQ(encode_e4m3(1.0f), 0x38);
  EXPECT_EQ(encode_e4m3(-2.0f), 0xc0);
  EXPECT_EQ(encode_e4m3(448.0f), 0x7e);
  EXPECT_EQ(decode_e4m3(0x7e), 448.0f);
  EXPECT_EQ(decode_e4m3(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(decode_e4m3(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(encode_e4m3(0.0f), 0x00);
  EXPECT_EQ(encode_e4m3(-0.0f), 0x80);
}

TEST(Fp8, RoundsToNearestTiesToEvenAndSaturates) {
  // Between 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code 0x38; between
  // 1.125 and 1.25 (0x3a) to 0x3a.
  EXPECT_EQ(encode_e4m3(1.0625f), 0x38);
  EXPECT_EQ(encode_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(encode_e4m3(1.07f), 0x39);
  EXPECT_EQ(encode_e4m3(std::ldexp(1.0f, -10)), 0x00);         // half the smallest subnormal: to even 0
  EXPECT_EQ(encode_e4m3(std::ldexp(3.0f, -10)), 0x02);         // 1.5 subnormal quanta: to even 2
  EXPECT_EQ(encode_e4m3(1e6f), 0x7e);
  EXPECT_EQ(encode_e4m3(-1e6f), 0xfe);
  EXPECT_EQ(encode_e4m3(464.0f), 0x7e);                        // past the largest finite: saturates
  EXPECT_EQ(encode_e4m3(std::nanf("")), 0x7f);
}

TEST(Fp8, ScaleExponentIsTheSmallestThatFits) {
  EXPECT_EQ(scale_exponent(0.0f), 0);
  EXPECT_EQ(scale_exponent(448.0f), 0);
  EXPECT_EQ(scale_exponent(449.0f), 1);
  EXPECT_EQ(scale_exponent(1.0f), -8);   // 1 / 2^-8 = 256 <= 448, 1 / 2^-9 = 512 > 448
  EXPECT_EQ(scale_exponent(3.5f), -7);   // 3.5 * 128 = 448
  for (float amax : {1e-30f, 1e-5f, 0.3f, 7.0f, 1000.0f, 3e30f}) {
    const int e = scale_exponent(amax);
    EXPECT_LE(std::ldexp(amax, -e), kE4m3Max) << amax;
    EXPECT_GT(std::ldexp(amax, -(e - 1)), kE4m3Max) << amax;
  }
}

std::vector<float> random_matrix(int rows, int cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(rows) * cols);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dist(rng) * std::ldexp(1.0f, static_cast<int>(i % 7) - 3);
  return x;
}

TEST(Fp8, BlockwiseErrorWithinHalfAQuantum) {
  for (auto [br, bc] : {std::pair{1, 128}, {128, 128}}) {
    const int rows = 200, cols = 300;  // edge blocks smaller than a full block
    const auto x = random_matrix(rows, cols, 7 + br);
    const Blockwise q = quantize(x.data(), rows, cols, br, bc);
    ASSERT_EQ(q.exponents.size(), static_cast<std::size_t>((rows + br - 1) / br) * ((cols + bc - 1) / bc));
    const auto y = dequantize(q);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const float v = x[static_cast<std::size_t>(r) * cols + c], d = y[static_cast<std::size_t>(r) * cols + c];
        const float scaled = std::fabs(std::ldexp(v, -q.exponent_of(r, c)));
        const int e = scaled >= std::ldexp(1.0f, -6) ? std::ilogb(scaled) : -6;
        const float half_quantum = std::ldexp(1.0f, e - 4 + q.exponent_of(r, c));
        ASSERT_LE(std::fabs(v - d), half_quantum) << br << "x" << bc << " at " << r << ", " << c;
      }
  }
}

TEST(Fp8, Mxfp8ConversionChangesNoValue) {
  const int rows = 130, cols = 256 + 64;
  const auto x = random_matrix(rows, cols, 99);
  for (auto [br, bc] : {std::pair{1, 128}, {128, 128}}) {
    const Blockwise q = quantize(x.data(), rows, cols, br, bc);
    const Mxfp8 m = to_mxfp8(q);
    EXPECT_EQ(m.values, q.values);
    ASSERT_EQ(m.e8m0.size(), static_cast<std::size_t>(rows) * (cols / 32));
    const auto a = dequantize(q), b = dequantize(m);
    for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
  }
  const Blockwise odd = quantize(x.data(), rows, cols, 1, 48);
  EXPECT_THROW(to_mxfp8(odd), ArgumentError);
}

}  // namespace
}  // namespace mok::fp8
