// The value-taking knobs of diagnostic builds (CMake's MOK_DIAG_DEFINES, e.g.
// "MOK_DIAG_BWD_NO_LOADS=2"): each defaults to the production kernel. bench/NOTES.md has what each
// was built to measure and what it measured (the eighth session removed the L2-hint and band
// knobs, measured and dropped); `scripts/gpu_check.sh --part dram` times them.
#pragma once

// Backward tasks of these kinds load no operands (mask of 1 << TaskKind: 1 dh, 2 dx, 4 dW_down,
// 8 dW_gate|up): their stages complete empty — bytes and timing only, wrong results.
#ifndef MOK_DIAG_BWD_NO_LOADS
#define MOK_DIAG_BWD_NO_LOADS 0
#endif

// The BF16 forward's GEMM tasks load operands only in their first K step (1: later stages get A
// alone, B stale; 2: nothing, A and B stale): timing only, wrong results — how much of the
// forward's time the L2 feed holds (the FP8 forward's MOK_DIAG_FP8_A_ONLY / NO_LOADS likewise).
#ifndef MOK_DIAG_FWD_FEED
#define MOK_DIAG_FWD_FEED 0
#endif

// The BF16 mainloop's warpgroup 1 issues each stage's four MMAs in descending K (1): the two
// warpgroups in step but reading different 16-K slices of B at a time — timing only (the sum's
// order changes the bits): do warpgroups in step share B's shared-memory reads?
#ifndef MOK_DIAG_WG1_K_REVERSED
#define MOK_DIAG_WG1_K_REVERSED 0
#endif

// The BF16 mainloop's warpgroup 1 issues each stage's MMAs only after warpgroup 0 has issued its
// own (1): the tensor cores take each warpgroup's four MMAs back to back rather than the two
// warpgroups' interleaved (bench/mma_rate: one warpgroup's n256 MMAs run ~8 % faster than two's).
// Same bits.
#ifndef MOK_DIAG_BF16_ORDERED
#define MOK_DIAG_BF16_ORDERED 0
#endif
