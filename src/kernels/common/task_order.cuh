// Task orders inside one expert's grid of output tiles: plain arithmetic, shared by the
// forward's and the backward's schedules (kernels/{forward,backward}/tasks.cuh) and a CPU test
// (tests/test_plan.cpp).
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

// Task l of a grid of `tiles` M-tiles by `n_tiles` N-tiles taken in bands of `band` >= 1
// M-tiles (the last band holds what is left), N-tile-major inside each band: M-tile m (from 0)
// and N-tile n. Band 1 runs N fastest; band >= tiles gives the plain N-tile-major order (m = l
// mod tiles). Neighbours in the order run on CTAs of consecutive index: the tasks that share an
// N-tile's operand sit next to each other, those that share an M-tile's `band` apart, which
// decides how much of each operand the L2 serves twice (bench/NOTES.md, the dx tiles' order).
__host__ __device__ inline void split_in_bands(int l, int tiles, int n_tiles, int band, int& m, int& n) {
  const int full = tiles / band * band;  // M-tiles in whole bands
  const bool whole = l < full * n_tiles;
  const int b = whole ? band : tiles - full, m0 = whole ? l / (band * n_tiles) * band : full;
  l -= m0 * n_tiles;
  m = m0 + l % b, n = l / b;
}

}  // namespace mok::kernels
