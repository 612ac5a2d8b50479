// The order in which the FP8 weight gradients' transposing gathers of dy and x visit the plan's
// tiles (kernels/fp8/quantize.cuh, QuantizeColumnsParams::tile_order): tile rank r of every
// expert (its rows [128 r, 128 r + 128)) before rank r + 1 of any. An expert's rows are in token
// order, so the tiles of one rank hold tokens from about the same window of the batch: CTAs in
// flight together read each token's row for its k experts while it is still in L2, instead of once
// per expert from DRAM (deepseek-v3: dy and x are 117 MB each, their k = 8 routed copies 0.94 GB).
// Plain arithmetic, shared by the kernel and a CPU test.
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

// Position of tile rank r of expert e in that order, given each expert's tile count tiles(e'):
// the tiles of lower rank, sum over e' of min(tiles(e'), r), then the experts before e that have
// a tile of rank r. A bijection from {(e, r): r < tiles(e)} onto [0, total tiles).
template <typename Tiles>
__host__ __device__ inline int rank_order_position(int experts, int e, int r, Tiles tiles) {
  int position = 0;
  for (int other = 0; other < experts; ++other) {
    const int n = tiles(other);
    position += (n < r ? n : r) + (other < e && n > r ? 1 : 0);
  }
  return position;
}

}  // namespace mok::kernels
