// A 128 x 128 column tile of bf16 plan rows quantized per column (a scale per channel and 128 rows, or
// one per 128 x 128 block) and stored transposed, by 256 threads: the device pieces of the column
// quantization (launch_quantize_columns, kernels/fp8/quantize.cu), shared with any kernel whose 256
// threads quantize a tile they have just written (bench/pending/dh-columns-wip.patch: the FP8 dgrad
// kernel's consumers). `Threads` says which threads they are: tid() 0 .. 255 (unsigned), and sync() a
// barrier of all of them (CtaColumnThreads: a 256-thread CTA).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/quantize.cuh"
#include "kernels/fp8/quantize_rows.cuh"

namespace mok::kernels {

inline constexpr int kColumnThreads = 256;

struct CtaColumnThreads {
  __device__ __forceinline__ unsigned tid() const { return threadIdx.x; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};

// The column kernel's loads of column tile ct: lane (g, h) of warp w, rows 8 g + j (j < 8) of
// columns [16 w + 8 h, + 8), one 16-byte load a row (row_offset: the plan rows' starts in src,
// elements; -1: a padding row, zeros).
// (RowOffsets: anything with row_offset[r], e.g. the column kernel's shared array.)
template <typename RowOffsets, typename Threads>
__device__ __forceinline__ void load_column_tile(const QuantizeColumnsParams& p, RowOffsets row_offset, int ct,
                                                 uint4 (&v)[8], Threads threads) {
  const unsigned tid = threads.tid();  // (unsigned: the index arithmetic as on threadIdx.x)
  const int g = (tid % 32) / 2, column = 16 * (tid / 32) + 8 * (tid % 2);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::int64_t offset = row_offset[8 * g + j];
    v[j] = offset >= 0 ? __ldcg(reinterpret_cast<const uint4*>(p.src + offset + ct * kFp8Block + column))
                       : make_uint4(0, 0, 0, 0);
  }
}

// Column tile ct of plan tile `tile` (rows from row0), held as load_column_tile left it: each
// column's largest magnitude, exponent and E4M3 bytes, stored transposed, and its scale's E8M0 byte
// (or the block's exponent). Every one of the threads takes part; with block exponents they pass one
// barrier, their warp maxima in warp_max[parity] (a caller alternates parity tile by tile).
template <typename Threads>
__device__ __forceinline__ void quantize_column_tile(const QuantizeColumnsParams& p, const uint4 (&v)[8], int tile,
                                                     std::int64_t row0, int ct, float (&warp_max)[2][kColumnThreads / 32],
                                                     int parity, Threads threads) {
  const unsigned tid = threads.tid();
  const int warp = tid / 32, lane = tid % 32, g = lane / 2, h = lane % 2;
  const int column = 16 * warp + 8 * h;  // (the lane's first column in a column tile)
  // (bf16 k of a row's 16 bytes: column k of the lane's eight)
  auto value = [](const uint4& row, int k) {
    const std::uint32_t word = k / 2 == 0 ? row.x : k / 2 == 1 ? row.y : k / 2 == 2 ? row.z : row.w;
    return bf16_bits_value(static_cast<std::uint16_t>(k % 2 == 0 ? word & 0xffff : word >> 16));
  };
  // Each column's largest magnitude as bf16 pairs (word q: columns 2 q, 2 q + 1): max.bf16x2 of
  // the magnitudes returns the other operand where one is NaN, as fmaxf does, and is exact, so
  // these are the floats' maxima; no floats are made here (unpacked, the 64 values took ~60
  // registers more).
  __nv_bfloat162 pair_max[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    pair_max[q] = __float2bfloat162_rn(0.0f);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const std::uint32_t word = q == 0 ? v[j].x : q == 1 ? v[j].y : q == 2 ? v[j].z : v[j].w;
      pair_max[q] = __hmax2(pair_max[q], __habs2(*reinterpret_cast<const __nv_bfloat162*>(&word)));
    }
#pragma unroll
    for (int offset = 2; offset < 32; offset *= 2) pair_max[q] = __hmax2(pair_max[q], __shfl_xor_sync(0xffffffffu, pair_max[q], offset));
  }
  float amax[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) amax[k] = k % 2 == 0 ? __low2float(pair_max[k / 2]) : __high2float(pair_max[k / 2]);
  if (p.block_exponents != nullptr) {  // the block's: a max over the columns too
    float m = amax[0];
#pragma unroll
    for (int k = 1; k < 8; ++k) m = fmaxf(m, amax[k]);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    if (lane == 0) warp_max[parity][warp] = m;
    threads.sync();  // (the array of the tile before the last was read before the last one's barrier)
#pragma unroll
    for (int w = 0; w < kColumnThreads / 32; ++w) m = fmaxf(m, warp_max[parity][w]);
#pragma unroll
    for (int k = 0; k < 8; ++k) amax[k] = m;
  }
  // Column k's exponent and inverse scale are computed once, by lane (k, h) of the 16 that hold
  // its maximum, and shuffled to the others (eight exponents a lane were ~40 % of the loop's
  // instructions).
  float my_amax = amax[0];
#pragma unroll
  for (int k = 1; k < 8; ++k)
    if (g % 8 == k) my_amax = amax[k];
  const int mine = fp8_scale_exponent(my_amax);  // (lane g < 8: column g's)
  const InverseScale my_inverse(mine);
  const int c0 = ct * kFp8Block;
  std::uint8_t* out = p.values + static_cast<std::int64_t>(c0 + column) * p.capacity + row0 + 8 * g;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float a = __shfl_sync(0xffffffffu, my_inverse.a, 2 * k + h);
    float s[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j] = value(v[j], k) * a;  // (InverseScale's operator())
    *reinterpret_cast<uint2*>(out + static_cast<std::int64_t>(k) * p.capacity) =
        make_uint2(pack_e4m3x4(s[0], s[1], s[2], s[3]), pack_e4m3x4(s[4], s[5], s[6], s[7]));
  }
  if (p.col_exps != nullptr && g < 8)
    p.col_exps[static_cast<std::int64_t>(tile) * p.columns + c0 + column + g] = e8m0_byte(mine);
  if (p.block_exponents != nullptr && tid == 0)
    p.block_exponents[static_cast<std::int64_t>(ct) * p.exponent_stride + tile] = mine;
}

}  // namespace mok::kernels
