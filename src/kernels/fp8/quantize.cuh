// Blockwise FP8 quantization of bf16 weights on the GPU: E4M3 values and one power-of-two
// scale per 128 x 128 block of each expert's [rows, cols] matrix (DeepSeek-V3's weight
// recipe; mok/fp8.hpp's host quantize() with block 128 x 128 gives the same bytes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mok/kernel_status.hpp"  // kMaxEpRanks

namespace mok::kernels {

inline constexpr int kFp8Block = 128;  // rows and columns of a weight block

struct QuantizeParams {
  const std::uint16_t* w;   // bf16 [experts, rows, cols], contiguous rows
  std::int64_t expert_stride, row_stride;  // elements
  std::uint8_t* values;     // E4M3 [experts, rows, cols], contiguous rows
  std::int32_t* exponents;  // [experts, ceil(rows / 128), ceil(cols / 128)]: the block's scale is 2^e
  // Strides (elements) of values' and exponents' experts and rows (contiguous: rows * cols and
  // cols, and the blocks'; a view of a larger tensor, e.g. one half of [W_gate^T | W_up^T]: its own)
  std::int64_t values_expert_stride, values_row_stride, exponents_expert_stride, exponents_row_stride;
  int experts, rows, cols;
  // W^T instead: values [experts, cols, rows], exponents [experts, ceil(cols / 128), ceil(rows /
  // 128)] (the strides are theirs) (the same blocks, so the transposed values of the untransposed quantization): the
  // K-major operand of a GEMM that multiplies by W^T (E4M3 wgmma reads K-major only).
  bool transpose = false;
  // Optional (transpose false only; null: none): W^T as well, from the same read — values_t
  // [experts, cols, rows] and exponents_t [experts, ceil(cols / 128), ceil(rows / 128)] at their own
  // strides (elements), beside the untransposed values and exponents.
  std::uint8_t* values_t = nullptr;
  std::int32_t* exponents_t = nullptr;
  std::int64_t values_t_expert_stride = 0, values_t_row_stride = 0, exponents_t_expert_stride = 0,
               exponents_t_row_stride = 0;
};

// One CTA a block: its largest magnitude (a max: any order gives the same value), then
// every element divided by the block's scale (exact: a power of two) and rounded to E4M3
// (nearest, ties to even, saturating): a whole block's 16-byte pieces read once into registers,
// 8-byte rows of W and 16-byte rows of W^T written (through a swizzled shared-memory tile) where
// the block is whole and quantize_blocks_vector_ok holds; else the block read twice, an element a
// thread at a time, and written a byte at a time (the same bytes). The wide path took 0.37x the
// element-wise kernel's time for deepseek-v3's six weight quantizations (8.05 -> 2.97 ms, H100,
// bench/NOTES.md, twenty-fourth session).
void launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream);
// Whether p's pointers and strides allow the block kernel's wide loads and stores (w 16-byte, values
// 8-byte, values_t 16-byte aligned rows and experts).
bool quantize_blocks_vector_ok(const QuantizeParams& p);

// The FP8 forward's gather: the plan's routed rows of x (bf16 [T, H], H a multiple of 128)
// into values (E4M3 [capacity, H], plan order) with one power-of-two scale 2^e per 1 x 128 block
// of a row, stored as its E8M0 byte e + 127 in exps[block * capacity + row] (a block's scales of
// consecutive rows are contiguous: the FP8 kernels' producers load a tile's 128 of them with each
// stage). The bytes equal the host's fp8::quantize(row, 1, H, 1, 128): a function of the token's
// row alone, so the same wherever (on whichever EP rank) it is quantized. Padding rows: zeros,
// scale 1 (byte 127).
struct QuantizeRowsParams {
  // [T, H] bf16 bits of each rank's tokens (expert parallelism: pair p is rank
  // p / pairs_per_rank's; one GPU: x[0] alone)
  const std::uint16_t* x[kMaxEpRanks];
  std::int64_t pairs_per_rank;   // T * k
  std::uint8_t* values;          // [capacity, H] E4M3
  std::uint8_t* exps;            // [H / 128, capacity] E8M0 (kernels/fp8/fp8_math.cuh's e8m0_byte)
  const std::int32_t* row_pair;  // [capacity]: t * k + j, or -1 (padding)
  const std::int32_t* expert_offset;  // [E_l + 1]
  const void* plan_status;       // PlanStatus*: nothing is written from a bad plan
  std::int64_t capacity;
  int hidden, top_k, num_local_experts;
  // One GPU: the plan's pair -> row table and T * k; set, the rows are scattered from each token
  // (x read once); null, gathered per row (the same bytes).
  const std::int32_t* pair_row = nullptr;
  std::int64_t pairs = 0;
  // Optional (the FP8 dgrad's dy rows, which the bf16 weight gradients read too): the same rows
  // in bf16 as well, in one read of x — plan rows before `split` into rows_bf16, the rest into
  // rows_bf16_hi from its start (as DispatchParams' x_routed, x_routed_hi and split; kNoSplit:
  // all in rows_bf16). Read only with rows_bf16.
  std::uint16_t* rows_bf16 = nullptr;
  std::uint16_t* rows_bf16_hi = nullptr;
  std::int64_t split = 0;
};

void launch_quantize_rows(const QuantizeRowsParams& p, int num_ctas, cudaStream_t stream);

// A rank's tokens quantized for peers that pull E4M3 rows (Config::pull_fp8_rows): the token-major
// layout [tokens, H] E4M3, then [tokens, H / 128] E8M0 scale bytes (a row's bytes contiguous).
__host__ __device__ inline std::int64_t fp8_token_bytes(std::int64_t tokens, std::int64_t hidden) {
  return tokens * hidden + tokens * (hidden / 128);
}

// A rank's own tokens (src [tokens, hidden] bf16) quantized per 1 x 128 into `out`, the
// token-major layout above (kernels/fp8/quantize_rows.cuh, quantize_token_rows): the rows its peers pull
// as E4M3 (Config::pull_fp8_rows; virtual ranks: EpRank's exchange kernel does this itself).
void launch_quantize_tokens(const std::uint16_t* src, std::uint8_t* out, std::int64_t tokens, int hidden, int num_ctas,
                            cudaStream_t stream);

// The plan's routed rows gathered as E4M3 rows already quantized by their owners (sources[q]:
// rank q's tokens in fp8_token_bytes' layout) into values (E4M3 [capacity, H]) and their scales'
// E8M0 bytes ([H / 128, capacity]; QuantizeRowsParams' layouts): the bytes launch_quantize_rows
// makes from the bf16 rows. Padding rows: zeros, scale 1; nothing is written from a bad plan.
struct GatherFp8RowsParams {
  const std::uint8_t* sources[kMaxEpRanks];
  std::int64_t pairs_per_rank;   // T * k
  std::int64_t tokens;           // T of every rank (where the sources' scale bytes start)
  std::uint8_t* values;
  std::uint8_t* exps;            // (QuantizeRowsParams::exps)
  const std::int32_t* row_pair;  // [capacity]: global pair, or -1
  const std::int32_t* expert_offset;
  const void* plan_status;
  std::int64_t capacity;
  int hidden, top_k, num_local_experts;
};

void launch_gather_fp8_rows(const GatherFp8RowsParams& p, int num_ctas, cudaStream_t stream);

// The FP8 weight gradients' operands (BackwardArgs::fp8_weight_gradients): `columns` columns of
// the plan's routed rows, E4M3, stored as rows of their transpose — values[c * capacity + row],
// so K-major for the weight-gradient GEMMs, whose K is the rows — in tiles of 128 plan rows and
// 128 columns (a CTA up to four column tiles of one plan tile). Scales (powers of two) either per column and tile (col_exps[tile * columns
// + c] = e + 127, E8M0, which the FP8 weight-gradient kernel's producer loads with its stages: the
// gradient operands, dy and dgate|dup) or per 128 x 128 block (block_exponents
// [(c / 128) * exponent_stride + tile] = e: the activation operands, x and w h); the largest
// magnitude is a max, the same in any order. The rows: src's plan rows ([capacity, columns] at
// row_stride), or gathered from src [T, columns] by row_pair (padding rows: zeros). Tiles past
// the plan's last are not written; nothing is written from a bad plan. The bytes equal the host's
// fp8::quantize of the rows' transpose with blocks 1 x 128 or 128 x 128.
struct QuantizeColumnsParams {
  const std::uint16_t* src;      // bf16 bits
  std::int64_t row_stride;       // elements
  const std::int32_t* row_pair;  // [capacity]: t * k + j, or -1; null: src holds the plan rows
  int top_k;
  std::uint8_t* values;          // [columns, capacity] E4M3
  std::uint8_t* col_exps;        // [capacity / 128, columns] E8M0 (fp8_math.cuh's e8m0_byte), or null
  std::int32_t* block_exponents; // [columns / 128, exponent_stride], or null
  std::int64_t exponent_stride;  // >= capacity / 128
  const std::int32_t* num_tiles;  // the plan's
  // Optional (gathers): the plan tile at grid position i (launch_tile_order's; null: tile i).
  const std::int32_t* tile_order;
  const void* plan_status;       // PlanStatus*
  std::int64_t capacity;         // a multiple of 128
  int columns;                   // a multiple of 128
};

void launch_quantize_columns(const QuantizeColumnsParams& p, cudaStream_t stream);

// order[p] = the plan tile at position p of the rank order (kernels/fp8/tile_order.cuh), for
// every tile of the plan (one thread a tile; tile t holds rows [tile_row[t], + 128) of expert
// tile_expert[t]). Nothing is written from a bad plan.
void launch_tile_order(const std::int32_t* expert_offset, const std::int32_t* tile_expert, const std::int32_t* tile_row,
                       const std::int32_t* num_tiles, const void* plan_status, int experts, std::int64_t max_tiles,
                       std::int32_t* order, cudaStream_t stream);

}  // namespace mok::kernels
