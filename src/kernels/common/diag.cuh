// The value-taking knobs of diagnostic builds (CMake's MOK_DIAG_DEFINES, e.g.
// "MOK_DIAG_DX_BAND=4"): each defaults to the production kernel. bench/NOTES.md has what each
// was built to measure and what it measured; `scripts/gpu_check.sh --part dram` times them.
#pragma once

// Backward tasks of these kinds load no operands (mask of 1 << TaskKind: 1 dh, 2 dx, 4 dW_down,
// 8 dW_gate|up): their stages complete empty — bytes and timing only, wrong results.
#ifndef MOK_DIAG_BWD_NO_LOADS
#define MOK_DIAG_BWD_NO_LOADS 0
#endif

// The L2 policy (ptx::L2Hint: 0 none, 1 evict_last, 2 evict_first) of the long-K phases'
// operand loads: the backward's dx tiles (A: dgate|dup rows, B: W_gate|up) and the forward's
// GEMM2 tiles (A: h rows, B: W_down). Same bits.
#ifndef MOK_DIAG_DX_A_HINT
#define MOK_DIAG_DX_A_HINT 0
#endif
#ifndef MOK_DIAG_DX_B_HINT
#define MOK_DIAG_DX_B_HINT 0
#endif
#ifndef MOK_DIAG_GEMM2_A_HINT
#define MOK_DIAG_GEMM2_A_HINT 0
#endif
#ifndef MOK_DIAG_GEMM2_B_HINT
#define MOK_DIAG_GEMM2_B_HINT 0
#endif

// Routed M-tile tasks in bands of this many M-tiles (split_in_bands; 0: the plain N-tile-major
// order): the backward's dx and dh tiles, the forward's GEMM1 and GEMM2 tiles. Same bits.
#ifndef MOK_DIAG_DX_BAND
#define MOK_DIAG_DX_BAND 0
#endif
#ifndef MOK_DIAG_DH_BAND
#define MOK_DIAG_DH_BAND 0
#endif
#ifndef MOK_DIAG_GEMM1_BAND
#define MOK_DIAG_GEMM1_BAND 0
#endif
#ifndef MOK_DIAG_GEMM2_BAND
#define MOK_DIAG_GEMM2_BAND 0
#endif
