// Where the routed x rows sit under the forward's fp32 slot rows on one GPU
// (Workspace::rows_in_slots): plain arithmetic, shared by the kernel and a CPU test.
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

struct RowRange {
  long long first, end;  // [first, end); empty when first >= end
};

// The slot buffer holds `capacity` fp32 rows of H values; the x rows (bf16, H values) start
// at its middle, byte 2·capacity·H. Slot row s (bytes [4Hs, 4H(s+1))) therefore shares bytes
// with x rows 2s - capacity and 2s - capacity + 1. Returns the x rows, clipped to the used
// rows [0, used), that the slot rows [row0, row0 + rows) overwrite: all of them lie at or
// below row0 + rows - 1, so a GEMM2 tile waits only for GEMM1 tiles at or below its own.
__host__ __device__ inline RowRange x_rows_under_slots(long long row0, long long rows, long long capacity,
                                                      long long used) {
  const long long first = 2 * row0 - capacity, end = 2 * (row0 + rows) - capacity;
  return {first < 0 ? 0 : first, end < used ? end : used};
}

}  // namespace mok::kernels
