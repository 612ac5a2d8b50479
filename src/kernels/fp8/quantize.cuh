// Blockwise FP8 quantization of bf16 weights on the GPU: E4M3 values and one power-of-two
// scale per 128 x 128 block of each expert's [rows, cols] matrix (DeepSeek-V3's weight
// recipe; mok/fp8.hpp's host quantize() with block 128 x 128 gives the same bytes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok::kernels {

inline constexpr int kFp8Block = 128;  // rows and columns of a weight block

struct QuantizeParams {
  const std::uint16_t* w;   // bf16 [experts, rows, cols], contiguous rows
  std::int64_t expert_stride, row_stride;  // elements
  std::uint8_t* values;     // E4M3 [experts, rows, cols], contiguous
  std::int32_t* exponents;  // [experts, ceil(rows / 128), ceil(cols / 128)]: the block's scale is 2^e
  int experts, rows, cols;
};

// One CTA a block: its largest magnitude (a max: any order gives the same value), then
// every element divided by the block's scale (exact: a power of two) and rounded to E4M3
// (nearest, ties to even, saturating).
void launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream);

}  // namespace mok::kernels
