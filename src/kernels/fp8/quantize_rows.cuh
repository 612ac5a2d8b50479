// One 1 x 128 block of a bf16 row quantized by a warp (a lane 4 values: its amax a warp max, the
// same in any order), and a rank's own tokens quantized row by row into a token-major buffer: the
// device pieces the row gathers (kernels/fp8/quantize.cu) and the EP exchange
// (kernels/ep/exchange.cu) share, so that every path gives a token's row the same bytes.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/quantize.cuh"

namespace mok::kernels {

__device__ __forceinline__ float bf16_bits_value(std::uint16_t bits) { return __bfloat162float(__ushort_as_bfloat16(bits)); }

// A lane's 4 values of a 1 x 128 block (bits: 4 bf16), quantized with the block's scale (its
// amax a warp max: the same in any order). Every lane of the warp takes part.
struct QuantizedLane {
  std::uint32_t values;  // 4 E4M3
  int exponent;          // the block's scale 2^exponent (fp8_scale_exponent's)
};
__device__ __forceinline__ QuantizedLane quantize_lane(uint2 bits) {
  const float v[4] = {bf16_bits_value(bits.x & 0xffff), bf16_bits_value(bits.x >> 16), bf16_bits_value(bits.y & 0xffff),
                      bf16_bits_value(bits.y >> 16)};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const int e = fp8_scale_exponent(amax);
  const InverseScale inverse(e);
  return {pack_e4m3x4(inverse(v[0]), inverse(v[1]), inverse(v[2]), inverse(v[3])), e};
}

// A lane's uint2 of blocks b0 .. b0 + 3 of a row (x: the row's first, offset by the lane), the
// loads in flight together; past the row's `blocks`, zeros (quantized to zeros of scale 1).
__device__ __forceinline__ void load_four_blocks(const uint2* x, int b0, int blocks, uint2 (&bits)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) bits[j] = b0 + j < blocks ? x[(b0 + j) * 32] : make_uint2(0, 0);
}

// Tokens warp, warp + warps, ... of src ([tokens, hidden] bf16, hidden a multiple of 128) into
// `out` (kernels/fp8/quantize.cuh's fp8_token_bytes layout), on every lane of the calling warps.
__device__ inline void quantize_token_rows(const std::uint16_t* src, std::uint8_t* out, std::int64_t tokens, int hidden,
                                           std::int64_t warp, std::int64_t warps) {
  const int lane = threadIdx.x % 32, blocks = hidden / 128;
  std::uint8_t* exps = out + tokens * hidden;
  for (std::int64_t token = warp; token < tokens; token += warps) {
    const uint2* x = reinterpret_cast<const uint2*>(src + token * hidden) + lane;
    std::uint32_t* values = reinterpret_cast<std::uint32_t*>(out + token * hidden) + lane;
    for (int b0 = 0; b0 < blocks; b0 += 4) {
      uint2 bits[4];
      load_four_blocks(x, b0, blocks, bits);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const QuantizedLane q = quantize_lane(bits[j]);  // (every lane: the warp max)
        if (b0 + j >= blocks) continue;
        values[(b0 + j) * 32] = q.values;
        if (lane == 0) exps[token * blocks + b0 + j] = e8m0_byte(q.exponent);
      }
    }
  }
}

}  // namespace mok::kernels
