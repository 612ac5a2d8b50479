// Parameters and launcher of the fused backward kernel (src/kernels/backward/backward.cu).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/forward/forward.cuh"
#include "mok/kernel_status.hpp"

namespace mok::kernels {

// Tensor maps of one expert set (the routed experts, or the shared expert with rows =
// tokens). "_k": K-major A tiles (box 64 x 128); "_mn": MN-major boxes of 64 x 64.
struct ExpertSetMaps {
  // dy rows: [rows, H] as {H, rows, regions} (the ring and the shared expert: one), rows from
  // BackwardParams::dy_split on in region 1 (whose stride is the regions' distance less the
  // rows before the split: every row keeps its plan row as coordinate)
  CUtensorMap dy_k;     // [rows, H]: A of dh = dy . W_down           (rows: dy_routed, or dy)
  CUtensorMap down_mn;  // W_down [E, H, I] as {I, H, E}: B of dh
  CUtensorMap dgu_k;    // [rows, 2I]: A of dx_row = [dg du] . [W_gate; W_up]
  CUtensorMap gate_mn;  // W_gate [E, I, H] as {H, I, E}: B of dx_row (K < I)
  CUtensorMap up_mn;    //                                B of dx_row (K >= I)
  CUtensorMap dy_mn;    // [rows, H] as {H, rows}: A of dW_down = dy^T . (w h)
  CUtensorMap hw_mn;    // [rows, I] as {I, rows}: B of dW_down
  CUtensorMap dgu_mn;   // [rows, 2I] as {2I, rows}: A of [dW_gate; dW_up] = [dg du]^T . x
  CUtensorMap x_mn;     // [rows, H] as {H, rows}: B of it   (rows: x_routed, or x)
  CUtensorMap dx_rows;   // [rows, H] as {H, rows, 1}: TMA stores of the dx rows
  // bf16 weight gradients (TMA stores, box 64 x 64 x 1); unused when they are f32
  CUtensorMap d_gate, d_up;  // [E, I, H] as {H, I, E}
  CUtensorMap d_down;        // [E, H, I] as {I, H, E}
};

// BackwardParams::dy_split of dy rows in one region.
inline constexpr int kNoSplit = 0x7fffffff;

// Per-set buffers.
struct ExpertSetData {
  std::uint16_t* gu;        // [rows, 2I]: gate | up pre-activations saved by the forward, replaced in
                            // place by their gradients (d gate | d up), 0 on padding rows
  std::uint16_t* hw;        // [rows, I] written: w * h, 0 on padding rows
  std::uint16_t* dx_rows;   // [rows, H] bf16 written: this row's contribution to dx
  void* d_gate;             // [E, I, H] bf16 or f32
  void* d_up;
  void* d_down;             // [E, H, I]
  int inter;
};

// Ring token buffer of the EP backward (RingGeometry, for two kinds of rows): the comm CTAs
// pull the plan's dy and x rows into two rings; the tasks then run expert by expert (dh,
// dx, dW_down, dW_gate|up of one expert, then the next), and freed[m] counts the reads of
// minibatch m by every task that reads its rows (dh tiles, and the weight-gradient tiles of
// the experts it holds).
// A weight-gradient task reads all of its expert's rows: the planner checks that every
// minibatch an expert's rows touch fits in the ring together (PlanStatus::ring_too_small).
// maps.dy_k, dy_mn and x_mn then cover the rings. Without comm CTAs the rows were copied
// before the launch. The rows' sources (RingSources) are the same for every rank of a
// group: they are kernel parameters once, beside the ranks' params.
struct BackwardRing : RingGeometry {
  std::uint16_t* dy_buffer;  // [ring_rows, H]
  std::uint16_t* x_buffer;   // [ring_rows, H]
};

struct RingSources {
  const std::uint16_t* dy[kMaxEpRanks];  // rank q's dy rows [T, H]
  const std::uint16_t* x[kMaxEpRanks];   // rank q's x rows [T, H]
};

struct BackwardCounters {
  int* dgu_ready;  // [max_routed_tiles + shared_tiles]: dh warpgroup-tiles done per M-tile
                   // (dx_over_x: an expert's first M-tile also counts its dW_gate|up ones)
  int* dx_done;    // dx-row warpgroup-tiles done
  int* abort;      // set by the first CTA that gives up; every wait checks it
  int* wd_done = nullptr;  // rows_in_grads: routed dW_down warpgroup-tiles done (their rows read)
};

struct BackwardParams {
  ExpertSetMaps routed_maps, shared_maps;
  // Expert parallelism: dx rows and d_topk_weights partials are pushed to the owner of the
  // token (kernels/ep/ep.cuh), topk_weights is every rank's [ep, T, k] (global pair index).
  EpPeers ep;
  BackwardRing ring;
  ExpertSetData routed, shared;
  PlanTables plan;
  // data
  const float* topk_weights;  // [T, k] (EP: [ep, T, k])
  float* dw_partial;          // [capacity, ceil(I / 256)]: per N-tile partial of d_topk_weights
  std::uint16_t* dx;          // [T, H] bf16
  float* d_topk_weights;      // [T, k]
  bool grad_fp32;             // weight gradients: f32 accumulated into (else bf16 written)
  // One GPU: routed.dx_rows are the x rows (Workspace::rows_in_slots): a dx tile waits
  // until its expert's dW_gate|up tiles have read them (phase-major order only).
  bool dx_over_x;
  // One GPU, bf16 gradients: the routed dy rows live in d_gate's buffer and/or w h in
  // d_up's (both dead until the dW_gate|up tiles write them): a routed dW_gate|up tile
  // first waits for every routed dW_down tile (phase-major order only).
  bool rows_in_grads;
  // One GPU: the routed dy rows from this plan row on lie in the dy maps' second region (the
  // rest of the rows past the gradient block, in dx: written only by the combine, which waits
  // for every dx tile, each after its expert's dW_gate|up tiles, each after every dW_down
  // tile, the last readers of dy rows; so rows_in_grads). A multiple of 128; kNoSplit: none.
  int dy_split;
  BackwardCounters counters;
  KernelStatus* status;
  // The saved tensor's trailer: kSavedValid while it holds a forward's pre-activations
  // (the backward consumes them; the host clears the trailer after the kernel).
  const unsigned long long* saved_marker;
  int tokens, hidden, top_k, num_local_experts;
  int shared_tiles, max_routed_tiles;
  float swiglu_limit;
  // One GPU (no ring), the backward in column blocks (Config::backward_column_blocks), one launch
  // each: this launch's routed dW_gate|up, dx and combine work covers the block_tiles kBlockN-column
  // tiles of H from tile block_first_tile on (col_begin(), col_end()), and the routed x / dx rows
  // hold block_tiles x kBlockN columns from col_begin() on (rows_width(): not H, so the scratch's
  // largest buffer shrinks). Only the first block's launch runs the dh, dW_down and shared-expert
  // tasks and writes d_topk_weights; the counters carry on across the launches (each launch's
  // waits count the earlier blocks' tiles). block_tiles 0: one block, all of H. (16-bit fields
  // in the padding before timeout_ns: the EP group's params are at the kernel parameter limit.)
  std::uint16_t block_first_tile, block_tiles;
  long long timeout_ns;
};

// The column block of a backward launch (BackwardParams::block_tiles).
__host__ __device__ inline int col_begin(const BackwardParams& p) { return p.block_first_tile * kBlockN; }
__host__ __device__ inline int rows_width(const BackwardParams& p) {
  return p.block_tiles > 0 ? p.block_tiles * kBlockN : p.hidden;
}
__host__ __device__ inline int col_end(const BackwardParams& p) {
  const int end = (p.block_first_tile + p.block_tiles) * kBlockN;
  return p.block_tiles > 0 && end < p.hidden ? end : p.hidden;
}

void launch_backward(const BackwardParams& params, int num_ctas, cudaStream_t stream, const RingSources& sources = {});

// Precision::fp8 with its dgrad (one GPU or an EpRank; no ring): the routed dh and dx tiles in E4M3 with
// DeepSeek-V3's blockwise scaling (the FP8 forward's mainloop, kernels/fp8/mainloop_fp8.cuh);
// the weight gradients, the shared expert and the combine as the BF16 kernel.
struct Fp8DgradMaps {
  CUtensorMap dy;         // E4M3 [capacity, H]: A of dh (the routed dy rows, per 1 x 128); box 128 x 128
  CUtensorMap down_t;     // E4M3 [E_l, I, H]: B of dh (W_down^T); box 128 x 128 x 1
  CUtensorMap dgu;        // E4M3 [capacity, 2I]: A of dx (dgate | dup, per 1 x 128); box 128 x 128
  CUtensorMap gate_up_t;  // E4M3 [E_l, H, 2I]: B of dx (W_gate^T | W_up^T); box 128 x 128 x 1
};

struct Fp8BackwardParams {
  BackwardParams base;  // (no ring; base.ep set in an EpRank: pushes and peer waits as the BF16 kernel's)
  Fp8DgradMaps maps;
  std::int64_t capacity;               // plan rows: the stride of the row scales
  std::uint8_t* dgu_values;            // [capacity, 2I] E4M3, written by the dh tiles
  // The row scales (powers of two) as E8M0 bytes (as Fp8ForwardParams::x_exps), which the producer
  // loads with each stage: dy's from the row quantization, dgate|dup's written by the dh tiles.
  const std::uint8_t* dy_exps;         // [H / 128, capacity]: row r's block b scale
  std::uint8_t* dgu_exps;              // [2I / 128, capacity]
  const std::int32_t* down_t_exponents;     // [E_l, I / 128, H / 128]: block (i, j) scale 2^e
  const std::int32_t* gate_up_t_exponents;  // [E_l, H / 128, 2I / 128]
  // false (BackwardArgs::fp8_weight_gradients): no routed weight-gradient tile here (launch_wgrad_fp8
  // runs them after; a kernel instance of its own); dx_over_x is then off (no task reads the x rows).
  bool routed_weights = true;
};

void launch_backward_fp8(const Fp8BackwardParams& params, int num_ctas, cudaStream_t stream);

// Precision::fp8 with its weight gradients in E4M3 too (BackwardArgs::fp8_weight_gradients; one
// GPU): a launch after the FP8 dgrad kernel (which then runs no routed weight-gradient tile,
// Fp8BackwardParams::routed_weights) and the transposing quantizations of its w h and dgate|dup
// (kernels/fp8/quantize.cuh, launch_quantize_columns): the routed dW_down = dy^T (w h) and
// [dW_gate; dW_up] = [dg du]^T x tiles, each K block of 128 plan rows the FP8 mainloop's
// (kernels/fp8/mainloop_fp8.cuh) — A, the gradient, scaled per channel and 128 rows; B, the
// activation, per 128 channels x 128 rows — stored as the BF16 kernel stores them.
struct Fp8WgradMaps {
  CUtensorMap dy_t;   // E4M3 [H, capacity]: A of dW_down (dy's routed rows transposed); box 128 x 128
  CUtensorMap hw_t;   // E4M3 [I, capacity]: B of dW_down (w h transposed)
  CUtensorMap dgu_t;  // E4M3 [2I, capacity]: A of dW_gate|up (dgate | dup transposed)
  CUtensorMap x_t;    // E4M3 [H, capacity]: B of dW_gate|up (x's routed rows transposed)
};

// Elements between two channel blocks' rows of the activation operands' exponents: a row per
// 128-row block of the plan and one more (an expert without rows reads one at its end).
__host__ __device__ inline std::int64_t wgrad_exponent_stride(std::int64_t capacity) { return capacity / kFp8BlockK + 1; }

struct Fp8WgradParams {
  BackwardParams base;  // the call's (no ring): its routed gradients, plan, status and waits (in an
                        // EpRank base.ep too: the kernel's waits read its peers' plan flags)
  Fp8WgradMaps maps;
  std::int64_t capacity;               // plan rows, a multiple of 128
  // A's scales (powers of two) as E8M0 bytes (QuantizeColumnsParams::col_exps), which the producer
  // loads with each stage (mainloop_fp8, as the FP8 forward and dgrad do).
  const std::uint8_t* dy_t_exps;       // [capacity / 128, H]: channel h of row block b
  const std::uint8_t* dgu_t_exps;      // [capacity / 128, 2I]
  const std::int32_t* hw_t_exponents;  // [I / 128, wgrad_exponent_stride]: block (i, b): 2^e
  const std::int32_t* x_t_exponents;   // [H / 128, wgrad_exponent_stride]
};

void launch_wgrad_fp8(const Fp8WgradParams& params, int num_ctas, cudaStream_t stream);

// Virtual ranks: one launch serving every rank (see ForwardGroupParams).
struct BackwardGroupParams {
  BackwardParams rank[kMaxEpRanks];
  RingSources sources;
  int ranks, ctas_per_rank;
};
static_assert(sizeof(BackwardGroupParams) <= 32764, "kernel parameters are limited to 32764 bytes");
void launch_backward_group(const BackwardGroupParams& params, cudaStream_t stream);

}  // namespace mok::kernels
