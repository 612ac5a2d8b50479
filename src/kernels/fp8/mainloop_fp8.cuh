// The FP8 mainloop of the persistent kernels (DeepSeek-V3's blockwise recipe, mok/fp8.hpp): a
// stage holds 128 of K in E4M3 — A = 128 rows x 128 K, B = 256 rows x 128 K as two halves of
// 128 rows — which is one scale block of every operand. Used by the FP8 forward's routed GEMMs
// and the FP8 backward's dgrad and weight-gradient GEMMs.
#pragma once

#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels {

inline constexpr std::uint32_t kFp8TileBytes = kBoxFp8.bytes(1);  // 16 KB: A, or one half of B, of a stage
static_assert(kBoxFp8.cols == kFp8BlockK && kBoxFp8.rows == 128);

// The scales of one FP8 task from global memory: B's per 128 x 128 block (exponents, one a K block:
// b[0] for B's rows 0-127, b[1] for rows 128-255). A's per row and 128 K come with the stages.
struct Fp8TaskScales {
  const std::int32_t* b[2];
};

// A stage's A row scales: kFp8RowExponentBytes E8M0 bytes (one a row of the stage's 128 K; fp8_math.cuh's
// e8m0_scale decodes them), which the FP8 forward's, dgrad's and weight gradients' producers bulk-load
// into s.a_exps with the operands.
inline constexpr std::uint32_t kFp8RowExponentBytes = kBoxFp8.rows;

// One FP8 GEMM over k_steps stages: acc (the BF16 mainloop's layout: B's rows 0-127 in
// acc[0, 64), rows 128-255 in acc[64, 128)) = the sum over K blocks kb, in ascending order,
// of (A_kb B_kb^T) * a_scale(row, kb) * b_scale(half, kb). Each half's four MMAs sum into
// the block accumulator (the tensor cores' own precision inside one scale block), which is
// then promoted in fp32. The two warpgroups' batches run together and complete together, so
// the tensor cores idle while both promote (a promotion-free timing build ran the forward
// 14-16 % faster); issuing the batches in turn, or warpgroup 1's only after warpgroup 0's has
// completed, measured 2 % and 6-9 % slower (bench/NOTES.md). Without loads (bench/mma_rate.cu)
// this pattern caps two warpgroups at ~1440 TFLOP/s, and both ways of hiding the promotion run
// faster: two block accumulators (~1700) or the warpgroups half a block apart (~1870). Fed by TMA
// (bench/fp8_tile_rate.cu, one dense GEMM, 2026-12-04) neither does: this loop ~1060-1210 TFLOP/s,
// the half-block skew ~850-1025 (its loss a promotion waiting on its row-scale load, Nsight Compute
// says; without it about this loop's rate: removed, bench/NOTES.md), 128 x 128 tiles with two block
// accumulators ~920-1080 (with 6 or 7 stages, or A multicast in 2-CTA clusters, no better); A from
// registers (RS form) is within 0-5 % of this loop and needs 16 registers the kernels lack. So this
// loop stays, and the FP8 forward's mainloops run at about that dense rate in the layer.
// A's row scales come from the stage (s.a_exps: their E8M0 bytes, which its producer loaded with the
// operands), not from L2 loads one block ahead: the lone GEMM (bench/fp8_tile_rate's current-ss) 1.11x
// at the power cap; the layer's FP8 forward 1.03-1.05x (H100, b843338) and, with the weight gradients'
// bytes too, forward+backward 1.02-1.06x (H200, d3d5d69), sustained at the cap, where a form that sent
// a subnormal scale's read to L2 (a branch in this loop) gained 0.3-1.5 %; issuing the two warpgroups'
// batches in a fixed alternation, as cuBLAS's blockwise kernel does, added nothing to that and cost
// 16 % without it: bench/NOTES.md, thirty-third to thirty-sixth sessions.
template <int kStages, typename P, typename S>
__device__ __forceinline__ void mainloop_fp8(const P& p, S& s, Pipeline<kStages>& pipe, float (&acc)[128], int k_steps,
                                             int wg, int task, const Fp8TaskScales& sc) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // (Both zeroed, and apart from a BF16 branch's array: an accumulator that enters the loop
  // undefined, or one array for both branches, made ptxas serialize the MMAs or spill.)
  float block[64];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) block[i] = 0.0f;
  // The scales of block kb: B's loaded one block ahead (an L2 load's latency is longer than the
  // block's MMAs), A's read from its stage once it has landed.
#if defined(MOK_DIAG_FP8_NO_PROMOTION)
  // Timing only (wrong results): every K block's eight MMAs summed into `block` as the BF16
  // mainloop sums into acc — no wait between halves or blocks, no promotion, no scales — so
  // the run shows the rate at which this kernel's stages can feed the FP8 tensor cores.
  {
    int previous = -1;
    for (int kb = 0; kb < k_steps; ++kb) {
      const int stage_index = pipe.consumer_wait(p, s.barriers, task);
      const auto& stage = s.stages[stage_index];
      const std::uint32_t desc_a = ptx::wgmma_descriptor_sw128_lo(reinterpret_cast<const char*>(stage.a) + wg * 64 * kFp8BlockK);
      ptx::wgmma_fence();
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::uint32_t desc_b = ptx::wgmma_descriptor_sw128_lo(reinterpret_cast<const char*>(stage.b) + half * kFp8TileBytes);
#pragma unroll
        for (int kk = 0; kk < kFp8BlockK / 32; ++kk)
          ptx::wgmma_m64n128k32_e4m3(block, desc_a + KMajor::kDescStep * kk, desc_b + KMajor::kDescStep * kk, true);
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<1>();
      if (previous >= 0 && tid == 0) pipe.consumer_release(s.barriers, previous);
      previous = stage_index;
      pipe.consumer_advance();
    }
    ptx::wgmma_wait_group<0>();
    if (previous >= 0 && tid == 0) pipe.consumer_release(s.barriers, previous);
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = block[i], acc[64 + i] = block[i];
    return;
  }
#endif
  int e0 = __ldg(sc.b[0]), e1 = __ldg(sc.b[1]);  // (weights: constant during the kernel)
  for (int kb = 0; kb < k_steps; ++kb) {
    const int stage_index = pipe.consumer_wait(p, s.barriers, task);
    // (the stage has landed, its bytes with it: this thread's rows r and r + 8)
    const std::uint32_t at = ptx::smem_address(&s.a_exps[stage_index][wg * 64 + warp * 16 + lane / 4]);
    const float a_lo = e8m0_scale(ptx::ld_shared_u8(at)), a_hi = e8m0_scale(ptx::ld_shared_u8(at + 8));
    int next_e0 = 0, next_e1 = 0;
    if (kb + 1 < k_steps) next_e0 = __ldg(sc.b[0] + kb + 1), next_e1 = __ldg(sc.b[1] + kb + 1);
    const auto& stage = s.stages[stage_index];
    const std::uint32_t desc_a = ptx::wgmma_descriptor_sw128_lo(reinterpret_cast<const char*>(stage.a) + wg * 64 * kFp8BlockK);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::uint32_t desc_b = ptx::wgmma_descriptor_sw128_lo(reinterpret_cast<const char*>(stage.b) + half * kFp8TileBytes);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kFp8BlockK / 32; ++kk)
        ptx::wgmma_m64n128k32_e4m3(block, desc_a + KMajor::kDescStep * kk, desc_b + KMajor::kDescStep * kk, kk != 0);
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(block);  // no read of the block before the wait
      if (half == 1) {
        if (tid == 0) pipe.consumer_release(s.barriers, stage_index);
        pipe.consumer_advance();
      }
      const float b_scale = exp2_int(half == 0 ? e0 : e1);  // (ldexpf: ~13 more instructions a half)
      float scale[2] = {a_lo * b_scale, a_hi * b_scale};  // exact: powers of two
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[64 * half + i] = __fmaf_rn(block[i], scale[(i >> 1) & 1], acc[64 * half + i]);
    }
    e0 = next_e0, e1 = next_e1;
  }
}

}  // namespace mok::kernels
