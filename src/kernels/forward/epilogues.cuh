// The fused forward's consumer epilogues (GEMM1's SwiGLU and saved pre-activations, GEMM2's
// slot rows or their pushes to the owning rank), the combine, and how consumer warpgroups
// publish what they have done.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ep/ep_push.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/common/combine_staged.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "kernels/common/slot_rows.cuh"
#include "kernels/common/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"
#include "kernels/forward/tasks.cuh"

namespace mok::kernels::fwd {

using namespace mok::ptx;

// ---------------------------------------------------------------------------------- consumers

// Completes this warpgroup's previous GEMM1 store and publishes it: h_ready[index] += 1.
// Deferred to the next task so that the store's latency hides behind a mainloop.
__device__ __forceinline__ void publish_hidden(const ForwardParams& p, int& pending_index) {
  if (pending_index < 0) return;
  if (threadIdx.x % 128 == 0) {
    tma_store_wait_all();
    fence_proxy_async_global();
    red_release_gpu_add(p.counters.h_ready + pending_index, 1);
  }
  pending_index = -1;
}

// Training: the gate and up pre-activations of this warpgroup's tile, bf16, into rows of
// [gate (I) | up (I)] for the backward. A value the clamp cut is saved as +-inf: rounding
// to bf16 must not move a value across the limit (the gradient there is zero). Each half
// (64 x 128: gate, then up) goes through the warpgroup's 16 KB h staging to two TMA stores
// (stored from the accumulators, 4 bytes of 8 rows a warp at a time, the saves took about a
// third of GEMM1's epilogue in a training forward). The caller has completed the previous
// GEMM1 store (publish_hidden), which read the staging; returns once the stores have read it.
// kSharedWindow: stage_bf16_half's (the FP8 kernel, at its register limit).
template <bool kSharedWindow = false, typename S>
__device__ inline void save_pre_activations(const ForwardParams& p, S& s, const float (&acc)[128], const Task& t,
                                            int row0, int wg) {
  const int tid = threadIdx.x % 128;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // gate columns are elements [0, 64), up columns [64, 128)
    stage_bf16_half<kSharedWindow>(reinterpret_cast<char*>(s.h_staging[wg]), acc, half, wg, [half, &p](float a, float b) {
      return half == 0 ? pack_bf16x2(saved_gate(a, p.swiglu_limit), saved_gate(b, p.swiglu_limit))
                       : pack_bf16x2(saved_up(a, p.swiglu_limit), saved_up(b, p.swiglu_limit));
    });
    if (tid == 0) {  // (inter % 64 == 0: a 64-column box is wholly gate or wholly up)
      const int inter = t.shared ? p.shared_inter : p.inter, n0 = t.n * kGemm1Columns;
      const CUtensorMap* map = t.shared ? &p.maps.shared_saved_gu : &p.maps.saved_gu;
      tma_store_2d(map, s.h_staging[wg][0], half * inter + n0, row0 + wg * 64);
      if (n0 + 64 < inter) tma_store_2d(map, s.h_staging[wg][1], half * inter + n0 + 64, row0 + wg * 64);
      tma_store_commit_group();
    }
  }
  if (tid == 0) tma_store_wait_read();  // (the caller's next writer of the staging syncs the warpgroup first)
}

// h = swiglu(gate, up) of this warpgroup's 64 x 128 tile -> staging (swizzled) -> TMA store,
// published later by publish_hidden(); training saves through the staging first
// (save_pre_activations). kSharedWindow: every staging write as st.shared at a 32-bit
// address (the FP8 kernel, at its register limit: 32 generic 64-bit store addresses, held
// while the branch-free SwiGLU is scheduled above the warpgroup barrier, spilled it).
template <bool kSharedWindow = false>
__device__ inline void epilogue_gemm1(const ForwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                               int row0, int wg, int& pending_index) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  publish_hidden(p, pending_index);  // its store has also finished reading the staging
  std::uint16_t* gu = t.shared ? p.shared_saved_gu : p.saved_gu;
  if (gu) save_pre_activations<kSharedWindow>(p, s, acc, t, row0, wg);
  // (without saves: a GEMM2 task just before this one — Config::interleave_rows — published no h,
  // and its slot rows' TMA stores may still be reading the staging)
  else if (tid == 0) tma_store_wait_read();
  sync_warpgroup(wg);
  char* staging = reinterpret_cast<char*>(s.h_staging[wg]);
#pragma unroll
  for (int i = 0; i < 64; i += 2) {  // gate column c is element i, up column c + 128 is element i + 64
    const int row = acc_row(warp, lane, i), col = acc_col(lane, i);
    const float h0 = swiglu(acc[i], acc[i + 64], p.swiglu_limit);
    const float h1 = swiglu(acc[i + 1], acc[i + 65], p.swiglu_limit);
    if constexpr (kSharedWindow)
      ptx::st_shared_b32(ptx::smem_address(staging) + swizzled_offset(row, col), pack_bf16x2(h0, h1));
    else
      *reinterpret_cast<std::uint32_t*>(staging + swizzled_offset(row, col)) = pack_bf16x2(h0, h1);
  }
  fence_proxy_async_shared_cta();
  sync_warpgroup(wg);
  if (tid == 0) {
    const int inter = t.shared ? p.shared_inter : p.inter;
    const CUtensorMap* h = t.shared ? &p.maps.shared_h_store : &p.maps.h_store;
    const int n0 = t.n * kGemm1Columns, r0 = row0 + wg * 64;
    tma_store_2d(h, s.h_staging[wg][0], n0, r0);
    if (n0 + 64 < inter) tma_store_2d(h, s.h_staging[wg][1], n0 + 64, r0);
    tma_store_commit_group();
  }
  pending_index = t.shared ? p.max_routed_tiles + t.m : t.m;
}

// Publishes this warpgroup's GEMM2 tiles (y_done), deferred until the combine, their only reader.
__device__ __forceinline__ void publish_slots(const ForwardParams& p, int wg, int& pending_tiles) {
  publish_stored_tiles(p.counters.y_done, pending_tiles, wg);
}

// bf16 rows of this warpgroup's 64 x 256 tile into the slot buffer (published by
// publish_slots()): two halves of 128 columns through the warpgroup's 16 KB staging
// (stage_bf16_half: two swizzled 64-column panels), each as two TMA stores of 64 x 64. The
// combine sums the rows in fp32 (docs/design.md: each expert's row is rounded to bf16 first,
// as PyTorch's grouped GEMMs round theirs). The second half waits for the first half's stores to
// read the staging (staging it in the mainloop's last stage instead, kept until the next
// mainloop, measured no faster: bench/NOTES.md; removed).
__device__ inline void epilogue_gemm2(const ForwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                               int row0, int wg) {
  const int tid = threadIdx.x % 128;
  const CUtensorMap* map = t.shared ? &p.maps.shared_slots : &p.maps.slots;
  char* staging = reinterpret_cast<char*>(s.h_staging[wg]);
  const int n0 = t.n * kBlockN;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (n0 + 128 * half >= p.hidden) break;  // (hidden is a multiple of 64: a panel is wholly in or out)
    stage_bf16_half(staging, acc, half, wg, [](float a, float b) { return pack_bf16x2(a, b); });
    if (tid == 0) {
      const int col = n0 + 128 * half;
      tma_store_2d(map, s.h_staging[wg][0], col, row0 + wg * 64);
      if (col + 64 < p.hidden) tma_store_2d(map, s.h_staging[wg][1], col + 64, row0 + wg * 64);
      tma_store_commit_group();
    }
  }
}

// Expert parallelism: bf16 rows of this warpgroup's 64 x 256 tile into the slots of the
// rank that owns each token (row t * k + j there). Two halves of 128 columns through the
// warpgroup's 16 KB staging (swizzled, as for epilogue_gemm2), then every thread stores
// 16-byte pieces (8 columns), 16 threads covering one row's 256 bytes of a half, so a peer
// GPU receives whole 256-byte row segments over NVLink instead of 4-byte fragments straight
// from the accumulator layout. The rows per owner are counted in shared memory and published
// by publish_pushes(), so that no epilogue waits for its stores to land (a fence per tile cost
// 20% on qwen3-30b-a3b).
__device__ inline void epilogue_gemm2_push(const ForwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                                    int row0, int wg) {
  const int tid = threadIdx.x % 128;
  const int n0 = t.n * kBlockN, rows0 = row0 + wg * 64, piece = tid % 16;  // piece: 8 columns of a half
  const int pairs_per_rank = p.tokens * p.top_k;
  char* staging = reinterpret_cast<char*>(s.h_staging[wg]);
  std::int32_t pair[8];  // of rows tid / 16 + 8 i
#pragma unroll
  for (int i = 0; i < 8; ++i) pair[i] = p.plan.row_pair[rows0 + tid / 16 + 8 * i];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (n0 + 128 * half >= p.hidden) break;  // (hidden is a multiple of 64: a panel is wholly in or out)
    // (its first sync: every thread has read the previous half)
    stage_bf16_half(staging, acc, half, wg, [](float a, float b) { return pack_bf16x2(a, b); });
    const int col = n0 + 128 * half + 8 * piece;
    if (col >= p.hidden) continue;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (pair[i] < 0) continue;  // padding row
      const uint4 v = *reinterpret_cast<const uint4*>(staging + swizzled_offset(tid / 16 + 8 * i, 8 * piece));
      std::uint16_t* row = p.ep.slots[pair[i] / pairs_per_rank] + static_cast<std::int64_t>(pair[i] % pairs_per_rank) * p.hidden;
      *reinterpret_cast<uint4*>(row + col) = v;
    }
  }
  count_pushed_rows(p.ep, p.plan.row_pair, rows0, pairs_per_rank, s.pushed[wg]);
}

__device__ inline void publish_pushes(const ForwardParams& p, SharedStorage& s, int wg) {
  if (p.ep.push) publish_pushed_rows(p.ep, s.pushed[wg], wg);
}

// Before a CTA's first combine task, on every consumer thread: publishes this warpgroup's
// GEMM2 tiles (and pushed rows), then waits until every GEMM2 tile of the launch (and every
// peer's rows pushed to this rank) has landed.
__device__ inline void wait_for_slot_rows(const ForwardParams& p, SharedStorage& s, const Schedule& sched, int wg,
                                          int& pending_slots, int task) {
  publish_slots(p, wg, pending_slots);
  publish_pushes(p, s, wg);
  if (threadIdx.x == kProducerThreads) {
    wait_counter(p, p.counters.y_done, sched.slot_tiles_total(), task, WaitSite::all_gemm2);
    if (p.ep.push)
      for (int q = 0; q < p.ep.size; ++q)
        wait_peer_counter(p, p.ep.slots_done[p.ep.rank] + q, p.ep.expected_rows[q] * sched.n2, task, WaitSite::forward_pushed, q);
  }
  sync_consumers();
}

// Combine task t on `threads` consumer threads (tid: this one's index among them): both
// warpgroups by default, one in the ping-pong forward.
__device__ inline void combine(const ForwardParams& p, const Task& t, int tid = threadIdx.x - kProducerThreads,
                               int threads = 128 * kConsumerWarpgroups) {
#if defined(MOK_DIAG_NO_COMBINE)  // (a timing build, wrong y: what the combine costs in wall time; bench/NOTES.md)
  return;
#endif
  const int begin = t.m * kForwardCombineTokens, end = min(p.tokens, (t.m + 1) * kForwardCombineTokens);
#if MOK_DIAG_FWD_STAGED_COMBINE  // (one GPU, both warpgroups: the stages are free once every GEMM task is done)
  if (!p.ep.push && threads == 128 * kConsumerWarpgroups) {
    SharedStorage& s = shared_storage<SharedStorage>();
    if (combine_tokens_staged_fit(begin, end, p.hidden, p.top_k, p.plan.pair_row, p.topk_weights, p.slots, p.shared_slots,
                                  p.y, tid, threads, reinterpret_cast<uint4*>(s.stages), sizeof(s.stages)))
      return;
  }
#endif
  if (p.ep.push)
    combine_tokens<true, true>(begin, end, p.hidden, p.top_k, nullptr, p.ep.own_ids, p.topk_weights, p.ep.slots[p.ep.rank],
                               p.shared_slots, p.y, tid, threads);
  else
    combine_tokens<true, false>(begin, end, p.hidden, p.top_k, p.plan.pair_row, nullptr, p.topk_weights, p.slots,
                                p.shared_slots, p.y, tid, threads);
}

// Bad routing (expert id out of range, capacity): no GEMM runs, y becomes NaN so the
// failure cannot pass for a result, and the host reports it at the next check.
__device__ inline void poison_output(const ForwardParams& p, int cta, int ctas) {
  const std::int64_t n = static_cast<std::int64_t>(p.tokens) * p.hidden;
  for (std::int64_t i = cta * blockDim.x + threadIdx.x; i < n; i += static_cast<std::int64_t>(ctas) * blockDim.x)
    if (p.y) p.y[i] = 0x7fc0;  // bf16 quiet NaN (no y in the backward's recompute)
  if (cta == 0 && threadIdx.x == 0) {
    p.status->code = KernelStatus::bad_plan;
    __threadfence_system();
  }
}

}  // namespace mok::kernels::fwd
