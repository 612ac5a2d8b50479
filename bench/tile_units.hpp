// fp8_tile_rate's tile order (bench/fp8_tile_rate.cu, for_each_tile): plain arithmetic, shared by
// the bench's kernels and a CPU test (tests/test_bench_tile_units.cpp).
#pragma once

#include <cuda_runtime_api.h>

namespace mok::bench {

struct TileMN {
  int m, n;
};

// The units of a tiles_m x tiles_n grid of tiles: each um x un tiles (1 x 1; 2 x 1 when a
// cluster's two CTAs share B, taking (2i, j) and (2i + 1, j); 1 x 2 when they share A, taking
// (m, 2j) and (m, 2j + 1)). tiles_m / um and tiles_n / un must be whole.
__host__ __device__ inline int unit_count(int tiles_m, int tiles_n, int um, int un) {
  return tiles_m / um * (tiles_n / un);
}

// The tile of unit u that the CTA of cluster rank `rank` (0 alone) computes. Units run in groups
// of group_m M-tiles (a multiple of um dividing tiles_m): M fastest inside a group, then N, then
// the next group — the layer's order inside an expert of group_m M-tiles. group_m = tiles_m is one
// group: M fastest over all of M.
__host__ __device__ inline TileMN unit_tile(int u, int rank, int tiles_n, int group_m, int um, int un) {
  const int rows = group_m / um, cols = tiles_n / un;  // a group's units
  const int g = u / (rows * cols), r = u - g * rows * cols;
  return {(g * rows + r % rows) * um + (um == 2 ? rank : 0), r / rows * un + (un == 2 ? rank : 0)};
}

}  // namespace mok::bench
