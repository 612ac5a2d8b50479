// One warp's copy of a row through registers: the dispatch kernel's (kernels/ep/dispatch.cu) and
// the E4M3 row gather's (kernels/fp8/quantize.cu).
#pragma once

#include <cstdint>

namespace mok::kernels {

// One warp copies `vectors` 16-byte vectors from src to dst, four per lane in flight.
__device__ __forceinline__ void warp_copy_row(uint4* dst, const uint4* src, int vectors, int lane) {
  constexpr int kInFlight = 4;
  for (int v0 = lane; v0 < vectors; v0 += 32 * kInFlight) {
    uint4 chunk[kInFlight] = {};
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      if (v0 + 32 * i < vectors) chunk[i] = __ldg(src + v0 + 32 * i);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      if (v0 + 32 * i < vectors) dst[v0 + 32 * i] = chunk[i];
  }
}

}  // namespace mok::kernels
