// The fused forward's producer: one thread that waits for each task's inputs (GEMM1 rows
// for GEMM2, the ring's rows) and issues the task's TMA loads into the pipeline.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ep/ep_push.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/common/diag.cuh"
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

// ---------------------------------------------------------------------------------- producer

// One GPU, the FP8 forward's E4M3 x rows in the slot buffer's upper half (kernels/common/slot_rows.cuh,
// per_slot 2): before the slot rows [row0, row0 + 128) are stored, every GEMM1 tile of the x rows
// under them must have read them: M-tiles at or below this tile's, so lower-numbered tasks. (The
// BF16 forward's bf16 x rows, per_slot 1, lie each under its own slot row: its M-tile's h wait,
// wait_hidden_rows, already covers them.)
template <typename Sched>
__device__ inline void wait_e4m3_x_rows_read(const ForwardParams& p, const Sched& sched, int row0, int task) {
  if (p.x_rows_in_slots == 0) return;  // (an EP rank: its x rows have a buffer of their own)
  const RowRange x = x_rows_under_slots(row0, kBlockM, p.x_rows_in_slots, static_cast<long long>(sched.m_routed) * kBlockM,
                                        2);
  for (long long m = x.first / kBlockM; m * kBlockM < x.end; ++m)
    wait_counter(p, p.counters.h_ready + m, sched.hidden_parts(false), task, WaitSite::x_rows_read);
}

// Before a GEMM2 task's loads: waits until its h rows are stored — on one GPU also the sign that
// the x rows under its slot rows (its own M-tile's: tile_row[m] = 128 m) have been read.
template <typename Sched>
__device__ __forceinline__ void wait_hidden_rows(const ForwardParams& p, const Sched& sched, const Task& t, int task) {
  wait_counter(p, p.counters.h_ready + (t.shared ? p.max_routed_tiles + t.m : t.m), sched.hidden_parts(t.shared), task,
               WaitSite::hidden_ready);
  fence_proxy_async_global();  // the h rows were written by other CTAs' TMA stores
}

// The loads of GEMM task t (bf16 operands), stage by stage, after waiting for its inputs; with
// kNotes (the kernel's consumers read TaskNotes) its note goes with the first stage.
template <bool kNotes>
__device__ inline void load_task(const ForwardParams& p, SharedStorage& s, Pipeline<kStages>& pipe, const Schedule& sched,
                          const Task& t, int task) {
  const int expert = task_expert(p, t), row0 = task_row0(p, t);
  const CUtensorMap *a, *b0, *b1 = nullptr;
  int k_steps, b_row;
  int a_row = row0;
  if (t.kind == kGemm1) {
    if (t.mb >= 0) {  // ring: the minibatch's rows have landed; they sit at row mod ring_rows
      wait_counter(p, p.ring.landed + t.mb, minibatch_rows(p, t.mb), task, WaitSite::forward_landed);
      fence_proxy_async_global();  // written by the comm CTAs' generic stores
      a_row = row0 % p.ring.ring_rows;
    }
#if defined(MOK_DIAG_COPY_WARPS) && !defined(MOK_DIAG_COPY_SHADOW)
    if (!t.shared && p.x_rows_src) {  // the producer warps' copy of this M-tile's rows (copy_x_rows)
      wait_counter(p, p.counters.x_copied + t.m, kBlockM, task, WaitSite::x_rows_copied);
      fence_proxy_async_global();  // written by generic stores
    }
#endif
    a = t.shared ? &p.maps.x : &p.maps.x_routed;
    b0 = t.shared ? &p.maps.shared_gate : &p.maps.gate;
    b1 = t.shared ? &p.maps.shared_up : &p.maps.up;
    k_steps = p.hidden / kBlockK;
    b_row = t.n * kGemm1Columns;
  } else {
    wait_hidden_rows(p, sched, t, task);
    a = t.shared ? &p.maps.shared_h_load : &p.maps.h_load;
    b0 = t.shared ? &p.maps.shared_down : &p.maps.down;
    k_steps = (t.shared ? p.shared_inter : p.inter) / kBlockK;
    b_row = t.n * kBlockN;
  }
  for (int kb = 0; kb < k_steps; ++kb) {
    // (the task's first stage carries its note: the consumers decode nothing themselves)
    const auto note = [&] {
      if (kNotes && kb == 0) s.notes[sched.note_slot(task)] = TaskNote{t, row0, expert};
    };
#if MOK_DIAG_FWD_FEED  // (kernels/common/diag.cuh: timing only)
    const bool load_a = kb == 0 || MOK_DIAG_FWD_FEED == 1, load_b = kb == 0;
    std::uint64_t* full =
        pipe.producer_acquire(p, s.barriers, task, (load_a ? kStageBytesA : 0) + (load_b ? kStageBytesB : 0), note);
    SharedStorage::Stage& stage = s.stages[pipe.stage()];
    if (load_a) tma_load_2d(stage.a, a, full, kb * kBlockK, a_row);
    if (!load_b) {
      pipe.producer_commit();
      continue;
    }
#else
    std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, kStageBytesA + kStageBytesB, note);
    SharedStorage::Stage& stage = s.stages[pipe.stage()];
    tma_load_2d(stage.a, a, full, kb * kBlockK, a_row);
#endif
    if (b1) {
      tma_load_3d(stage.b, b0, full, kb * kBlockK, b_row, expert);
      tma_load_3d(stage.b + kGemm1Columns * kBlockK, b1, full, kb * kBlockK, b_row, expert);
    } else {
      tma_load_3d(stage.b, b0, full, kb * kBlockK, b_row, expert);
    }
    pipe.producer_commit();
  }
}

#if defined(MOK_DIAG_COPY_WARPS)
// A measured variant (bench/NOTES.md, ninth session: as the default it made the forward 5-7 %
// slower on deepseek-v3 and qwen3-30b-a3b), kept as a diagnostic build to find out why. One GPU:
// warps 1-3 of the producer warpgroup of every CTA copy the routed rows of x into plan order
// (what the dispatch kernel does before the launch), beside the GEMMs. Plan row r goes to copy
// warp r mod W (W: three a CTA), each warp's rows ascending, so rows land roughly in plan order,
// the order GEMM1 reads them; padding rows become zeros. After each row the warp adds 1 to its
// M-tile's x_copied (release); GEMM1's loads of an M-tile wait for all 128. The copy waits for
// nothing, so it cannot deadlock. MOK_DIAG_COPY_SHADOW: the dispatch kernel copies the rows as
// by default and this copy goes to a buffer nobody reads, GEMM1 waiting for nothing: the
// copy's interference alone, the same bits as the default. MOK_DIAG_COPY_NO_PROXY_FENCE: no
// writer-side proxy fence (the reader's, after its acquire, remains).
__device__ inline void copy_x_rows(const ForwardParams& p, const Schedule& sched, int warp) {
  constexpr int kCopyWarps = kProducerThreads / 32 - 1;
  const int lane = threadIdx.x % 32, vectors = p.hidden / 8;
  const int rows = p.plan.expert_offset[p.num_local_experts];
  const int workers = sched.ctas * kCopyWarps, worker = (warp - 1) * sched.ctas + sched.cta;
  int pair_of_lane = -1;
  for (int i = 0, row = worker; row < rows; ++i, row += workers) {
    if (i % 32 == 0) {  // the next 32 rows' pairs, one load a lane
      const int mine = row + lane * workers;
      pair_of_lane = mine < rows ? p.plan.row_pair[mine] : -1;
    }
    const int pair = __shfl_sync(0xffffffffu, pair_of_lane, i % 32);
    uint4* dst = reinterpret_cast<uint4*>(p.x_rows_dst + static_cast<std::int64_t>(row) * p.hidden);
    if (pair < 0) {
      for (int v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    } else {
      warp_copy_row(dst, reinterpret_cast<const uint4*>(p.x_rows_src + static_cast<std::int64_t>(pair / p.top_k) * p.hidden),
                    vectors, lane);
    }
#if !defined(MOK_DIAG_COPY_NO_PROXY_FENCE)
    fence_proxy_async_global();  // TMA loads read these rows next
#endif
    __syncwarp();
    if (lane == 0) {
      fence_acq_rel_gpu();
      red_release_gpu_add(p.counters.x_copied + row / kBlockM, 1);
    }
  }
}
#endif

// One thread issues every load; the rest of the warpgroup has nothing to do.
template <bool kNotes>
__device__ inline void run_producer(const ForwardParams& p, SharedStorage& s, const Schedule& sched) {
  Pipeline<kStages> pipe;
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind == kCombine) break;  // combine tasks come last and load nothing
    load_task<kNotes>(p, s, pipe, sched, t, task);
  }
}

}  // namespace mok::kernels::fwd
