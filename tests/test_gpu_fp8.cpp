// The GPU's blockwise FP8 weight quantization (mok::fp8::quantize_weights) against the
// host's fp8::quantize, bitwise: ragged edge blocks, blocks of zeros, magnitudes from 2^-30
// to 2^30 across blocks, a strided view (one half of a concatenated [E, 2I, H] with a
// padded expert pitch), and the same bytes on a second run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gpu_support.hpp"
#include "mok/bf16.hpp"
#include "mok/fp8.hpp"
#include "mok/types.hpp"

namespace mok::fp8 {
namespace {

using testing::DeviceBuffer;

// bf16 bits of [E, rows, pitch] (pitch >= cols; the padding holds NaNs, which must not be
// read): normal values times 2^s per 128 x 128 block, s in [-30, 30]; one block all zero.
std::vector<std::uint16_t> make_weights(int E, int rows, int cols, int pitch, std::int64_t expert_pitch,
                                        std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> shift(-30, 30);
  std::vector<int> shifts(static_cast<std::size_t>(E) * 64 * 64);
  for (int& s : shifts) s = shift(rng);
  std::vector<std::uint16_t> w(static_cast<std::size_t>(E) * expert_pitch, bf16::from_float(std::nanf("")).bits);
  for (int e = 0; e < E; ++e)
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const int block = (e * 64 + r / 128) * 64 + c / 128;
        const bool zero_block = e == 1 && r / 128 == 0 && c / 128 == 1;
        const float v = zero_block ? 0.0f : std::ldexp(normal(rng), shifts[block]);
        w[e * expert_pitch + static_cast<std::int64_t>(r) * pitch + c] = bf16::from_float(v).bits;
      }
  return w;
}

// transpose: the quantization of each expert's w^T ([E, cols, rows] values, [E, cb, rb]
// exponents) against the host's quantization of the transposed matrix.
void expect_matches_host(int E, int rows, int cols, int pitch, std::int64_t expert_pitch, std::uint64_t seed,
                         bool transpose = false) {
  const std::vector<std::uint16_t> host_w = make_weights(E, rows, cols, pitch, expert_pitch, seed);
  const int rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  const int out_rows = transpose ? cols : rows, out_cols = transpose ? rows : cols;  // of the quantized matrix
  DeviceBuffer<std::uint16_t> w(host_w);
  DeviceBuffer<std::uint8_t> values(static_cast<std::size_t>(E) * rows * cols);
  DeviceBuffer<std::int32_t> exponents(static_cast<std::size_t>(E) * rb * cb);
  MOK_CUDA_OK(cudaMemset(values.get(), 0xa5, values.size()));  // poisoned
  MOK_CUDA_OK(cudaMemset(exponents.get(), 0x5a, exponents.size() * 4));
  TensorView wv = TensorView::contiguous(w.get(), DType::bf16, Device::cuda(0), {E, rows, cols});
  wv.stride = {expert_pitch, pitch, 1, 0};
  const TensorView vv = TensorView::contiguous(values.get(), DType::u8, Device::cuda(0), {E, out_rows, out_cols});
  const TensorView ev = TensorView::contiguous(exponents.get(), DType::i32, Device::cuda(0),
                                               {E, transpose ? cb : rb, transpose ? rb : cb});
  quantize_weights(wv, vv, ev, nullptr, transpose);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<std::uint8_t> got_values = values.download();
  const std::vector<std::int32_t> got_exponents = exponents.download();
  int value_mismatches = 0, exponent_mismatches = 0;
  for (int e = 0; e < E; ++e) {
    std::vector<float> x(static_cast<std::size_t>(rows) * cols);  // [out_rows, out_cols]
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c)
        x[transpose ? static_cast<std::size_t>(c) * rows + r : static_cast<std::size_t>(r) * cols + c] =
            bf16::from_bits(host_w[e * expert_pitch + static_cast<std::int64_t>(r) * pitch + c]).to_float();
    const Blockwise want = quantize(x.data(), out_rows, out_cols, 128, 128);
    for (std::size_t i = 0; i < want.values.size(); ++i) {
      const std::uint8_t got = got_values[static_cast<std::size_t>(e) * rows * cols + i];
      if (got != want.values[i] && value_mismatches++ < 5)
        ADD_FAILURE() << "expert " << e << " element " << i << ": GPU 0x" << std::hex << int(got) << ", host 0x"
                      << int(want.values[i]) << std::dec << " (x = " << x[i] << ")";
    }
    for (std::size_t i = 0; i < want.exponents.size(); ++i) {
      const std::int32_t got = got_exponents[static_cast<std::size_t>(e) * rb * cb + i];
      if (got != want.exponents[i] && exponent_mismatches++ < 5)
        ADD_FAILURE() << "expert " << e << " block " << i << ": GPU exponent " << got << ", host " << want.exponents[i];
    }
  }
  EXPECT_EQ(value_mismatches, 0);
  EXPECT_EQ(exponent_mismatches, 0);
  // A second run gives the same bytes.
  MOK_CUDA_OK(cudaMemset(values.get(), 0, values.size()));
  quantize_weights(wv, vv, ev, nullptr, transpose);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(values.download(), got_values);
  EXPECT_EQ(exponents.download(), got_exponents);
}

TEST(GpuFp8, WeightsMatchTheHostBitwise) {
  MOK_REQUIRE_HOPPER();
  expect_matches_host(3, 200, 320, 320, 200 * 320, 7);  // ragged edges in both dimensions
  expect_matches_host(2, 256, 512, 512, 256 * 512, 8);  // whole blocks
}

// The transposed quantization (for GEMMs by W^T): W^T's values and exponents, equal to the
// host's quantization of the transposed matrix, ragged edges included, from a strided view.
TEST(GpuFp8, TransposedWeightsMatchTheHostBitwise) {
  MOK_REQUIRE_HOPPER();
  expect_matches_host(2, 200, 320, 352, 200 * 352 + 32, 12, /*transpose=*/true);
  expect_matches_host(2, 256, 384, 384, 256 * 384, 13, /*transpose=*/true);  // whole blocks
}

TEST(GpuFp8, StridedViewsAreReadAsTheySay) {
  MOK_REQUIRE_HOPPER();
  // The up half of a concatenated [E, 2I, H] (row pitch H, expert pitch 2 I H) would have
  // pitch == cols; here also a padded row pitch, whose padding (NaN) must not be read.
  expect_matches_host(2, 192, 256, 320, 2 * 192 * 320 + 64, 9);
}

}  // namespace
}  // namespace mok::fp8
