// The fused forward's producer: one thread that waits for each task's inputs (GEMM1 rows
// for GEMM2, the ring's rows) and issues the task's TMA loads into the pipeline.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ep/ep_push.cuh"
#include "kernels/forward/forward.cuh"
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

// One GPU, x rows in the slot buffer's last bytes (kernels/common/slot_rows.cuh; kPerSlot 2:
// the FP8 forward's E4M3 rows): before the slot rows [row0, row0 + 128) are stored, every GEMM1
// tile of the x rows under them must have read them: M-tiles at or below this tile's, so
// lower-numbered tasks. (The BF16 forward's bf16 x rows, kPerSlot 1, lie each under its own
// slot row: its M-tile's h wait, wait_hidden_rows, already covers them.)
template <typename Sched, int kPerSlot>
__device__ inline void wait_x_rows_read(const ForwardParams& p, const Sched& sched, int row0, int task) {
  const RowRange x = x_rows_under_slots(row0, kBlockM, p.x_rows_in_slots, static_cast<long long>(sched.m_routed) * kBlockM,
                                        kPerSlot);
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

// The loads of GEMM task t (bf16 operands), stage by stage, after waiting for its inputs.
__device__ inline void load_task(const ForwardParams& p, SharedStorage& s, Pipeline<kStages>& pipe, const Schedule& sched,
                          const Task& t, int task) {
  const int expert = t.shared ? 0 : p.plan.tile_expert[t.m];
  const int row0 = t.shared ? t.m * kBlockM : p.plan.tile_row[t.m];
  const CUtensorMap *a, *b0, *b1 = nullptr;
  int k_steps, b_row;
  int a_row = row0;
  if (t.kind == kGemm1) {
    if (t.mb >= 0) {  // ring: the minibatch's rows have landed; they sit at row mod ring_rows
      wait_counter(p, p.ring.landed + t.mb, minibatch_rows(p, t.mb), task, WaitSite::forward_landed);
      fence_proxy_async_global();  // written by the comm CTAs' generic stores
      a_row = row0 % p.ring.ring_rows;
    }
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
    std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, kStageBytesA + kStageBytesB);
    SharedStorage::Stage& stage = s.stages[pipe.stage()];
    tma_load_2d(stage.a, a, full, kb * kBlockK, a_row);
    if (b1) {
      tma_load_3d(stage.b, b0, full, kb * kBlockK, b_row, expert);
      tma_load_3d(stage.b + kGemm1Columns * kBlockK, b1, full, kb * kBlockK, b_row, expert);
    } else {
      tma_load_3d(stage.b, b0, full, kb * kBlockK, b_row, expert);
    }
    pipe.producer_commit();
  }
}

// One thread issues every load; the rest of the warpgroup has nothing to do.
__device__ inline void run_producer(const ForwardParams& p, SharedStorage& s, const Schedule& sched) {
  Pipeline<kStages> pipe;
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind == kCombine) break;  // combine tasks come last and load nothing
    load_task(p, s, pipe, sched, t, task);
  }
}

}  // namespace mok::kernels::fwd
