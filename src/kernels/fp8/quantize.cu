// Blockwise FP8 quantization (kernels/fp8/quantize.cuh).
#include "kernels/fp8/quantize.cuh"

#include "kernels/common/load.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/quantize_rows.cuh"
#include "kernels/fp8/tile_order.cuh"

#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "mok/device_plan.hpp"

namespace mok::kernels {
namespace {

constexpr int kThreads = 256;

// The block kernel's wide path: its W^T staging: a whole block's E4M3 bytes as words (row r, word q: columns
// 4 q .. 4 q + 3) at r * 32 + (q ^ 4 (r / 16)), so that the eight 16-row segments a warp reads
// for its W^T rows fall in different banks; 16 KB.
__device__ __forceinline__ int block_tile_word(int r, int q) { return r * 32 + (q ^ (4 * (r / 16))); }

// A block's exponent where the launch writes it (thread 0): W's [e][rb][cb] unless transpose, and
// W^T's [e][cb][rb] — in exponents with transpose, in exponents_t with values_t.
__device__ __forceinline__ void store_block_exponent(const QuantizeParams& p, int e, int rb, int cb, int exponent) {
  if (threadIdx.x != 0) return;
  if (p.transpose) {
    p.exponents[e * p.exponents_expert_stride + cb * p.exponents_row_stride + rb] = exponent;
    return;
  }
  p.exponents[e * p.exponents_expert_stride + rb * p.exponents_row_stride + cb] = exponent;
  if (p.values_t != nullptr) p.exponents_t[e * p.exponents_t_expert_stride + cb * p.exponents_t_row_stride + rb] = exponent;
}

// W^T's bytes of block (rb, cb) of expert e: row c of the block at the result + c * row_stride
// (values with transpose, values_t with it set), or null where W^T is not written.
struct TransposedBlock {
  std::uint8_t* values;
  std::int64_t row_stride;
};
__device__ __forceinline__ TransposedBlock transposed_block(const QuantizeParams& p, int e, int rb, int cb) {
  if (!p.transpose && p.values_t == nullptr) return {nullptr, 0};
  const std::int64_t expert_stride = p.transpose ? p.values_expert_stride : p.values_t_expert_stride;
  const std::int64_t row_stride = p.transpose ? p.values_row_stride : p.values_t_row_stride;
  return {(p.transpose ? p.values : p.values_t) + e * expert_stride + static_cast<std::int64_t>(cb) * kFp8Block * row_stride +
              rb * kFp8Block,
          row_stride};
}

// The largest of every thread's v (a max: the same in any order), on every thread of the CTA;
// warp_max: kThreads / 32 floats of shared memory, free until the barrier inside.
__device__ __forceinline__ float cta_max(float v, float* warp_max) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  v = warp_max[0];
  for (int i = 1; i < kThreads / 32; ++i) v = fmaxf(v, warp_max[i]);
  return v;
}

// Block (rb, cb) of expert e, any shape and alignment (quantize_blocks_kernel's edge blocks, and its
// blocks where quantize_blocks_vector_ok fails): the block
// read twice, an element a thread at a time, and written a byte at a time (W^T through shared
// memory), with values_t as well where set. `tile`: 128 x 132 bytes of shared memory.
__device__ __forceinline__ void quantize_block_any(const QuantizeParams& p, int cb, int rb, int e, std::uint8_t (*tile)[kFp8Block + 4],
                                   float* warp_max) {
  const int r0 = rb * kFp8Block, c0 = cb * kFp8Block;
  const int rows = min(kFp8Block, p.rows - r0), cols = min(kFp8Block, p.cols - c0);
  const std::uint16_t* w = p.w + e * p.expert_stride + static_cast<std::int64_t>(r0) * p.row_stride + c0;
  float amax = 0.0f;
  for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) amax = fmaxf(amax, fabsf(bf16_bits_value(w[static_cast<std::int64_t>(r) * p.row_stride + c])));
  }
  amax = cta_max(amax, warp_max);
  const int exponent = fp8_scale_exponent(amax);
  const InverseScale inverse(exponent);
  auto value = [&](int r, int c) {
    const float x = inverse(bf16_bits_value(w[static_cast<std::int64_t>(r) * p.row_stride + c]));
    return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  };
  store_block_exponent(p, e, rb, cb, exponent);
  if (!p.transpose) {
    std::uint8_t* out = p.values + e * p.values_expert_stride + r0 * p.values_row_stride + c0;
    for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
      const int r = i / kFp8Block, c = i % kFp8Block;
      if (c < cols) out[r * p.values_row_stride + c] = value(r, c);
    }
  }
  const TransposedBlock out_t = transposed_block(p, e, rb, cb);
  if (out_t.values == nullptr) return;
  for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) tile[c][r] = value(r, c);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < cols * kFp8Block; i += kThreads) {
    const int c = i / kFp8Block, r = i % kFp8Block;
    if (r < rows) out_t.values[c * out_t.row_stride + r] = tile[c][r];
  }
}

// launch_quantize_blocks: a whole block read once,
// thread t its 16-byte pieces t % 16 of rows t / 16 + 16 j (j < 8: eight loads in flight), the
// largest magnitude a max.bf16x2 of abs.bf16x2 (exact, NaN ignored as fmaxf does) then a warp and a
// CTA max, the E4M3 bytes of a piece an 8-byte store into W's row (a warp's store: two rows' 128
// bytes); W^T through block_tile_word's tile, thread t writing 16 rows (16 s .. 16 s + 15, s = t % 8)
// of W^T rows 4 (t / 8) .. + 3 as four 16-byte stores (a warp's: four rows' 128 bytes), each from
// sixteen 4-byte shared loads and byte permutes. Edge blocks and unaligned views: quantize_block_any.
static_assert(kThreads == 256, "quantize_blocks_kernel: 16 threads a 128-column row, 8 a 16-row segment");
__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(const __grid_constant__ QuantizeParams p, bool vector_ok) {
  const int cb = blockIdx.x, rb = blockIdx.y, e = blockIdx.z;
  const int r0 = rb * kFp8Block, c0 = cb * kFp8Block;
  __shared__ alignas(16) std::uint32_t smem[kFp8Block * (kFp8Block + 4) / 4];  // (either path's tile)
  __shared__ float warp_max[kThreads / 32];
  if (!vector_ok || p.rows - r0 < kFp8Block || p.cols - c0 < kFp8Block) {
    quantize_block_any(p, cb, rb, e, reinterpret_cast<std::uint8_t (*)[kFp8Block + 4]>(smem), warp_max);
    return;
  }
  const std::uint16_t* w = p.w + e * p.expert_stride + static_cast<std::int64_t>(r0) * p.row_stride + c0;
  const int chunk = threadIdx.x % 16, row = threadIdx.x / 16;  // (rows row + 16 j)
  uint4 v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    v[j] = __ldcs(reinterpret_cast<const uint4*>(w + static_cast<std::int64_t>(row + 16 * j) * p.row_stride) + chunk);
  __nv_bfloat162 pair_max = __float2bfloat162_rn(0.0f);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::uint32_t words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) pair_max = __hmax2(pair_max, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&words[q])));
  }
  const float amax = cta_max(fmaxf(__low2float(pair_max), __high2float(pair_max)), warp_max);
  const int exponent = fp8_scale_exponent(amax);
  const InverseScale inverse(exponent);
  uint2 q[8];  // (the E4M3 bytes of piece `chunk` of rows row + 16 j)
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::uint32_t words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
    float f[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = inverse(bf16_bits_value(static_cast<std::uint16_t>(words[k] & 0xffff)));
      f[2 * k + 1] = inverse(bf16_bits_value(static_cast<std::uint16_t>(words[k] >> 16)));
    }
    q[j] = make_uint2(pack_e4m3x4(f[0], f[1], f[2], f[3]), pack_e4m3x4(f[4], f[5], f[6], f[7]));
  }
  store_block_exponent(p, e, rb, cb, exponent);
  if (!p.transpose) {
    std::uint8_t* out = p.values + e * p.values_expert_stride + static_cast<std::int64_t>(r0) * p.values_row_stride + c0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      *reinterpret_cast<uint2*>(out + static_cast<std::int64_t>(row + 16 * j) * p.values_row_stride + 8 * chunk) = q[j];
  }
  const TransposedBlock out_t = transposed_block(p, e, rb, cb);
  if (out_t.values == nullptr) return;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    *reinterpret_cast<uint2*>(&smem[block_tile_word(row + 16 * j, 2 * chunk)]) = q[j];
  __syncthreads();
  const int segment = threadIdx.x % 8, group = threadIdx.x / 8;  // (W rows 16 segment .. + 15; W columns 4 group .. + 3)
  std::uint32_t words[16];  // (W row 16 segment + i, columns 4 group .. + 3)
#pragma unroll
  for (int i = 0; i < 16; ++i) words[i] = smem[block_tile_word(16 * segment + i, group)];
  std::uint8_t* rows_t = out_t.values + (4 * group) * out_t.row_stride + 16 * segment;
#pragma unroll
  for (int b = 0; b < 4; ++b) {  // (W^T row c0 + 4 group + b: byte b of each word)
    const unsigned pick = b | ((4 + b) << 4);  // (byte b of the first word, then of the second)
    std::uint32_t t[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      t[k] = __byte_perm(__byte_perm(words[4 * k], words[4 * k + 1], pick), __byte_perm(words[4 * k + 2], words[4 * k + 3], pick),
                         0x5410);
    *reinterpret_cast<uint4*>(rows_t + b * out_t.row_stride) = make_uint4(t[0], t[1], t[2], t[3]);
  }
}

// Plan row `row`'s bf16 copy (QuantizeRowsParams::rows_bf16: rows before split there, the rest in
// rows_bf16_hi from its start), or null without one.
__device__ __forceinline__ std::uint16_t* bf16_copy_row(const QuantizeRowsParams& p, std::int64_t row) {
  if (p.rows_bf16 == nullptr) return nullptr;
  return row < p.split ? p.rows_bf16 + row * p.hidden : p.rows_bf16_hi + (row - p.split) * p.hidden;
}

// f(row) for each plan row of a token's k pairs (rows_of_token: pair_row's k entries; pairs routed
// nowhere, -1, skipped), in pair order, on every lane of the warp: lane i loads pair i0 + i's row,
// 32 at a time, and the warp takes them one by one.
template <class F>
__device__ __forceinline__ void for_each_token_row(const std::int32_t* rows_of_token, int k, F&& f) {
  const int lane = threadIdx.x % 32;
  for (int i0 = 0; i0 < k; i0 += 32) {
    const std::int32_t held = i0 + lane < k ? rows_of_token[i0 + lane] : -1;
    for (int i = 0; i < min(32, k - i0); ++i) {
      const std::int32_t row = __shfl_sync(0xffffffffu, held, i);
      if (row >= 0) f(static_cast<std::int64_t>(row));
    }
  }
}

// Block b's scale 2^exponent of plan row `row`, as its E8M0 byte.
__device__ __forceinline__ void store_row_scale(const QuantizeRowsParams& p, int b, std::int64_t row, int exponent) {
  p.exps[b * p.capacity + row] = e8m0_byte(exponent);
}

// The routed rows in plan order, quantized per 1 x 128 block as they are gathered (from any
// rank's tokens: expert parallelism): one warp a row, a lane 4 columns of each block (its amax is a warp max: the same in any order).
// Padding rows become zeros of scale 1; rows past the plan's last are not written. With
// rows_bf16, each lane also stores the bf16 values it read there.
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const __grid_constant__ QuantizeRowsParams p) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  const int lane = threadIdx.x % 32, blocks = p.hidden / kFp8Block;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  for (std::int64_t row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const std::int32_t pair = p.row_pair[row];
    std::uint32_t* values = reinterpret_cast<std::uint32_t*>(p.values + row * p.hidden) + lane;
    std::uint16_t* copy_row = bf16_copy_row(p, row);  // (optional)
    uint2* copy = copy_row != nullptr ? reinterpret_cast<uint2*>(copy_row) + lane : nullptr;
    if (pair < 0) {
      for (int b = 0; b < blocks; ++b) {
        values[b * 32] = 0;
        if (copy != nullptr) copy[b * 32] = make_uint2(0, 0);
        if (lane == 0) store_row_scale(p, b, row, 0);
      }
      continue;
    }
    const std::int64_t token = (pair % p.pairs_per_rank) / p.top_k;
    const uint2* x = reinterpret_cast<const uint2*>(p.x[pair / p.pairs_per_rank] + token * p.hidden) + lane;
    for (int b0 = 0; b0 < blocks; b0 += 4) {
      uint2 bits[4];
      load_four_blocks(x, b0, blocks, bits);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (b0 + j >= blocks) break;
        if (copy != nullptr) copy[(b0 + j) * 32] = bits[j];
        const QuantizedLane q = quantize_lane(bits[j]);
        values[(b0 + j) * 32] = q.values;
        if (lane == 0) store_row_scale(p, b0 + j, row, q.exponent);
      }
    }
  }
}

// The plan's padding rows among rows warp * 32 .., (warp + warps) * 32 .., ...: zeros of scale 1
// (and bf16 zeros with rows_bf16), on every lane of the calling warps.
__device__ __forceinline__ void scatter_padding_rows(const QuantizeRowsParams& p, std::int64_t warp, std::int64_t warps) {
  const int lane = threadIdx.x % 32, blocks = p.hidden / kFp8Block;
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  for (std::int64_t base = warp * 32; base < rows; base += warps * 32) {
    unsigned padding = __ballot_sync(0xffffffffu, base + lane < rows && p.row_pair[base + lane] < 0);
    for (; padding; padding &= padding - 1) {
      const std::int64_t row = base + __ffs(padding) - 1;
      std::uint32_t* values = reinterpret_cast<std::uint32_t*>(p.values + row * p.hidden) + lane;
      std::uint16_t* copy_row = bf16_copy_row(p, row);
      uint2* copy = copy_row != nullptr ? reinterpret_cast<uint2*>(copy_row) + lane : nullptr;
      for (int b = 0; b < blocks; ++b) {
        values[b * 32] = 0;
        if (copy != nullptr) copy[b * 32] = make_uint2(0, 0);
        if (lane == 0) store_row_scale(p, b, row, 0);
      }
    }
  }
}

// One GPU (pair_row set): the same rows, x read once. One warp a token quantizes 4 blocks of its
// row at a time (the values and scales any of its rows gets: they depend on the token's values
// alone) and stores them to each of the token's k rows, pairs in order; then the padding rows of
// the warp's share of the plan. The gather above reads a token's row once per pair, too far apart
// for the L2 to keep x between them.
__global__ void __launch_bounds__(kThreads) quantize_scatter_kernel(const __grid_constant__ QuantizeRowsParams p) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  const int lane = threadIdx.x % 32, blocks = p.hidden / kFp8Block, k = p.top_k;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  const std::int64_t warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;

  const std::int64_t tokens = p.pairs / k;
  for (std::int64_t token = warp; token < tokens; token += warps) {
    const uint2* x = reinterpret_cast<const uint2*>(p.x[0] + token * p.hidden) + lane;
    const std::int32_t* rows_of_token = p.pair_row + token * k;
    for (int b0 = 0; b0 < blocks; b0 += 4) {
      uint2 bits[4];
      load_four_blocks(x, b0, blocks, bits);
      QuantizedLane q[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) q[j] = quantize_lane(bits[j]);  // (blocks past the row: never stored)
      for_each_token_row(rows_of_token, k, [&](std::int64_t row) {
        std::uint32_t* values = reinterpret_cast<std::uint32_t*>(p.values + row * p.hidden) + lane;
        std::uint16_t* copy_row = bf16_copy_row(p, row);  // (optional)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (b0 + j >= blocks) break;
          values[(b0 + j) * 32] = q[j].values;
          if (copy_row != nullptr) reinterpret_cast<uint2*>(copy_row)[lane + (b0 + j) * 32] = bits[j];
          if (lane == 0) store_row_scale(p, b0 + j, row, q[j].exponent);
        }
      });
    }
  }
  scatter_padding_rows(p, warp, warps);
}

__global__ void __launch_bounds__(kThreads) quantize_tokens_kernel(const std::uint16_t* src, std::uint8_t* out,
                                                                   std::int64_t tokens, int hidden) {
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  quantize_token_rows(src, out, tokens, hidden, blockIdx.x * (kThreads / 32) + threadIdx.x / 32, warps);
}

// One warp a plan row: its token's E4M3 row (warp_copy_row, as the bf16 dispatch) and its scale bytes.
__global__ void __launch_bounds__(kThreads) gather_fp8_rows_kernel(const __grid_constant__ GatherFp8RowsParams p) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  const int lane = threadIdx.x % 32, vectors = p.hidden / 16, blocks = p.hidden / kFp8Block;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  for (std::int64_t row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const std::int32_t pair = p.row_pair[row];
    uint4* dst = reinterpret_cast<uint4*>(p.values + row * p.hidden);
    if (pair < 0) {
      for (int v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
      for (int b = lane; b < blocks; b += 32) p.exps[b * p.capacity + row] = e8m0_byte(0);
      continue;
    }
    const std::uint8_t* source = p.sources[pair / p.pairs_per_rank];
    const std::int64_t token = (pair % p.pairs_per_rank) / p.top_k;
    const std::uint8_t* src_exps = source + p.tokens * p.hidden + token * blocks;
    warp_copy_row(dst, reinterpret_cast<const uint4*>(source + token * p.hidden), vectors, lane);
    for (int b = lane; b < blocks; b += 32) p.exps[b * p.capacity + row] = src_exps[b];
  }
}

// The plan tile at grid position `position` (blockIdx.x; launch_tile_order's order where given),
// or -1 past the plan's last tile or from a bad plan.
__device__ __forceinline__ int column_tile_plan_tile(const QuantizeColumnsParams& p, int position) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return -1;
  if (position >= *p.num_tiles) return -1;
  return p.tile_order != nullptr ? p.tile_order[position] : position;
}

// The column tiles [first, end) of a CTA's strip: [y n, y n + n), n = the column tiles /
// gridDim.y rounded up (never empty for launch_quantize_columns' grids).
struct ColumnStrip {
  int first, end;
};
__device__ __forceinline__ ColumnStrip column_strip(const QuantizeColumnsParams& p) {
  const int column_tiles = p.columns / kFp8Block, per_cta = (column_tiles + gridDim.y - 1) / gridDim.y;
  const int first = blockIdx.y * per_cta;
  return {first, min(column_tiles, first + per_cta)};
}

// Where plan row `row` starts in src (elements; -1: a padding row, read as zeros); find_row_offsets:
// rows [row0, row0 + 128), one thread a row, then a barrier — found once for every column tile of a strip.
__device__ __forceinline__ std::int64_t plan_row_offset(const QuantizeColumnsParams& p, std::int64_t row) {
  if (p.row_pair == nullptr) return row * p.row_stride;
  const std::int32_t pair = p.row_pair[row];
  return pair >= 0 ? static_cast<std::int64_t>(pair / p.top_k) * p.row_stride : -1;
}
__device__ __forceinline__ void find_row_offsets(const QuantizeColumnsParams& p, std::int64_t row0, std::int64_t* row_offset) {
  if (threadIdx.x < kFp8Block) row_offset[threadIdx.x] = plan_row_offset(p, row0 + threadIdx.x);
  __syncthreads();
}

// A strip's column tiles, at most: each CTA's start (the plan loads, the row offsets, its first
// tile's loads) is exposed once a strip. (Strips of 8, and persistent CTAs that prepare the next
// strip's start during the one before: the same time at the H100's power limit, bench/NOTES.md,
// twenty-fourth session.)
constexpr int kColumnTilesPerStrip = 4;

// The column kernel's loads of column tile ct: lane (g, h) of warp w, rows 8 g + j (j < 8) of
// columns [16 w + 8 h, + 8), one 16-byte load a row (row_offset: the plan rows' starts in src,
// elements; -1: a padding row, zeros).
__device__ __forceinline__ void load_column_tile(const QuantizeColumnsParams& p, const std::int64_t* row_offset, int ct,
                                                 uint4 (&v)[8]) {
  const int g = (threadIdx.x % 32) / 2, column = 16 * (threadIdx.x / 32) + 8 * (threadIdx.x % 2);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::int64_t offset = row_offset[8 * g + j];
    v[j] = offset >= 0 ? __ldcg(reinterpret_cast<const uint4*>(p.src + offset + ct * kFp8Block + column))
                       : make_uint4(0, 0, 0, 0);
  }
}

// Column tile ct of plan tile `tile` (rows from row0), held as load_column_tile left it: each
// column's largest magnitude, exponent and E4M3 bytes, stored transposed, and its scale's E8M0 byte
// (or the block's exponent). Every thread of the CTA takes part; with block exponents it passes one
// barrier, its warp maxima in warp_max[parity] (a caller alternates parity tile by tile).
__device__ __forceinline__ void quantize_column_tile(const QuantizeColumnsParams& p, const uint4 (&v)[8], int tile,
                                                     std::int64_t row0, int ct, float (&warp_max)[2][kThreads / 32],
                                                     int parity) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 2, h = lane % 2;
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
    __syncthreads();  // (the array of the tile before the last was read before the last one's barrier)
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[parity][w]);
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
  if (p.block_exponents != nullptr && threadIdx.x == 0)
    p.block_exponents[static_cast<std::int64_t>(ct) * p.exponent_stride + tile] = mine;
}

// The column quantization (launch_quantize_columns): a strip of up to kColumnTilesPerStrip column
// tiles of one plan tile a CTA, transposed in registers, without staging the rows in shared
// memory. CTA (x, y): column tiles [y n, y n + n) of the plan tile at position x (column_strip),
// so the CTAs launched together walk one band of columns down the plan's tiles and a gather's k
// reads of a token row meet in the L2; the plan rows' source offsets are found once a strip. Warp w takes
// columns [16 w, 16 w + 16) of each column tile; lane (g, h) = (lane / 2, lane % 2) loads rows
// [8 g, 8 g + 8) of columns [16 w + 8 h, + 8) (one 16-byte load a row: a warp's load reads 16
// rows' 32 bytes), takes each column's largest magnitude over its rows and then over the 16 lanes
// of its h (shuffles), and stores each column's 8 E4M3 bytes of its rows (a warp's store writes
// two whole 128-byte column segments). The next tile's loads are issued before a tile is
// quantized. Block exponents take one barrier a tile (their warp maxima alternate between two
// arrays). Measured against the kernel it replaced (a 128 x 128 tile a CTA staged in shared memory,
// latency-bound at 1.6 TB/s): 0.54x its time, and 0.967x the FP8 forward+backward's on
// deepseek-v3 and kimi-k2 at the H100's power cap (bench/NOTES.md, twenty-third session).
__global__ void __launch_bounds__(kThreads, 2) quantize_column_regs_kernel(const __grid_constant__ QuantizeColumnsParams p) {
  const int tile = column_tile_plan_tile(p, blockIdx.x);
  if (tile < 0) return;
  __shared__ alignas(16) std::int64_t row_offset[kFp8Block];  // (elements into src; -1: a padding row, zeros)
  __shared__ float warp_max[2][kThreads / 32];
  const std::int64_t row0 = static_cast<std::int64_t>(tile) * kFp8Block;
  const ColumnStrip strip = column_strip(p);
  if (strip.first >= strip.end) return;
  find_row_offsets(p, row0, row_offset);
  uint4 v[8];
  load_column_tile(p, row_offset, strip.first, v);
  for (int ct = strip.first; ct < strip.end; ++ct) {
    uint4 next[8];
    if (ct + 1 < strip.end) load_column_tile(p, row_offset, ct + 1, next);
    quantize_column_tile(p, v, tile, row0, ct, warp_max, ct % 2);
    if (ct + 1 < strip.end) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = next[j];
    }
  }
}

__global__ void __launch_bounds__(kThreads) tile_order_kernel(const std::int32_t* expert_offset, const std::int32_t* tile_expert,
                                                              const std::int32_t* tile_row, const std::int32_t* num_tiles,
                                                              const void* plan_status, int experts, std::int32_t* order) {
  if (static_cast<const PlanStatus*>(plan_status)->code != PlanStatus::ok) return;
  const int t = blockIdx.x * kThreads + threadIdx.x;
  if (t >= *num_tiles) return;
  const int e = tile_expert[t], r = (tile_row[t] - expert_offset[e]) / kFp8Block;
  const auto tiles = [expert_offset](int x) { return (expert_offset[x + 1] - expert_offset[x]) / kFp8Block; };
  order[rank_order_position(experts, e, r, tiles)] = t;
}

}  // namespace

void launch_quantize_rows(const QuantizeRowsParams& p, int num_ctas, cudaStream_t stream) {
  if (p.pair_row == nullptr)
    quantize_rows_kernel<<<num_ctas, kThreads, 0, stream>>>(p);
  else
    quantize_scatter_kernel<<<num_ctas, kThreads, 0, stream>>>(p);
}

bool quantize_blocks_vector_ok(const QuantizeParams& p) {
  const auto aligned = [](const void* ptr, std::int64_t bytes) { return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0; };
  bool ok = aligned(p.w, 16) && p.row_stride % 8 == 0 && p.expert_stride % 8 == 0;  // (bf16: 16 bytes)
  if (p.transpose) ok = ok && aligned(p.values, 16) && p.values_row_stride % 16 == 0 && p.values_expert_stride % 16 == 0;
  else ok = ok && aligned(p.values, 8) && p.values_row_stride % 8 == 0 && p.values_expert_stride % 8 == 0;
  if (!p.transpose && p.values_t != nullptr)
    ok = ok && aligned(p.values_t, 16) && p.values_t_row_stride % 16 == 0 && p.values_t_expert_stride % 16 == 0;
  return ok;
}

void launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream) {
  if (p.experts == 0 || p.rows == 0 || p.cols == 0) return;
  const dim3 grid((p.cols + kFp8Block - 1) / kFp8Block, (p.rows + kFp8Block - 1) / kFp8Block, p.experts);
  quantize_blocks_kernel<<<grid, kThreads, 0, stream>>>(p, quantize_blocks_vector_ok(p));
}

void launch_tile_order(const std::int32_t* expert_offset, const std::int32_t* tile_expert, const std::int32_t* tile_row,
                       const std::int32_t* num_tiles, const void* plan_status, int experts, std::int64_t max_tiles,
                       std::int32_t* order, cudaStream_t stream) {
  if (max_tiles == 0) return;
  const unsigned blocks = static_cast<unsigned>((max_tiles + kThreads - 1) / kThreads);
  tile_order_kernel<<<blocks, kThreads, 0, stream>>>(expert_offset, tile_expert, tile_row, num_tiles, plan_status, experts,
                                                     order);
}

void launch_quantize_tokens(const std::uint16_t* src, std::uint8_t* out, std::int64_t tokens, int hidden, int num_ctas,
                            cudaStream_t stream) {
  if (tokens == 0) return;
  quantize_tokens_kernel<<<num_ctas, kThreads, 0, stream>>>(src, out, tokens, hidden);
}

void launch_gather_fp8_rows(const GatherFp8RowsParams& p, int num_ctas, cudaStream_t stream) {
  gather_fp8_rows_kernel<<<num_ctas, kThreads, 0, stream>>>(p);
}

void load_quantize_kernels() {
  load_kernel(quantize_tokens_kernel);
  load_kernel(gather_fp8_rows_kernel);
  load_kernel(quantize_rows_kernel);
  load_kernel(quantize_scatter_kernel);
  load_kernel(quantize_column_regs_kernel);
  load_kernel(tile_order_kernel);
  load_kernel(quantize_blocks_kernel);
}

void launch_quantize_columns(const QuantizeColumnsParams& p, cudaStream_t stream) {
  if (p.capacity == 0 || p.columns == 0) return;
  const int column_tiles = p.columns / kFp8Block;
  const unsigned tiles = static_cast<unsigned>(p.capacity / kFp8Block);
  const int strips = (column_tiles + kColumnTilesPerStrip - 1) / kColumnTilesPerStrip;
  quantize_column_regs_kernel<<<dim3(tiles, strips), kThreads, 0, stream>>>(p);
}

}  // namespace mok::kernels
