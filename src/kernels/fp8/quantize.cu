// Blockwise FP8 quantization (kernels/fp8/quantize.cuh).
#include "kernels/fp8/quantize.cuh"

#include "kernels/common/load.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/quantize_rows.cuh"
#include "kernels/fp8/tile_order.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "mok/device_plan.hpp"

namespace mok::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(QuantizeParams p) {
  const int cb = blockIdx.x, rb = blockIdx.y, e = blockIdx.z;
  const int r0 = rb * kFp8Block, c0 = cb * kFp8Block;
  const int rows = min(kFp8Block, p.rows - r0), cols = min(kFp8Block, p.cols - c0);
  const std::uint16_t* w = p.w + e * p.expert_stride + static_cast<std::int64_t>(r0) * p.row_stride + c0;
  float amax = 0.0f;
  for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) amax = fmaxf(amax, fabsf(bf16_bits_value(w[static_cast<std::int64_t>(r) * p.row_stride + c])));
  }
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
  for (int i = 1; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const int exponent = fp8_scale_exponent(amax);
  const InverseScale inverse(exponent);
  auto value = [&](int r, int c) {
    const float x = inverse(bf16_bits_value(w[static_cast<std::int64_t>(r) * p.row_stride + c]));
    return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  };
  if (!p.transpose) {
    if (threadIdx.x == 0) p.exponents[e * p.exponents_expert_stride + rb * p.exponents_row_stride + cb] = exponent;
    std::uint8_t* out = p.values + e * p.values_expert_stride + r0 * p.values_row_stride + c0;
    for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
      const int r = i / kFp8Block, c = i % kFp8Block;
      if (c < cols) out[r * p.values_row_stride + c] = value(r, c);
    }
    return;
  }
  // Transposed: the block's bytes through shared memory, then written as rows of W^T.
  __shared__ std::uint8_t tile[kFp8Block][kFp8Block + 4];
  if (threadIdx.x == 0) p.exponents[e * p.exponents_expert_stride + cb * p.exponents_row_stride + rb] = exponent;
  for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) tile[c][r] = value(r, c);
  }
  __syncthreads();
  std::uint8_t* out = p.values + e * p.values_expert_stride + c0 * p.values_row_stride + r0;
  for (int i = threadIdx.x; i < cols * kFp8Block; i += kThreads) {
    const int c = i / kFp8Block, r = i % kFp8Block;
    if (r < rows) out[c * p.values_row_stride + r] = tile[c][r];
  }
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
    uint2* copy = nullptr;  // the bf16 copy's row (optional)
    if (p.rows_bf16 != nullptr)
      copy = reinterpret_cast<uint2*>(row < p.split ? p.rows_bf16 + row * p.hidden : p.rows_bf16_hi + (row - p.split) * p.hidden) + lane;
    if (pair < 0) {
      for (int b = 0; b < blocks; ++b) {
        values[b * 32] = 0;
        if (copy != nullptr) copy[b * 32] = make_uint2(0, 0);
        if (lane == 0) p.scales[b * p.capacity + row] = 1.0f;
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
        if (lane == 0) p.scales[(b0 + j) * p.capacity + row] = q.scale;
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
  auto values_at = [&](std::int64_t row) { return reinterpret_cast<std::uint32_t*>(p.values + row * p.hidden) + lane; };
  auto copy_at = [&](std::int64_t row) {  // the bf16 copy's row (optional)
    return p.rows_bf16 == nullptr ? nullptr
                                  : reinterpret_cast<uint2*>(row < p.split ? p.rows_bf16 + row * p.hidden
                                                                           : p.rows_bf16_hi + (row - p.split) * p.hidden) + lane;
  };
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
      for (int i0 = 0; i0 < k; i0 += 32) {  // (lane i holds pair i0 + i's row)
        const std::int32_t mine = i0 + lane < k ? rows_of_token[i0 + lane] : -1;
        for (int i = 0; i < min(32, k - i0); ++i) {
          const std::int32_t row = __shfl_sync(0xffffffffu, mine, i);
          if (row < 0) continue;  // (a pair routed nowhere: no row)
          std::uint32_t* values = values_at(row);
          uint2* copy = copy_at(row);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (b0 + j >= blocks) break;
            values[(b0 + j) * 32] = q[j].values;
            if (copy != nullptr) copy[(b0 + j) * 32] = bits[j];
            if (lane == 0) p.scales[(b0 + j) * p.capacity + row] = q[j].scale;
          }
        }
      }
    }
  }
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  for (std::int64_t base = warp * 32; base < rows; base += warps * 32) {
    unsigned padding = __ballot_sync(0xffffffffu, base + lane < rows && p.row_pair[base + lane] < 0);
    for (; padding; padding &= padding - 1) {
      const std::int64_t row = base + __ffs(padding) - 1;
      std::uint32_t* values = values_at(row);
      uint2* copy = copy_at(row);
      for (int b = 0; b < blocks; ++b) {
        values[b * 32] = 0;
        if (copy != nullptr) copy[b * 32] = make_uint2(0, 0);
        if (lane == 0) p.scales[b * p.capacity + row] = 1.0f;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) quantize_tokens_kernel(const std::uint16_t* src, std::uint8_t* out,
                                                                   std::int64_t tokens, int hidden) {
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  quantize_token_rows(src, out, tokens, hidden, blockIdx.x * (kThreads / 32) + threadIdx.x / 32, warps);
}

// One warp a plan row: its token's E4M3 row (warp_copy_row, as the bf16 dispatch) and its scales.
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
      for (int b = lane; b < blocks; b += 32) p.scales[b * p.capacity + row] = 1.0f;
      continue;
    }
    const std::uint8_t* source = p.sources[pair / p.pairs_per_rank];
    const std::int64_t token = (pair % p.pairs_per_rank) / p.top_k;
    const float* src_scales = reinterpret_cast<const float*>(source + p.tokens * p.hidden) + token * blocks;
    warp_copy_row(dst, reinterpret_cast<const uint4*>(source + token * p.hidden), vectors, lane);
    for (int b = lane; b < blocks; b += 32) p.scales[b * p.capacity + row] = src_scales[b];
  }
}

// (diagnostic builds, bench/NOTES.md) A tile's E4M3 transpose staged in shared memory, column c's
// 128 bytes at kStagedStride c, stored 16 bytes a thread and 8 threads a column: a warp writes 4
// whole 128-byte column segments. column: the tile's first column's rows in values.
#if defined(MOK_DIAG_QCOLS_STAGED) && defined(MOK_DIAG_QCOLS_PAIRS)
#error "MOK_DIAG_QCOLS_STAGED and MOK_DIAG_QCOLS_PAIRS are separate variants (PAIRS stages its stores too)"
#endif
#if defined(MOK_DIAG_QCOLS_OCC5) && !defined(MOK_DIAG_QCOLS_STAGED)
#error "MOK_DIAG_QCOLS_OCC5 bounds the staged variant's registers: define MOK_DIAG_QCOLS_STAGED with it"
#endif
#if defined(MOK_DIAG_QCOLS_STAGED) || defined(MOK_DIAG_QCOLS_PAIRS)
constexpr int kStagedStride = kFp8Block + 16;  // bytes a staged column (16-byte aligned)
__device__ __forceinline__ void store_staged(const std::uint8_t* staged, std::uint8_t* column, std::int64_t capacity) {
#pragma unroll
  for (int i = 0; i < kFp8Block * kFp8Block / 16 / kThreads; ++i) {
    const int chunk16 = i * kThreads + threadIdx.x, col = chunk16 / 8, part = chunk16 % 8;
    *reinterpret_cast<uint4*>(column + static_cast<std::int64_t>(col) * capacity + 16 * part) =
        *reinterpret_cast<const uint4*>(staged + col * kStagedStride + 16 * part);
  }
}
#endif

#if defined(MOK_DIAG_QCOLS_STAGED) && defined(MOK_DIAG_QCOLS_OCC5)
// (the staged stores with at most 48 registers: 5 CTAs an SM, 36 bytes spilled; alone, the staged
// variant takes 64 registers, 4 CTAs an SM; the default 40, 6 — its shared memory's limit)
#define MOK_QCOLS_BOUNDS __launch_bounds__(kThreads, 5)
#else
#define MOK_QCOLS_BOUNDS __launch_bounds__(kThreads)
#endif
// One plan tile of 128 rows x 128 columns (launch_quantize_columns): the bf16 rows into shared
// memory (16-byte loads, a warp two rows' 256 bytes, a thread's eight in flight together), each
// column's largest magnitude (thread c of each half scans 64 rows; a warp reads 32 adjacent
// columns of a row: no bank conflicts), then thread (c, half) writes its 64 rows of column c as
// 64 contiguous E4M3 bytes.
__global__ void MOK_QCOLS_BOUNDS quantize_columns_kernel(const __grid_constant__ QuantizeColumnsParams p) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  if (static_cast<int>(blockIdx.y) >= *p.num_tiles) return;
  const int tile = p.tile_order != nullptr ? p.tile_order[blockIdx.y] : static_cast<int>(blockIdx.y);
  const int c0 = blockIdx.x * kFp8Block;
  constexpr int kStride = kFp8Block + 8;  // (bf16 elements a shared row: 16-byte aligned rows)
  __shared__ alignas(16) std::uint16_t rows[kFp8Block][kStride];
#if !defined(MOK_DIAG_QCOLS_PAIRS)
  __shared__ float half_max[2][kFp8Block];
#endif
  __shared__ float warp_max[kThreads / 32];
  const std::int64_t row0 = static_cast<std::int64_t>(tile) * kFp8Block;
  // Each thread's 8 chunks of 16 bytes (rows threadIdx.x / 16 + 16 j), all loads in flight at once.
  constexpr int kChunks = kFp8Block * 16 / kThreads;
  const int chunk = threadIdx.x % 16;
  std::int32_t pair[kChunks];  // (the plan rows' pairs, loaded together before any is used)
#pragma unroll
  for (int j = 0; j < kChunks; ++j) pair[j] = p.row_pair != nullptr ? p.row_pair[row0 + threadIdx.x / 16 + 16 * j] : 0;
  const std::uint16_t* src[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const std::int64_t row = p.row_pair != nullptr ? pair[j] / p.top_k : row0 + threadIdx.x / 16 + 16 * j;
    src[j] = pair[j] >= 0 ? p.src + row * p.row_stride : nullptr;
  }
  uint4 v[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j)
    v[j] = src[j] != nullptr ? __ldcg(reinterpret_cast<const uint4*>(src[j] + c0) + chunk) : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) *reinterpret_cast<uint4*>(&rows[threadIdx.x / 16 + 16 * j][chunk * 8]) = v[j];
  __syncthreads();
#if defined(MOK_DIAG_QCOLS_PAIRS)
  // (diagnostic build, bench/NOTES.md: the same bytes) Thread (cp, q) takes columns 2 cp, 2 cp + 1
  // and rows [32 q, 32 q + 32), read as bf16 pairs: one 4-byte load for two columns (a warp's 32
  // loads are one whole row: no bank conflicts), half the loads of the column scans above; then the
  // transpose staged and stored as whole 128-byte column segments.
  const int cp = threadIdx.x % (kFp8Block / 2), rq = 32 * (threadIdx.x / (kFp8Block / 2));
  __shared__ float quarter_max[4][kFp8Block];
  auto pair_at = [&](int r) { return *reinterpret_cast<const std::uint32_t*>(&rows[r][2 * cp]); };
  float m0 = 0.0f, m1 = 0.0f;
  for (int r = rq; r < rq + 32; ++r) {
    const std::uint32_t two = pair_at(r);
    m0 = fmaxf(m0, fabsf(bf16_bits_value(two & 0xffff)));
    m1 = fmaxf(m1, fabsf(bf16_bits_value(two >> 16)));
  }
  quarter_max[rq / 32][2 * cp] = m0;
  quarter_max[rq / 32][2 * cp + 1] = m1;
  __syncthreads();
  m0 = fmaxf(fmaxf(quarter_max[0][2 * cp], quarter_max[1][2 * cp]), fmaxf(quarter_max[2][2 * cp], quarter_max[3][2 * cp]));
  m1 = fmaxf(fmaxf(quarter_max[0][2 * cp + 1], quarter_max[1][2 * cp + 1]),
             fmaxf(quarter_max[2][2 * cp + 1], quarter_max[3][2 * cp + 1]));
  if (p.block_exponents != nullptr) {  // the block's: a max over every column (warps 0 and 1 hold them all)
    float m = fmaxf(m0, m1);
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    m0 = m1 = m;
  }
  const int e0 = fp8_scale_exponent(m0), e1 = fp8_scale_exponent(m1);
  const InverseScale inverse0(e0), inverse1(e1);
  uint4 out0[2], out1[2];  // (columns 2 cp and 2 cp + 1, rows rq + 16 j ...)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    std::uint32_t w0[4], w1[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const std::uint32_t two = pair_at(rq + 16 * j + 4 * k + i);
        a[i] = inverse0(bf16_bits_value(two & 0xffff));
        b[i] = inverse1(bf16_bits_value(two >> 16));
      }
      w0[k] = pack_e4m3x4(a[0], a[1], a[2], a[3]);
      w1[k] = pack_e4m3x4(b[0], b[1], b[2], b[3]);
    }
    out0[j] = make_uint4(w0[0], w0[1], w0[2], w0[3]);
    out1[j] = make_uint4(w1[0], w1[1], w1[2], w1[3]);
  }
  static_assert(kFp8Block * kStagedStride <= sizeof(rows), "the staged tile fits in the rows' room");
  std::uint8_t* staged = reinterpret_cast<std::uint8_t*>(&rows[0][0]);
  __syncthreads();  // (every thread's reads of the rows are done)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    *reinterpret_cast<uint4*>(staged + (2 * cp) * kStagedStride + rq + 16 * j) = out0[j];
    *reinterpret_cast<uint4*>(staged + (2 * cp + 1) * kStagedStride + rq + 16 * j) = out1[j];
  }
  __syncthreads();
  store_staged(staged, p.values + static_cast<std::int64_t>(c0) * p.capacity + row0, p.capacity);
  if (p.col_scales != nullptr && rq == 0) {
    p.col_scales[static_cast<std::int64_t>(tile) * p.columns + c0 + 2 * cp] = exp2_int(e0);
    p.col_scales[static_cast<std::int64_t>(tile) * p.columns + c0 + 2 * cp + 1] = exp2_int(e1);
  }
  if (p.block_exponents != nullptr && threadIdx.x == 0)
    p.block_exponents[static_cast<std::int64_t>(blockIdx.x) * p.exponent_stride + tile] = e0;
#else
  const int c = threadIdx.x % kFp8Block, half = threadIdx.x / kFp8Block, r0 = 64 * half;
  float amax = 0.0f;
  for (int r = r0; r < r0 + 64; ++r) amax = fmaxf(amax, fabsf(bf16_bits_value(rows[r][c])));
  half_max[half][c] = amax;
  __syncthreads();
  amax = fmaxf(half_max[0][c], half_max[1][c]);
  if (p.block_exponents != nullptr) {  // the block's: a max over the columns too
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
    __syncthreads();
    for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  }
  const int e = fp8_scale_exponent(amax);
  const InverseScale inverse(e);
  auto scaled = [&](int r) { return inverse(bf16_bits_value(rows[r][c])); };
  auto packed = [&](int j) {  // (rows r0 + 16 j ... + 15 of column c: 16 E4M3 bytes)
    std::uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = r0 + 16 * j + 4 * q;
      w[q] = pack_e4m3x4(scaled(r), scaled(r + 1), scaled(r + 2), scaled(r + 3));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  };
#if defined(MOK_DIAG_QCOLS_STAGED)
  std::uint8_t* column = p.values + static_cast<std::int64_t>(c0) * p.capacity + row0;  // (column c0's rows of the tile)
  // (diagnostic build, bench/NOTES.md: the same bytes, stored through shared memory) The thread's
  // 64 bytes in registers, then, once every thread has read the bf16 rows, staged as the tile's
  // transpose in their room (column c's 128 bytes at kStagedStride c: a quarter warp's 16-byte
  // stores fall in distinct banks), and stored 16 bytes a thread, 8 threads a column: a warp
  // writes 4 whole 128-byte column segments, where each thread otherwise stores 16 bytes a
  // capacity apart from its neighbours'.
  uint4 mine[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) mine[j] = packed(j);
  static_assert(kFp8Block * kStagedStride <= sizeof(rows), "the staged tile fits in the rows' room");
  std::uint8_t* staged = reinterpret_cast<std::uint8_t*>(&rows[0][0]);
  __syncthreads();  // (every thread's reads of the rows are done)
#pragma unroll
  for (int j = 0; j < 4; ++j) *reinterpret_cast<uint4*>(staged + c * kStagedStride + r0 + 16 * j) = mine[j];
  __syncthreads();
  store_staged(staged, column, p.capacity);
#else
  uint4* out = reinterpret_cast<uint4*>(p.values + static_cast<std::int64_t>(c0 + c) * p.capacity + row0 + r0);
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = packed(j);
#endif
  if (p.col_scales != nullptr && half == 0) p.col_scales[static_cast<std::int64_t>(tile) * p.columns + c0 + c] = exp2_int(e);
  if (p.block_exponents != nullptr && threadIdx.x == 0)
    p.block_exponents[static_cast<std::int64_t>(blockIdx.x) * p.exponent_stride + tile] = e;
#endif
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
  if (p.pair_row)
    quantize_scatter_kernel<<<num_ctas, kThreads, 0, stream>>>(p);
  else
    quantize_rows_kernel<<<num_ctas, kThreads, 0, stream>>>(p);
}

void launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream) {
  if (p.experts == 0 || p.rows == 0 || p.cols == 0) return;
  const dim3 grid((p.cols + kFp8Block - 1) / kFp8Block, (p.rows + kFp8Block - 1) / kFp8Block, p.experts);
  quantize_blocks_kernel<<<grid, kThreads, 0, stream>>>(p);
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
  load_kernel(quantize_columns_kernel);
  load_kernel(tile_order_kernel);
  load_kernel(quantize_blocks_kernel);
}

void launch_quantize_columns(const QuantizeColumnsParams& p, cudaStream_t stream) {
  if (p.capacity == 0 || p.columns == 0) return;
  const dim3 grid(p.columns / kFp8Block, static_cast<unsigned>(p.capacity / kFp8Block));
  quantize_columns_kernel<<<grid, kThreads, 0, stream>>>(p);
}

}  // namespace mok::kernels
