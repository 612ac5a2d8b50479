// The FP8 mainloop of the persistent kernels (DeepSeek-V3's blockwise recipe, mok/fp8.hpp): a
// stage holds 128 of K in E4M3 — A = 128 rows x 128 K, B = 256 rows x 128 K as two halves of
// 128 rows — which is one scale block of every operand. Used by the FP8 forward's routed GEMMs
// and the FP8 backward's dgrad GEMMs.
#pragma once

#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels {

inline constexpr std::uint32_t kFp8TileBytes = kBoxFp8.bytes(1);  // 16 KB: A, or one half of B, of a stage
static_assert(kBoxFp8.cols == kFp8BlockK && kBoxFp8.rows == 128);

// The scales of one FP8 task: A's per row and 128 K ([K / 128, capacity] fp32, this
// warpgroup's rows from a_rows), B's per 128 x 128 block (exponents, one a K block: b[0] for
// B's rows 0-127, b[1] for rows 128-255).
struct Fp8TaskScales {
  const float* a_rows;
  int a_stride;  // (elements: the plan's capacity)
  const std::int32_t* b[2];
};

// The consumer warpgroups' FP8 MMA batches in turn — timing variants of the same bits, being
// measured (bench/NOTES.md, "The FP8 warpgroups' MMA batches issued in turn"). A warpgroup
// promotes a batch only after it completes, with no MMA of its own in flight; batches issued
// together complete together, so both warpgroups promoted at once and the tensor cores idled
// (the promotion-free timing build ran the forward 14-16 % faster).
// - MOK_DIAG_FP8_TURNS: issued strictly in turn (0's batch, then 1's, then 0's): hides the
//   promotions only if the tensor cores run a sub-partition's MMAs in issue order. Measured
//   1-2 % slower (they do not).
// - MOK_DIAG_FP8_TURNS_DONE: warpgroup 1 issues batch n only once warpgroup 0's batch n has
//   completed; warpgroup 0 issues batch n + 1 once warpgroup 1 has issued batch n. Warpgroup 1's
//   batch then starts while warpgroup 0 promotes, warpgroup 0's next one while warpgroup 1's
//   runs, and the two complete a promotion apart, in either tensor-core order.
// Two named barriers: turn0 (warpgroup 0's signal; warpgroup 1 waits there before each batch)
// and turn1 (the reverse). Warpgroup 1 arrives at turn1 once before its first task (start), so
// warpgroup 0 waits at every batch, and warpgroup 0 takes its last arrival after its last task
// (finish): every arrival is waited for within the kernel, and neither warpgroup can arrive
// twice before the other has waited. Both warpgroups run every FP8 mainloop of their CTA with
// the same K (the cooperative tile), so the turns pair up; a timeout elsewhere traps the grid.
struct Fp8Turns {
#if defined(MOK_DIAG_FP8_TURNS) || defined(MOK_DIAG_FP8_TURNS_DONE)
  static constexpr int kTurn0 = static_cast<int>(NamedBarrier::turn0), kTurn1 = kTurn0 + 1;
  // (No branch between a batch's issue and its wait: barrier ids computed, from %tid rather than
  // from wg, which would then stay live through the mainloop; arrivals predicated.)
  __device__ __forceinline__ static int warpgroup() { return static_cast<int>(threadIdx.x / 128) - 1; }
  __device__ __forceinline__ static void arrive_if(bool pred, int id) {
    asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %0, 0;\n @p bar.arrive %1, 256;\n}" ::"r"(static_cast<unsigned>(pred)),
                 "r"(id) : "memory");
  }
  __device__ __forceinline__ static void start(int wg) {
    if (wg != 0) ptx::named_barrier_arrive(kTurn1, 256);
  }
  __device__ __forceinline__ static void before_issue() { ptx::named_barrier_sync(kTurn1 - warpgroup(), 256); }
#if defined(MOK_DIAG_FP8_TURNS)
  __device__ __forceinline__ static void after_issue() { ptx::named_barrier_arrive(kTurn0 + warpgroup(), 256); }
  __device__ __forceinline__ static void after_complete() {}
#else
  __device__ __forceinline__ static void after_issue() { arrive_if(warpgroup() != 0, kTurn1); }
  __device__ __forceinline__ static void after_complete() { arrive_if(warpgroup() == 0, kTurn0); }
#endif
  // +0 or -0, read from %clock after the arrival: the promotion's scales take it (exact: the
  // scales are nonzero), so ptxas cannot schedule the promotion above warpgroup 0's arrival.
  __device__ __forceinline__ static float signed_zero_after_arrival() {
    unsigned clock;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(clock)::"memory");
    return __uint_as_float(clock & 0x80000000u);
  }
  __device__ __forceinline__ static void finish(int wg) {
    if (wg == 0) ptx::named_barrier_sync(kTurn1, 256);
  }
#else
  __device__ __forceinline__ static void start(int) {}
  __device__ __forceinline__ static void before_issue() {}
  __device__ __forceinline__ static void after_issue() {}
  __device__ __forceinline__ static void after_complete() {}
  __device__ __forceinline__ static void finish(int) {}
#endif
};
static_assert(kConsumerWarpgroups == 2, "Fp8Turns alternates two warpgroups");

// One FP8 GEMM over k_steps stages: acc (the BF16 mainloop's layout: B's rows 0-127 in
// acc[0, 64), rows 128-255 in acc[64, 128)) = the sum over K blocks kb, in ascending order,
// of (A_kb B_kb^T) * a_scale(row, kb) * b_scale(half, kb). Each half's four MMAs sum into
// the block accumulator (the tensor cores' own precision inside one scale block), which is
// then promoted in fp32 (the batches issued in turn with the other warpgroup's: Fp8Turns).
template <int kStages, typename P, typename S>
__device__ __forceinline__ void mainloop_fp8(const P& p, S& s, Pipeline<kStages>& pipe, float (&acc)[128], int k_steps,
                                             int wg, int task, const Fp8TaskScales& sc) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const float* a_rows = sc.a_rows + warp * 16 + lane / 4;  // this thread's rows r and r + 8
  // (Both zeroed, and apart from a BF16 branch's array: an accumulator that enters the loop
  // undefined, or one array for both branches, made ptxas serialize the MMAs or spill.)
  float block[64];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) block[i] = 0.0f;
  // The scales of block kb, loaded one block ahead (an L2 load's latency is longer than the
  // block's MMAs). A's are read only after the task's first stage has landed: scales written
  // by other CTAs (h, dgate|dup) are published with the rows the producer waited for before
  // that stage's loads (all of the tile's K blocks at once).
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
  float a_lo = 0.0f, a_hi = 0.0f;
  int e0 = __ldg(sc.b[0]), e1 = __ldg(sc.b[1]);  // (weights: constant during the kernel)
  for (int kb = 0; kb < k_steps; ++kb) {
    const int stage_index = pipe.consumer_wait(p, s.barriers, task);
    if (kb == 0) a_lo = __ldcg(a_rows), a_hi = __ldcg(a_rows + 8);
    float next_a_lo = 0.0f, next_a_hi = 0.0f;
    int next_e0 = 0, next_e1 = 0;
    if (kb + 1 < k_steps) {
      next_a_lo = __ldcg(a_rows + (kb + 1) * sc.a_stride), next_a_hi = __ldcg(a_rows + (kb + 1) * sc.a_stride + 8);
      next_e0 = __ldg(sc.b[0] + kb + 1), next_e1 = __ldg(sc.b[1] + kb + 1);
    }
    const auto& stage = s.stages[stage_index];
    const std::uint32_t desc_a = ptx::wgmma_descriptor_sw128_lo(reinterpret_cast<const char*>(stage.a) + wg * 64 * kFp8BlockK);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::uint32_t desc_b = ptx::wgmma_descriptor_sw128_lo(reinterpret_cast<const char*>(stage.b) + half * kFp8TileBytes);
      Fp8Turns::before_issue();
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kFp8BlockK / 32; ++kk)
        ptx::wgmma_m64n128k32_e4m3(block, desc_a + KMajor::kDescStep * kk, desc_b + KMajor::kDescStep * kk, kk != 0);
      ptx::wgmma_commit_group();
      Fp8Turns::after_issue();
      ptx::wgmma_wait_group<0>();
      Fp8Turns::after_complete();
#pragma unroll
      for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(block[i])::"memory");  // no read of the block before the wait
      if (half == 1) {
        if (tid == 0) pipe.consumer_release(s.barriers, stage_index);
        pipe.consumer_advance();
      }
      const float b_scale = exp2_int(half == 0 ? e0 : e1);  // (ldexpf: ~13 more instructions a half)
#if defined(MOK_DIAG_FP8_TURNS_DONE)
      const float zero = Fp8Turns::signed_zero_after_arrival();
      const float scale[2] = {__fmaf_rn(a_lo, b_scale, zero), __fmaf_rn(a_hi, b_scale, zero)};  // (the same values)
#else
      const float scale[2] = {a_lo * b_scale, a_hi * b_scale};  // exact: powers of two
#endif
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[64 * half + i] = __fmaf_rn(block[i], scale[(i >> 1) & 1], acc[64 * half + i]);
    }
    a_lo = next_a_lo, a_hi = next_a_hi, e0 = next_e0, e1 = next_e1;
  }
}

}  // namespace mok::kernels
