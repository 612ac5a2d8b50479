// The GPU's blockwise FP8 weight quantization (mok::fp8::quantize_weights) against the
// host's fp8::quantize, bitwise: ragged edge blocks, blocks of zeros, magnitudes from 2^-30
// to 2^30 across blocks, a strided view (one half of a concatenated [E, 2I, H] with a
// padded expert pitch), and the same bytes on a second run; and the kernel's wide-load path
// likewise, for W, W^T and both from one read (values_t).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gpu_support.hpp"
#include "kernels/fp8/quantize.cuh"
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

// The kernel's wide-load path (kernels::launch_quantize_blocks) for W, for W^T, and for both at
// once (values_t), each against the host's quantization of W or W^T; blocks
// special to the vector path's max (a NaN, an infinity beside normal values; make_weights' block of
// zeros) are added. Edge blocks and views the wide loads cannot take (a row pitch not a multiple of 8
// elements) go through its element-wise code in the same launch and must give the same bytes.
void expect_vector_matches_host(int E, int rows, int cols, int pitch, std::int64_t expert_pitch, std::uint64_t seed) {
  std::vector<std::uint16_t> host_w = make_weights(E, rows, cols, pitch, expert_pitch, seed);
  host_w[static_cast<std::size_t>(5 * pitch + 7)] = bf16::from_float(std::nanf("")).bits;  // (expert 0, block (0, 0))
  host_w[static_cast<std::size_t>(expert_pitch + 3 * pitch + 5)] = bf16::from_float(-INFINITY).bits;  // (expert 1, (0, 0))
  // (expert 1's block (0, 1) stays all zeros: make_weights')
  const int rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  DeviceBuffer<std::uint16_t> w(host_w);
  std::vector<std::vector<std::uint8_t>> want_values(2);
  std::vector<std::vector<std::int32_t>> want_exponents(2);
  for (int t = 0; t < 2; ++t) {  // (t = 1: W^T)
    const int out_rows = t ? cols : rows, out_cols = t ? rows : cols;
    for (int e = 0; e < E; ++e) {
      std::vector<float> x(static_cast<std::size_t>(rows) * cols);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c)
          x[t ? static_cast<std::size_t>(c) * rows + r : static_cast<std::size_t>(r) * cols + c] =
              bf16::from_bits(host_w[e * expert_pitch + static_cast<std::int64_t>(r) * pitch + c]).to_float();
      const Blockwise q = quantize(x.data(), out_rows, out_cols, 128, 128);
      want_values[t].insert(want_values[t].end(), q.values.begin(), q.values.end());
      want_exponents[t].insert(want_exponents[t].end(), q.exponents.begin(), q.exponents.end());
    }
  }
  for (int mode = 0; mode < 3; ++mode) {  // W, W^T, both
    DeviceBuffer<std::uint8_t> values(static_cast<std::size_t>(E) * rows * cols), values_t(values.size());
    DeviceBuffer<std::int32_t> exponents(static_cast<std::size_t>(E) * rb * cb), exponents_t(exponents.size());
    for (auto* b : {&values, &values_t}) MOK_CUDA_OK(cudaMemset(b->get(), 0xa5, b->size()));
    for (auto* b : {&exponents, &exponents_t}) MOK_CUDA_OK(cudaMemset(b->get(), 0x5a, b->size() * 4));
    kernels::QuantizeParams p{};
    p.w = w.get(), p.expert_stride = expert_pitch, p.row_stride = pitch;
    p.experts = E, p.rows = rows, p.cols = cols;
    p.transpose = mode == 1;
    p.values = values.get(), p.exponents = exponents.get();
    p.values_expert_stride = static_cast<std::int64_t>(rows) * cols, p.values_row_stride = mode == 1 ? rows : cols;
    p.exponents_expert_stride = static_cast<std::int64_t>(rb) * cb, p.exponents_row_stride = mode == 1 ? rb : cb;
    if (mode == 2) {
      p.values_t = values_t.get(), p.exponents_t = exponents_t.get();
      p.values_t_expert_stride = static_cast<std::int64_t>(rows) * cols, p.values_t_row_stride = rows;
      p.exponents_t_expert_stride = static_cast<std::int64_t>(rb) * cb, p.exponents_t_row_stride = rb;
    }
    kernels::launch_quantize_blocks(p, nullptr);
    MOK_CUDA_OK(cudaGetLastError());
    MOK_CUDA_OK(cudaDeviceSynchronize());
    const auto check = [&](const DeviceBuffer<std::uint8_t>& v, const DeviceBuffer<std::int32_t>& x, int t) {
      EXPECT_EQ(v.download(), want_values[t]) << "mode " << mode << (t ? ": W^T's values" : ": W's values")
                                              << ", rows " << rows << ", cols " << cols << ", pitch " << pitch;
      EXPECT_EQ(x.download(), want_exponents[t]) << "mode " << mode << (t ? ": W^T's exponents" : ": W's exponents");
    };
    check(values, exponents, mode == 1 ? 1 : 0);
    if (mode == 2) check(values_t, exponents_t, 1);
  }
}

TEST(GpuFp8, VectorKernelWritesTheHostsBytesForWAndItsTranspose) {
  MOK_REQUIRE_HOPPER();
  expect_vector_matches_host(2, 256, 384, 384, 256 * 384, 21);             // whole blocks, the vector path
  expect_vector_matches_host(2, 256, 320, 320, 256 * 320, 25);             // vector blocks beside edge columns
  expect_vector_matches_host(3, 200, 320, 320, 200 * 320, 22);             // edge blocks: the element-wise code
  expect_vector_matches_host(2, 256, 256, 264, 256 * 264 + 8, 23);         // a padded pitch, aligned
  expect_vector_matches_host(2, 256, 256, 260, 256 * 260, 24);             // an unaligned pitch: element-wise
  // W aligned, W^T's rows (264 bytes) not 16-byte multiples: the whole launch element-wise when
  // values_t is written (modes 1 and 2), W's wide path alone (mode 0)
  expect_vector_matches_host(2, 264, 384, 384, 264 * 384, 26);
}

}  // namespace
}  // namespace mok::fp8
