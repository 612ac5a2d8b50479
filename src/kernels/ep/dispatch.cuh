// Dispatch: copies (pulls) the routed rows of x into the plan's row order, so that the
// GEMMs read contiguous 128-row tiles through TMA. Padding rows become zeros. Row r of
// the plan holds global pair p = (rank * T + t) * k + j: token t of rank p / (T * k),
// read through the peer table (one GPU: x[0] is the caller's x; there the scatter copies,
// which reads each token's row once, through the plan's pair -> row table).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/ep/ep.cuh"

namespace mok::kernels {

struct DispatchParams {
  const std::uint16_t* x[kMaxEpRanks];  // rank q's [T, H] bf16 bits
  std::uint16_t* x_routed;       // [capacity, H]; rows from `split` on: x_routed_hi
  std::uint16_t* x_routed_hi;    // [capacity - split, H] (one GPU's dy rows past the gradient block)
  std::int64_t split;            // kNoSplit (backward.cuh): x_routed holds every row
  const std::int32_t* row_pair;  // [capacity]
  const std::int32_t* pair_row;  // [T * k] (one GPU) or null: set, one source, the scatter copies
  const std::int32_t* expert_offset;  // [E_l + 1]: rows beyond expert_offset[E_l] are not copied
  const void* plan_status;       // PlanStatus*: nothing is copied from a bad plan
  std::int64_t capacity;
  std::int32_t pairs_per_rank;   // T * k
  int hidden, top_k, num_local_experts;
  // A column block (the backward in column blocks, BackwardParams::col_begin): columns
  // [column0, column0 + columns) of each row into routed rows `routed_stride` elements apart.
  // 0, 0, 0: the whole row, routed rows of H.
  int column0, columns, routed_stride;
};

void launch_dispatch(const DispatchParams& params, int num_ctas, cudaStream_t stream);

// Expert parallelism, rows pulled once per token (Config::pull_tokens_once): before the
// dispatch, rank `rank` copies each peer token that any of its k pairs routes to this
// rank's experts, once, from the peer's rows into recv (local), so that the dispatch then
// gathers every routed row from local memory; a token with several experts here crosses
// the fabric once instead of once per pair. Tokens routed elsewhere are not copied.
struct TokenPullParams {
  const std::uint16_t* x[kMaxEpRanks];  // rank q's [T, H] rows (peer table)
  std::uint16_t* recv;                  // [ep, T, H]: rank q's tokens at [q] (this rank's own: untouched)
  const std::int32_t* ids;              // [ep, T, k]: every rank's routing (the exchange's copy)
  std::int64_t tokens;                  // T
  int ep, rank, top_k, hidden, num_local_experts;
};

void launch_pull_tokens(const TokenPullParams& params, int num_ctas, cudaStream_t stream);

}  // namespace mok::kernels
