// Where the routed x rows (bf16 or E4M3) sit under the forward's fp32 slot rows on one GPU
// (Workspace::rows_in_slots): plain arithmetic, shared by the kernel and a CPU test.
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

struct RowRange {
  long long first, end;  // [first, end); empty when first >= end
};

// The slot buffer holds `capacity` fp32 rows of H values; the x rows fill its last bytes:
// `per_slot` x rows to a slot row's bytes (2: bf16 rows from byte 2·capacity·H, the BF16
// forward; 4: E4M3 rows from byte 3·capacity·H, the FP8 forward). Slot row s (bytes
// [4Hs, 4H(s+1))) therefore shares bytes with x rows per_slot·s - (per_slot - 1)·capacity
// and the per_slot - 1 after it. Returns the x rows, clipped to the used rows [0, used), that
// the slot rows [row0, row0 + rows) overwrite: all of them lie at or below row0 + rows - 1,
// so a GEMM2 tile waits only for GEMM1 tiles at or below its own.
__host__ __device__ inline RowRange x_rows_under_slots(long long row0, long long rows, long long capacity,
                                                      long long used, int per_slot = 2) {
  const long long first = per_slot * row0 - (per_slot - 1) * capacity;
  const long long end = per_slot * (row0 + rows) - (per_slot - 1) * capacity;
  return {first < 0 ? 0 : first, end < used ? end : used};
}

}  // namespace mok::kernels
