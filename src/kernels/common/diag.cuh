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

// Tokens of one forward combine task (0: kCombineTokens, 32). Larger tasks put the combine
// tail on fewer CTAs (ceil(T / K) of them), with the same bits. That shows how the combine's time
// scales with the CTAs that run it: could a few CTAs keep its bandwidth while the rest run GEMM2
// (a combine overlapped with GEMM2 in column bands, bench/NOTES.md, forty-sixth session)?
#ifndef MOK_DIAG_FWD_COMBINE_TOKENS
#define MOK_DIAG_FWD_COMBINE_TOKENS 0
#endif

// The one-GPU cooperative forwards' combine through kernels/common/combine_staged.cuh (1): each thread
// cp.async-copies its own columns of the next tokens' rows into the free pipeline stages, up to ~160 KB in
// flight a CTA, instead of combine_tokens' ~32 KB of register loads (0). The same bits. With
// MOK_DIAG_FWD_COMBINE_TOKENS=256 it answers whether a few CTAs can then pull the combine's bytes
// (bench/NOTES.md, forty-seventh session; bench/combine_rate.cu measures the loop alone).
#ifndef MOK_DIAG_FWD_STAGED_COMBINE
#define MOK_DIAG_FWD_STAGED_COMBINE 0
#endif
