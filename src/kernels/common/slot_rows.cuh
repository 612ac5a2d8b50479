// Where the routed x rows (bf16 or E4M3) sit under the forward's bf16 slot rows on one GPU
// (Workspace::rows_in_slots): plain arithmetic, shared by the kernel and a CPU test.
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

struct RowRange {
  long long first, end;  // [first, end); empty when first >= end
};

// The slot buffer holds `capacity` bf16 rows of H values (2H bytes each); the x rows fill its
// last bytes: `per_slot` x rows to a slot row's bytes (1: bf16 rows, each under its own slot row,
// the BF16 forward; 2: E4M3 rows from byte capacity·H, the FP8 forward). Slot row s (bytes
// [2Hs, 2H(s+1))) therefore shares bytes with x rows per_slot·s - (per_slot - 1)·capacity
// and the per_slot - 1 after it. Returns the x rows, clipped to the used rows [0, used), that
// the slot rows [row0, row0 + rows) overwrite: all of them lie at or below row0 + rows - 1,
// so a GEMM2 tile waits only for GEMM1 tiles at or below its own (per_slot 1: its own M-tile's,
// which its wait for the M-tile's h rows already covers).
__host__ __device__ inline RowRange x_rows_under_slots(long long row0, long long rows, long long capacity,
                                                      long long used, int per_slot = 1) {
  const long long first = per_slot * row0 - (per_slot - 1) * capacity;
  const long long end = per_slot * (row0 + rows) - (per_slot - 1) * capacity;
  return {first < 0 ? 0 : first, end < used ? end : used};
}

}  // namespace mok::kernels
