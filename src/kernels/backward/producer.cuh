// The fused backward's producer: one thread that waits for each task's inputs (its
// counters, the ring's rows) and issues the task's TMA loads into the pipeline.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/backward/backward.cuh"
#include "kernels/ep/ep_push.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "kernels/common/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "kernels/backward/tasks.cuh"
#include "kernels/fp8/mainloop_fp8.cuh"

namespace mok::kernels::bwd {

using namespace mok::ptx;

// ---------------------------------------------------------------------------------- producer

// One thread issues every load. Boxes entirely past the matrix edge are not loaded: their
// accumulator rows/columns are never stored.
// The FP8 dgrad (Fp8BackwardParams): a routed dh or dx task's stages hold 128 of K in E4M3 —
// A = its 128 rows (dy, or dgate|dup), B = 256 rows of W_down^T or [W_gate^T | W_up^T] as two
// halves of 128 (past I or H: zero-filled) — each K block one scale block of every operand.
template <typename Sched, typename Q>
__device__ void run_producer(const Q& q, SharedStorage& s, const Sched& sched) {
  const BackwardParams& p = base_of(q);
  Pipeline<kStages> pipe;
  s.rows_seen = -2, s.dw_down_seen = 0;  // (SharedStorage: the producer thread's own)
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind == kCombine) break;
    const ExpertSetMaps& maps = t.shared ? p.shared_maps : p.routed_maps;
    const int inter = t.shared ? p.shared.inter : p.routed.inter;
    const bool ring = reads_ring<Sched>(t);
    if (ring) {  // its dy / x rows have landed in the rings
      int first = 0, count = 0;
      ring_rows_read(p, t, first, count);
      const int per = p.ring.minibatch_rows;
      for (int mb = first / per; count > 0 && mb <= (first + count - 1) / per; ++mb)
        wait_counter(p, p.ring.landed + mb, minibatch_rows(p, mb), task, WaitSite::backward_landed);
      fence_proxy_async_global();  // written by the comm CTAs' bulk and generic stores
    }
    int row0 = 0, k_steps = 0;
    // One counter to wait for (one call site: a second one spilled): a dx task's dh tiles,
    // or, when a routed dW_gate|up task's stores overwrite the dy rows and w h kept in the
    // gradient buffers, every routed dW_down tile (each waited for the dh tiles of its expert).
    int* counter = nullptr;
    int expected = 0;
    WaitSite site = WaitSite::dh_ready;
    if (t.kind == kDh || t.kind == kDx) {
      row0 = tile_row0(p, t);
      if (t.kind == kDx) {
        // One GPU: its dx rows overwrite its x rows, which its expert's dW_gate|up tiles
        // (lower-numbered) read; those count in the dgu_ready of the expert's first M-tile
        // once done, and each of them waited for every dh tile of the expert, so that one
        // counter says both.
        const bool over_x = !Sched::kRing && p.dx_over_x && !t.shared;
        counter = p.counters.dgu_ready + (over_x ? p.plan.expert_offset[t.e] / kBlockM : dgu_counter(p, t, t.m));
        // (its expert's dW_gate|up tiles of this column block and the earlier ones: n_hi N-tiles)
        expected = kConsumerWarpgroups * (sched.n_dh(t.shared) + (over_x ? sched.m_wgu_r * sched.n_hi : 0));
        if constexpr (Sched::kRing) wait_counter(p, counter, expected, task, site);  // (here: fewer registers)
      }
      k_steps = (t.kind == kDh ? p.hidden : 2 * inter) / kBlockK;
    } else {
      int count = 0;
      expert_rows(p, t, row0, count);
      // Its expert's dh tiles, once per run of tasks of one expert (a CTA takes ~tasks / CTAs
      // in a row): each wait is a round trip to L2 before the task's first load.
      const int expert = t.shared ? -1 : t.e;
      if (Sched::kRing || expert != s.rows_seen)  // (the ring kernel: every time; skipping there spilled)
        for (int m = row0 / kBlockM; m < (row0 + count) / kBlockM; ++m)
          wait_counter(p, p.counters.dgu_ready + dgu_counter(p, t, m), kConsumerWarpgroups * sched.n_dh(t.shared),
                       task, WaitSite::expert_dh_ready);
      if constexpr (!Sched::kRing) s.rows_seen = expert;
      if (!Sched::kRing && p.rows_in_grads && t.kind == kWgu && !t.shared && !s.dw_down_seen) {
        counter = p.counters.wd_done;
        expected = kConsumerWarpgroups * sched.experts * sched.m_wd * sched.n_dh_r;
        site = WaitSite::grad_rows_read;
      }
      k_steps = count / kBlockK;
    }
    if (k_steps == 0) k_steps = 1;  // weight_k_steps() (dh and dx tasks have more)
    if (!Sched::kRing && counter != nullptr) {
      wait_counter(p, counter, expected, task, site);
      if (site == WaitSite::grad_rows_read) s.dw_down_seen = 1;  // (it stays done)
    }
    if (t.kind != kDh) fence_proxy_async_global();  // dgu, w h written by generic stores of other CTAs
    if constexpr (kFp8Dgrad<Q>) {
      if (fp8_task<Q>(t)) {
        const bool dh = t.kind == kDh;
        const CUtensorMap* a_map = dh ? &q.maps.dy : &q.maps.dgu;
        const CUtensorMap* b_map = dh ? &q.maps.down_t : &q.maps.gate_up_t;
        const int n0 = t.n * kBlockN, steps = (dh ? p.hidden : 2 * inter) / kFp8BlockK;
        for (int kb = 0; kb < steps; ++kb) {
          std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, 3 * kFp8TileBytes + kFp8RowExponentBytes);
          SharedStorage::Stage& st = s.stages[pipe.stage()];
          char* b = reinterpret_cast<char*>(st.b);
          const int k0 = kb * kFp8BlockK;
          tma_load_2d(st.a, a_map, full, k0, row0);
          // (K block kb's bytes of rows [row0, row0 + 128): contiguous)
          bulk_load(s.a_exps[pipe.stage()], (dh ? q.dy_exps : q.dgu_exps) + kb * q.capacity + row0, kFp8RowExponentBytes, full);
          tma_load_3d(b, b_map, full, k0, n0, t.e);
          tma_load_3d(b + kFp8TileBytes, b_map, full, k0, n0 + kBlockM, t.e);
          pipe.producer_commit();
        }
        continue;
      }
    }
    // Boxes of this task: A (K-major: one; MN-major: up to two), B (up to four MN-major).
    const int n0 = t.n * kBlockN, m0 = t.m * kBlockM;
    const int b_limit = t.kind == kDh ? inter : t.kind == kWd ? inter : p.hidden;
    const int a_limit = t.kind == kWd ? p.hidden : 2 * inter;
    int b_boxes = 0, a_boxes = 1;
    while (b_boxes < 4 && n0 + 64 * b_boxes < b_limit) ++b_boxes;
    if (t.kind == kWd || t.kind == kWgu) a_boxes = m0 + 64 < a_limit ? 2 : 1;
    // Where the dy / x rows of the next load sit: plan row row0 (dh), row0 + k0 (weight
    // gradients: advanced by each K step), mod ring_rows in a ring.
    int rows_at = ring_row(p, ring, row0);
    // The dy maps' region of a load (BackwardParams::dy_split; the shared expert reads dy itself,
    // the ring's rows are one region). It and the stage's bytes are worked out again each K
    // step: kept across the loop, they spilled in the FP8 dgrad kernel (40 registers).
    const auto second_region = [&](int rows) { return !Sched::kRing && !t.shared && rows >= p.dy_split; };
    for (int kb = 0; kb < k_steps; ++kb) {
      int boxes = b_boxes;
      asm volatile("" : "+r"(boxes));  // (opaque: else the bytes are hoisted out of the loop, and spilled)
      const std::uint32_t a_bytes = (t.kind == kDh || t.kind == kDx) ? kKMajorABytes : a_boxes * kBoxBytes;
      const bool load = ((MOK_DIAG_BWD_NO_LOADS >> t.kind) & 1) == 0;  // (kernels/common/diag.cuh)
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, load ? a_bytes + boxes * kBoxBytes : 0);
      SharedStorage::Stage& st = s.stages[pipe.stage()];
      const int k0 = kb * kBlockK;
      if (load) switch (t.kind) {
        case kDh:
          tma_load_3d(st.a, &maps.dy_k, full, k0, rows_at, second_region(rows_at));
          for (int c = 0; c < b_boxes; ++c) tma_load_3d(st.b + c * 4096, &maps.down_mn, full, n0 + 64 * c, k0, t.e);
          break;
        case kDx: {
          tma_load_2d(st.a, &maps.dgu_k, full, k0, row0);
          const bool gate = k0 < inter;
          for (int c = 0; c < b_boxes; ++c)
            tma_load_3d(st.b + c * 4096, gate ? &maps.gate_mn : &maps.up_mn, full, n0 + 64 * c, gate ? k0 : k0 - inter, t.e);
          break;
        }
        case kWd:
          for (int w = 0; w < a_boxes; ++w)
            tma_load_3d(st.a + w * 4096, &maps.dy_mn, full, m0 + 64 * w, rows_at, second_region(rows_at));
          for (int c = 0; c < b_boxes; ++c) tma_load_2d(st.b + c * 4096, &maps.hw_mn, full, n0 + 64 * c, row0 + k0);
          break;
        default: {  // kWgu (the routed x rows hold the column block's columns from col_begin on)
          for (int w = 0; w < a_boxes; ++w) tma_load_2d(st.a + w * 4096, &maps.dgu_mn, full, m0 + 64 * w, row0 + k0);
          const int x0 = t.shared ? n0 : n0 - col_begin(p);
          for (int c = 0; c < b_boxes; ++c)
            tma_load_2d(st.b + c * 4096, &maps.x_mn, full, x0 + 64 * c, rows_at);
          break;
        }
      }
      if (t.kind == kWd || t.kind == kWgu) {  // the next 64 rows (ring_rows is a multiple of 64)
        rows_at += kBlockK;
        if (ring && rows_at == p.ring.ring_rows) rows_at = 0;
      }
      pipe.producer_commit();
    }
  }
}

}  // namespace mok::kernels::bwd
