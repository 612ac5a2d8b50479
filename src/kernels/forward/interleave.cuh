// The forward's interleaved task order (Config::interleave_rows): plain arithmetic, shared
// by the kernel's schedule (kernels/forward/tasks.cuh) and a CPU test.
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

// Interleaved order (ForwardParams::interleave_tiles = C > 0): the routed tasks [0,
// m_routed (n1 + n2)) in blocks G1(0), G1(1) G2(0), G1(2) G2(1), ..., G1(last) G2(last - 1),
// G2(last), where G1(c) / G2(c) are chunk c's GEMM1 / GEMM2 tiles (M-tiles [c C, c C + C),
// N-tile-major). A GEMM2 tile waits for GEMM1 tiles of its own chunk (or, one GPU, of the x
// rows under its slots: M-tiles at or below its own), which come earlier: lower-numbered
// tasks only (tests/test_plan.cpp checks it on the host).
struct InterleavedTask {
  bool gemm2;
  int m, n;
};

__host__ __device__ inline InterleavedTask interleaved_task(int m_routed, int n1, int n2, int C, int local) {
  const int chunks = (m_routed + C - 1) / C;
  const int last = m_routed - (chunks - 1) * C;  // M-tiles of the last chunk (the others: C)
  auto take = [&](bool gemm2, int c, int tiles, int l) { return InterleavedTask{gemm2, c * C + l % tiles, l / tiles}; };
  const int first = chunks == 1 ? last : C;
  if (local < first * n1) return take(false, 0, first, local);
  local -= first * n1;
  const int pair = C * (n1 + n2), full = chunks > 2 ? chunks - 2 : 0;  // blocks G1(c) G2(c - 1), c = 1 .. full
  if (local < full * pair) {
    const int c = 1 + local / pair;
    local %= pair;
    if (local < C * n1) return take(false, c, C, local);
    return take(true, c - 1, C, local - C * n1);
  }
  local -= full * pair;
  if (chunks >= 2) {  // G1(last chunk) G2(the one before)
    if (local < last * n1) return take(false, chunks - 1, last, local);
    local -= last * n1;
    if (local < C * n2) return take(true, chunks - 2, C, local);
    local -= C * n2;
  }
  return take(true, chunks - 1, last, local);
}

}  // namespace mok::kernels
