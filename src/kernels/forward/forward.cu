// Fused MoE forward, one GPU: one persistent launch, 384 threads per CTA, 1 CTA per SM.
//
//   warpgroup 0 (producer, 40 regs)   fills a 4-stage ring of {A 128x64, B 256x64} tiles:
//   (one thread of it issues every TMA load)
//       GEMM1: A = 128 rows of x_routed (the dispatch kernel's copy of the routed rows,
//              in plan order) or of x (shared expert); B = gate tile (rows 0-127) and
//              up tile (rows 128-255) of the expert. Gathering rows inside the A load
//              (TMA per row or cp.async) measured 1.4-1.5x slower end to end on deepseek-v3.
//       GEMM2: thread 0 waits h_ready[m], then loads h rows and the down tile
//       Where forward_task_notes() (short tasks: forward.cuh), each GEMM task's decode (M-tile,
//       N-tile, first plan row, expert) goes to the consumers as a TaskNote with its first stage
//       (kernels/forward/tasks.cuh): they load nothing to start a task. Else (kNotes false)
//       the consumers decode each task themselves.
//   warpgroups 1, 2 (consumers, 232 regs)  64 rows each: wgmma m64n256k16 over K, then
//       GEMM1 epilogue: h = swiglu(gate, up) -> bf16 -> swizzled staging -> TMA store;
//                       h_ready[m] += 1 (release) once the store completed, one task later
//       GEMM2 epilogue: rows -> bf16 -> staging -> TMA stores into the slot buffer; y_done +=
//                       tiles (release) when the warpgroup reaches the combine, so no wait
//                       stalls a tile
//       combine:        after y_done is complete, y[t] = shared[t] + sum_j w[t,j]*slot,
//                       in ascending j, fp32 fma over the bf16 rows, y rounded to bf16
//
// Tasks: [GEMM1 routed | GEMM1 shared | GEMM2 routed | GEMM2 shared | combine]; inside
// one expert the GEMM tasks run N-tile-major with the M-tiles fastest, so the tasks in
// flight share one weight slice in L2 (M-major re-read mixtral's weights from HBM). CTA c
// takes c, c + G, c + 2G, ... in increasing order. A task only waits on lower-numbered
// tasks, and every CTA is resident, so the lowest unfinished task can always run: no
// deadlock. Which CTA computes a tile never changes its bits: results do not depend on
// the grid size. No floating-point atomics anywhere.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ep/ep_push.cuh"
#include "kernels/forward/epilogues.cuh"
#include "kernels/forward/producer.cuh"
#include "kernels/forward/tasks.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/phase_timing.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "kernels/common/skeleton.cuh"
#include "kernels/common/slot_rows.cuh"
#include "kernels/common/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels {

MOK_PHASE_TABLE(forward)  // (kernels/common/phase_timing.cuh)

namespace {

using namespace mok::ptx;
using namespace fwd;

// kNotes: the producer's TaskNotes (forward_task_notes()); else the consumers' own decode.
template <bool kNotes>
__device__ void run_consumer(const ForwardParams& p, SharedStorage& s, const Schedule& sched, int wg) {
  Pipeline<kStages> pipe;
  bool slots_ready = false;
  int pending_hidden = -1;  // h_ready index of a GEMM1 store not yet published
  int pending_slots = 0;    // GEMM2 tiles not yet counted in y_done
  PhaseTimer timer(forward_phase_table);  // (empty unless built with MOK_PHASE_TIMING)
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const TaskKind kind = sched.kind_of(p, task);
    // Publish before anything this CTA might wait for: its own GEMM2 loads can need it.
    if (kind != kGemm1) publish_hidden(p, pending_hidden);
    if (kind == kCombine) {
      timer.lap<Phase::other>();
      if (!slots_ready) {
        wait_for_slot_rows(p, s, sched, wg, pending_slots, task);
        slots_ready = true;
        timer.lap<Phase::combine_wait>();
      }
      combine(p, sched.combine_task(task));
      timer.lap<Phase::combine>();
      continue;
    }
    const auto note = [&] {  // (the producer's note, each field read where it is used)
      if constexpr (!kNotes) return DecodedTask(p, sched, task);
      else return wait_task_note(p, s, pipe, sched, task);
    }();
    timer.lap<Phase::other>();
    float acc[128];
    mainloop<KMajor, KMajor>(p, s, pipe, acc, gemm_k_steps(p, note.task()), wg, task);
    const Task t = note.task();
    if (t.kind == kGemm1) timer.lap<Phase::mainloop_gemm1>();
    else timer.lap<Phase::mainloop_gemm2>();
    if (t.mb >= 0) publish_count(p.ring.freed + t.mb, 1, wg);  // its ring rows are read: the slot may be reused
    if (t.kind == kGemm1) {
      epilogue_gemm1(p, s, acc, t, note.row0(), wg, pending_hidden);
      timer.lap<Phase::epilogue_gemm1>();
    } else {
      if (p.ep.push && !t.shared) epilogue_gemm2_push(p, s, acc, t, note.row0(), wg);
      else epilogue_gemm2(p, s, acc, t, note.row0(), wg);
      ++pending_slots;
      timer.lap<Phase::epilogue_gemm2>();
    }
  }
  publish_hidden(p, pending_hidden);
  publish_slots(p, wg, pending_slots);
  publish_pushes(p, s, wg);
  timer.lap<Phase::other>();
}

// ------------------------------------------------------------------------------- comm CTAs

// Comm CTA `comm` of `comms`: its kCommWarps warps pull the plan's rows into the ring (see
// RingPull); a minibatch's slots are free again once every GEMM1 warpgroup-tile of it has
// read them.
__device__ void fwd_run_comm(const ForwardParams& p, SharedStorage& s, int comm, int comms) {
  init_comm(s.comm);
  const int warp = threadIdx.x / 32;
  if (warp >= kCommWarps) return;
  const RingPull<1> pull{{{p.ring.buffer, p.ring.x}}, p.plan.row_pair, p.plan.expert_offset[p.num_local_experts], p.hidden,
                         p.tokens, p.top_k, p.ring};
  const int n1 = (p.inter + kGemm1Columns - 1) / kGemm1Columns;
  CommPipe pipe = comm_pipe(s.stages, s.comm, warp);
  pull.run(p, pipe, comm * kCommWarps + warp, comms * kCommWarps,
           [&](int mb) { return kConsumerWarpgroups * n1 * pull.rows_of(mb) / kBlockM; }, WaitSite::forward_freed, WaitSite::forward_copy);
}

// The forward as a policy of the persistent skeleton (kernels/common/skeleton.cuh): one rank's
// forward on CTAs cta = 0 .. ctas - 1 of those serving it. kNotes: see forward_task_notes().
template <bool kNotes>
struct ForwardKernel {
  using Storage = SharedStorage;
  static constexpr int kProducerRegs = kProducerRegisters, kConsumerRegs = kConsumerRegisters;
  static constexpr int kStageReaders = kConsumerWarpgroups;  // both warpgroups read every stage
  using P = ForwardParams;

  __device__ static bool stalled(const P& p) { return p.ep.stalled; }
  __device__ static bool inputs_valid(const P& p, int cta, int ctas) {
    if (all_plans_ok(p, false)) return true;
    poison_output(p, cta, ctas);
    return false;
  }
  __device__ static void init_shared(const P& p, Storage&, int cta) {
    if (threadIdx.x == 32) {
      const ForwardMaps& m = p.maps;
      for (const CUtensorMap* map : {&m.x_routed, &m.gate, &m.up, &m.down, &m.h_load, &m.h_store}) tma_prefetch_descriptor(map);
    }
    if (p.saved_marker && cta == 0 && threadIdx.x == 0) *p.saved_marker = kSavedValid;
  }
  __device__ static bool is_comm(const P& p, int cta) { return cta < p.ring.comm_ctas; }
  __device__ static void run_comm(const P& p, Storage& s, int cta) { fwd_run_comm(p, s, cta, p.ring.comm_ctas); }
  __device__ static Schedule schedule(const P& p, int cta, int ctas) {
    return Schedule(p, cta - p.ring.comm_ctas, ctas - p.ring.comm_ctas);
  }
  __device__ static void produce(const P& p, Storage& s, const Schedule& sched) { run_producer<kNotes>(p, s, sched); }
#if defined(MOK_DIAG_COPY_WARPS)
  __device__ static void assist(const P& p, Storage&, const Schedule& sched, int warp) {
    if (p.x_rows_src) copy_x_rows(p, sched, warp);
  }
#endif
  __device__ static void consume(const P& p, Storage& s, const Schedule& sched, int wg) { run_consumer<kNotes>(p, s, sched, wg); }
};

#if defined(MOK_DIAG_COPY_WARPS)  // (the skeleton runs assist() only where this expression is valid)
static_assert(requires(const ForwardParams& p, SharedStorage& s, const Schedule& sched, int warp) {
  ForwardKernel<true>::assist(p, s, sched, warp);
});
#endif

template <bool kNotes>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel(const __grid_constant__ ForwardParams p) {
  run_persistent<ForwardKernel<kNotes>>(p, blockIdx.x, gridDim.x);
}

// (virtual ranks: the consumers' own decode; the notes cost the group kernel's runtime-indexed
// parameters more spills, and these launches are the protocol's test bed, not a speed path)
__global__ void __launch_bounds__(kThreads, 1) forward_group_kernel(const __grid_constant__ ForwardGroupParams g) {
  run_persistent<ForwardKernel<false>>(g.rank[blockIdx.x / g.ctas_per_rank], blockIdx.x % g.ctas_per_rank,
                                       g.ctas_per_rank);
}

TaskNotes task_notes_mode = TaskNotes::by_shape;  // (set_forward_task_notes: tests only)

}  // namespace

bool forward_task_notes(const ForwardParams& params) {
  if (kDiagTaskDecode || task_notes_mode == TaskNotes::off) return false;
  return task_notes_mode == TaskNotes::on ||
         (params.hidden <= kTaskNotesMaxHidden && params.inter <= kTaskNotesMaxInter);
}
void set_forward_task_notes(TaskNotes mode) { task_notes_mode = mode; }

std::size_t forward_shared_memory_bytes() { return shared_storage_bytes<SharedStorage>(); }


void launch_forward(const ForwardParams& params, int num_ctas, cudaStream_t stream) {
  if (forward_task_notes(params))
    launch_persistent<forward_kernel<true>>(forward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
  else
    launch_persistent<forward_kernel<false>>(forward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
}

void load_forward_kernels() {
  configure_persistent<forward_kernel<true>>(forward_shared_memory_bytes());
  configure_persistent<forward_kernel<false>>(forward_shared_memory_bytes());
  configure_persistent<forward_group_kernel>(forward_shared_memory_bytes());
}

void launch_forward_group(const ForwardGroupParams& params, cudaStream_t stream) {
  launch_persistent<forward_group_kernel>(forward_shared_memory_bytes(), kThreads, params,
                    params.ranks * params.ctas_per_rank, stream);
}

}  // namespace mok::kernels
