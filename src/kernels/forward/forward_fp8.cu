// Fused MoE forward with the routed experts in FP8 (E4M3, DeepSeek-V3's recipe with
// power-of-two scales), one GPU or one rank of an EP group (rows pulled before the kernel, no
// ring): the BF16 forward's CTA, pipeline, stages, schedule, tiles, combine and EP pushes
// (src/kernels/forward/forward.cu), with the routed GEMMs' operands and sums replaced.
//
//   before the kernel: the routed x rows are gathered (EP: from the ranks that own the tokens)
//       and quantized per 1 x 128 block of a row (launch_quantize_rows: E4M3 rows in plan
//       order, one power-of-two scale a block, as its E8M0 byte); on one GPU into the last
//       quarter of the bf16 slot buffer (a GEMM2 tile waits for the GEMM1 tiles of the rows its
//       slot rows overwrite, as the BF16 kernel does for its bf16 rows), on an EP rank into its
//       x rows' buffer
//   producer: a routed stage fills the BF16 kernel's 48 KB stage with twice its K: A = 128
//       rows x 128 K and B = 256 rows x 128 K of E4M3 (GEMM1: 128 gate rows, then 128 up
//       rows; GEMM2: 256 rows of w_down). The shared expert's tasks load BF16 stages.
//   routed GEMM1 and GEMM2 tasks (the BF16 kernel's tiles: 128 rows x 256 columns): a
//       stage's 128 K is one scale block of every operand, and each half of B (128 rows)
//       is one weight block. Per stage and half, four wgmma m64n128k32 sum the block into
//       a 64-register block accumulator, which is then promoted into the fp32 total:
//       total += block * a_scale(row) * b_scale(half) (the recipe's promotion every 128 K;
//       a power-of-two scale product is exact). The total has the BF16 kernel's
//       accumulator layout (gate in acc[0, 64), up in acc[64, 128)), so GEMM2's slot rows
//       and the training's saved pre-activations are the BF16 kernel's epilogues. GEMM1's
//       h: each row's largest |h| over the tile's 128 columns gives its scale, h goes out
//       as E4M3 (TMA store) and the scale's E8M0 byte into h_exps, published through h_ready.
//       A stage brings its A rows' scale bytes with it.
//   The two consumer warpgroups share each stage; while one promotes its block, the
//   tensor cores run the other's MMAs.
//   The shared expert's GEMMs, the combine, the EP pushes of GEMM2's rows to the ranks that
//   own their tokens and every wait are the BF16 kernel's. Training
//   (Training::save): GEMM1 saves its gate/up pre-activations as the BF16 kernel does, so
//   the BF16 backward runs on the FP8 forward's activations.
//
// A task only waits on lower-numbered tasks and every CTA is resident: no deadlock. The bits
// do not depend on the grid: each tile's sums run in a fixed order in one warpgroup.
#include "kernels/forward/forward_fp8.cuh"

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/phase_timing.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/common/skeleton.cuh"
#include "kernels/common/swiglu.cuh"
#include "kernels/ep/ep_push.cuh"
#include "kernels/forward/epilogues.cuh"
#include "kernels/forward/producer.cuh"
#include "kernels/forward/tasks.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/mainloop_fp8.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels {

MOK_PHASE_TABLE(forward_fp8)  // (kernels/common/phase_timing.cuh)

namespace {

using namespace mok::ptx;
using namespace fwd;

static_assert(kFp8TileBytes == sizeof(SharedStorage::Stage::a) && 2 * kFp8TileBytes == sizeof(SharedStorage::Stage::b));
static_assert(kBoxFp8.rows == kBlockM);
static_assert(kBlockN == 2 * kBlockM && kGemm1Columns == kBlockM, "each half of B is one 128 x 128 weight block");
static_assert(kBoxFp8Half.bytes(1) <= sizeof(SharedStorage::h_staging[0]) && kBoxFp8Half.rows == 64 &&
              kBoxFp8Half.cols == kGemm1Columns, "a warpgroup's E4M3 h tile is one box of its staging");

// Each routed stage brings its A rows' scale bytes (Fp8ForwardParams::x_exps / h_exps, 128 bytes) into
// s.a_exps, and the consumers' promotions read them there (mainloop_fp8) instead of loading scales from
// L2 a block ahead: bitwise the same, the FP8 forward 1.03-1.05x as fast at the power cap (H100, b843338;
// bench/NOTES.md, thirty-fifth session).
static_assert(sizeof(SharedStorage::a_exps[0]) == kFp8RowExponentBytes);

// ---------------------------------------------------------------------------------- producer

// kNotes: the consumers read TaskNotes (one GPU; an EP rank's consumers, at their register limit
// with the push epilogue, decode each task themselves: the notes spilled its producer and consumers).
template <bool kNotes>
__device__ void run_producer_fp8(const Fp8ForwardParams& q, SharedStorage& s, const Schedule& sched) {
  const ForwardParams& p = q.base;
  Pipeline<kStages> pipe;
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind == kCombine) break;  // combine tasks come last and load nothing
    if (t.shared) {                 // BF16, as the BF16 kernel loads it
      load_task<kNotes>(p, s, pipe, sched, t, task);
      continue;
    }
    const int expert = p.plan.tile_expert[t.m], row0 = p.plan.tile_row[t.m];
    const bool gemm1 = t.kind == kGemm1;
    if (!gemm1) {
      wait_counter(p, p.counters.h_ready + t.m, sched.hidden_parts(false), task, WaitSite::hidden_ready);
      wait_e4m3_x_rows_read(p, sched, row0, task);  // (the E4M3 x rows under its slot rows)
      fence_proxy_async_global();  // the h rows were written by other CTAs' TMA stores
    }
    const int k_steps = (gemm1 ? p.hidden : p.inter) / kFp8BlockK;
    constexpr std::uint32_t kStageBytes = 3 * kFp8TileBytes + kFp8RowExponentBytes;
    // The first stage, with the task's note (the consumers decode nothing themselves), before the
    // loop: the note's fields are not kept live through it.
    std::uint64_t* first = pipe.producer_acquire(p, s.barriers, task, kStageBytes, [&] {
      if (kNotes) s.notes[sched.note_slot(task)] = TaskNote{t, row0, expert};
    });
    for (int step = 0; step < k_steps; ++step) {
      const int k = step * kFp8BlockK;
#if defined(MOK_DIAG_FP8_NO_LOADS) || defined(MOK_DIAG_FP8_A_ONLY)
      // Timing only (wrong results): the task's first stage loads A and B; later stages load A
      // only (A_ONLY: B's L2 traffic gone, the MMAs read the stage's stale B) or nothing
      // (NO_LOADS: the MMAs' and shared memory's own rate). With MOK_DIAG_FP8_NO_PROMOTION they
      // split the feed's cost: bench/NOTES.md, "What bounds the FP8 mainloop".
#if defined(MOK_DIAG_FP8_NO_LOADS)
      const bool load_a = step == 0;
#else
      const bool load_a = true;
#endif
      if (step > 0) {
        std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, load_a ? kFp8TileBytes : 0);
        if (load_a) tma_load_2d(s.stages[pipe.stage()].a, gemm1 ? &q.maps.x : &q.maps.h_load, full, k, row0);
        pipe.producer_commit();
        continue;
      }
#endif
      std::uint64_t* full = step == 0 ? first : pipe.producer_acquire(p, s.barriers, task, kStageBytes);
      SharedStorage::Stage& stage = s.stages[pipe.stage()];
      char* b = reinterpret_cast<char*>(stage.b);
      tma_load_2d(stage.a, gemm1 ? &q.maps.x : &q.maps.h_load, full, k, row0);
      // (K block `step`'s bytes of rows [row0, row0 + 128): contiguous)
      bulk_load(s.a_exps[pipe.stage()], (gemm1 ? q.x_exps : q.h_exps) + step * q.capacity + row0, kFp8RowExponentBytes, full);
      if (gemm1) {  // 128 gate rows, then the same 128 up rows
        tma_load_3d(b, &q.maps.gate, full, k, t.n * kGemm1Columns, expert);
        tma_load_3d(b + kFp8TileBytes, &q.maps.up, full, k, t.n * kGemm1Columns, expert);
      } else {      // 256 rows of w_down (the second half past H is zero-filled)
        tma_load_3d(b, &q.maps.down, full, k, t.n * kBlockN, expert);
        tma_load_3d(b + kFp8TileBytes, &q.maps.down, full, k, t.n * kBlockN + kBlockM, expert);
      }
      pipe.producer_commit();
    }
  }
}

// --------------------------------------------------------------------------------- consumers

// h = swiglu(gate, up) of this warpgroup's 64 rows x 128 columns as E4M3 with one
// power-of-two scale a row (its 128 columns are one block): the row's largest |h| is a max
// over the thread's values and its quad's (any order gives the same), the values go
// through the swizzled staging to one TMA store, the scales' E8M0 bytes to h_exps; published by
// publish_hidden() one task later, as in the BF16 kernel. (Training: the pre-activations
// are saved first, as the BF16 kernel saves them.)
__device__ void epilogue_gemm1_fp8(const Fp8ForwardParams& q, SharedStorage& s, float (&acc)[128], const Task& t,
                                   int row0, int wg, int& pending_index) {
  const ForwardParams& p = q.base;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  if (p.saved_gu) {  // through the staging as the BF16 kernel saves them (TMA stores)
    publish_hidden(p, pending_index);
    save_pre_activations</*kSharedWindow=*/true>(p, s, acc, t, row0, wg);
  }
  float amax[2] = {0.0f, 0.0f};  // rows r (accumulators with ((i >> 1) & 1) == 0) and r + 8
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    acc[i] = swiglu(acc[i], acc[i + 64], p.swiglu_limit);
    amax[(i >> 1) & 1] = fmaxf(amax[(i >> 1) & 1], fabsf(acc[i]));
  }
#pragma unroll
  for (int half = 0; half < 2; ++half)
    for (int offset = 1; offset < 4; offset *= 2)
      amax[half] = fmaxf(amax[half], __shfl_xor_sync(0xffffffffu, amax[half], offset));
  const int exponent[2] = {fp8_scale_exponent(amax[0]), fp8_scale_exponent(amax[1])};
  const InverseScale inverse[2] = {InverseScale(exponent[0]), InverseScale(exponent[1])};
  publish_hidden(p, pending_index);  // its store has also finished reading the staging
  sync_warpgroup(wg);
  char* staging = reinterpret_cast<char*>(s.h_staging[wg]);
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const int row = acc_row(warp, lane, i), col = acc_col(lane, i);
    const InverseScale& inv = inverse[(i >> 1) & 1];
    *reinterpret_cast<std::uint16_t*>(staging + swizzled_offset_bytes(row, col)) = pack_e4m3x2(inv(acc[i]), inv(acc[i + 1]));
  }
  if (lane % 4 == 0) {
    std::uint8_t* exps = q.h_exps + t.n * q.capacity + row0 + wg * 64 + warp * 16 + lane / 4;
    exps[0] = e8m0_byte(exponent[0]), exps[8] = e8m0_byte(exponent[1]);
#if !defined(MOK_DIAG_FP8_NO_EXPS_FENCE)  // (timing only)
    fence_proxy_async_global();  // (GEMM2's producers read the bytes with bulk copies: the async proxy)
#endif
  }
  fence_proxy_async_shared_cta();
  sync_warpgroup(wg);  // (also orders every thread's scale byte stores before the publishing release)
  if (tid == 0) {
    tma_store_2d(&q.maps.h_store, s.h_staging[wg], t.n * kGemm1Columns, row0 + wg * 64);
    tma_store_commit_group();
  }
  pending_index = t.m;
}

// kEp: a rank of an EP group (GEMM2's rows pushed to the ranks that own their tokens); the
// one-GPU kernel is compiled without that path (its registers: the push spills there).
// kNotes: the producer's TaskNotes (forward_task_notes(); never with kEp); else the consumers' own decode.
template <bool kEp, bool kNotes>
__device__ void run_consumer_fp8(const Fp8ForwardParams& q, SharedStorage& s, const Schedule& sched, int wg) {
  const ForwardParams& p = q.base;
  Pipeline<kStages> pipe;
  bool slots_ready = false;
  int pending_hidden = -1;  // h_ready index of a GEMM1 store not yet published
  int pending_slots = 0;    // GEMM2 tiles not yet counted in y_done
  PhaseTimer timer(forward_fp8_phase_table);  // (empty unless built with MOK_PHASE_TIMING)
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const TaskKind kind = sched.kind_of(p, task);
    if (kind != kGemm1) publish_hidden(p, pending_hidden);  // (this CTA's own GEMM2 loads may need it)
    if (kind == kCombine) {
      timer.lap<Phase::other>();
      if (!slots_ready) {
        wait_for_slot_rows(p, s, sched, wg, pending_slots, task);  // (and, EP, every rank's pushes)
        slots_ready = true;
        timer.lap<Phase::combine_wait>();
      }
      combine(p, sched.combine_task(task));
      timer.lap<Phase::combine>();
      continue;
    }
    // One GPU where forward_task_notes() (kNotes): the producer's note (each field read where it is
    // used); else the consumers' own decode. An EP rank's consumers, at their register limit with the
    // push epilogue, decode the task themselves (the notes spilled the rank kernel's producer and
    // consumers).
    const auto note = [&] {
      if constexpr (!kNotes) return DecodedTask(p, sched, task);
      else return wait_task_note(p, s, pipe, sched, task);
    }();
    timer.lap<Phase::other>();
    if (note.shared()) {  // BF16, as the BF16 kernel computes it
      float acc[128];  // (apart from the FP8 branch's: see mainloop_fp8)
      const int k_steps = (kind == kGemm1 ? p.hidden : p.shared_inter) / kBlockK;
      mainloop<KMajor, KMajor>(p, s, pipe, acc, k_steps, wg, task);
      const Task t = note.task();
      if (t.kind == kGemm1) {
        timer.lap<Phase::mainloop_gemm1>();
        epilogue_gemm1</*kSharedWindow=*/true>(p, s, acc, t, note.row0(), wg, pending_hidden);
        timer.lap<Phase::epilogue_gemm1>();
      } else {
        timer.lap<Phase::mainloop_gemm2>();
        epilogue_gemm2(p, s, acc, t, note.row0(), wg);
        timer.lap<Phase::epilogue_gemm2>();
        ++pending_slots;
      }
      continue;
    }
    const int expert = note.expert(), n = note.n();
    float acc[128];  // (not the BF16 branch's: see mainloop_fp8)
    if (kind == kGemm1) {
      const int k_blocks = p.hidden / kFp8BlockK;
      const std::int64_t block_row = (static_cast<std::int64_t>(expert) * (p.inter / kGemm1Columns) + n) * k_blocks;
      const Fp8TaskScales sc{{q.gate_exponents + block_row, q.up_exponents + block_row}};
      mainloop_fp8<kStages>(p, s, pipe, acc, k_blocks, wg, task, sc);
      timer.lap<Phase::mainloop_gemm1>();
      epilogue_gemm1_fp8(q, s, acc, note.task(), note.row0(), wg, pending_hidden);
      timer.lap<Phase::epilogue_gemm1>();
    } else {
      // w_down's blocks 2n and 2n + 1 along H; past H (H = 128 mod 256) the zero-filled rows
      // take block 2n's scale.
      const int k_blocks = p.inter / kFp8BlockK, h_blocks = p.hidden / kBlockM;
      const std::int32_t* down = q.down_exponents + static_cast<std::int64_t>(expert) * h_blocks * k_blocks;
      const int b0 = 2 * n, b1 = b0 + 1 < h_blocks ? b0 + 1 : b0;
      const Fp8TaskScales sc{{down + b0 * k_blocks, down + b1 * k_blocks}};
      mainloop_fp8<kStages>(p, s, pipe, acc, k_blocks, wg, task, sc);
      timer.lap<Phase::mainloop_gemm2>();
      if constexpr (kEp) epilogue_gemm2_push(p, s, acc, note.task(), note.row0(), wg);  // (the rows to their tokens' ranks)
      else epilogue_gemm2(p, s, acc, note.task(), note.row0(), wg);
      timer.lap<Phase::epilogue_gemm2>();
      ++pending_slots;
    }
  }
  publish_hidden(p, pending_hidden);
  publish_slots(p, wg, pending_slots);
  if constexpr (kEp) publish_pushes(p, s, wg);
  timer.lap<Phase::other>();
}

// The FP8 forward as a policy of the persistent skeleton (kernels/common/skeleton.cuh): one GPU,
// or (kEp) one rank of an EP group. kNotes: forward_task_notes() (one GPU only).
template <bool kEp, bool kNotes = false>
struct Fp8ForwardKernel {
  static_assert(!(kEp && kNotes), "an EP rank's FP8 consumers decode their tasks (the notes spilled them)");
  using Storage = SharedStorage;
  // One GPU: the producer's FP8 and BF16 (shared expert) loads spilled in the BF16 kernels' 40
  // registers; the FP8 consumer fits in 224. EP: the push epilogue spilled 216 bytes at 224, so
  // the BF16 kernels' split (ptxas: the rank kernel spill-free, the group kernel's runtime-indexed
  // parameters 156 bytes, as the BF16 group kernels' 80-112).
  static constexpr int kProducerRegs = kEp ? 40 : 56, kConsumerRegs = kEp ? 232 : 224;
  static constexpr int kStageReaders = kConsumerWarpgroups;  // both warpgroups read every stage
  using P = Fp8ForwardParams;

  __device__ static bool stalled(const P& q) { return kEp && q.base.ep.stalled; }
  __device__ static bool inputs_valid(const P& q, int cta, int ctas) {
    if (kEp ? all_plans_ok(q.base, false) : q.base.plan.status->code == PlanStatus::ok) return true;  // (EP: every rank's)
    poison_output(q.base, cta, ctas);
    return false;
  }
  __device__ static void init_shared(const P& q, Storage&, int cta) {
    if (threadIdx.x == 32) {
      const Fp8ForwardMaps& m = q.maps;
      for (const CUtensorMap* map : {&m.x, &m.gate, &m.up, &m.down, &m.h_load, &m.h_store}) tma_prefetch_descriptor(map);
    }
    if (q.base.saved_marker && cta == 0 && threadIdx.x == 0) *q.base.saved_marker = kSavedValid;
  }
  __device__ static bool is_comm(const P&, int) { return false; }
  __device__ static void run_comm(const P&, Storage&, int) {}
  __device__ static Schedule schedule(const P& q, int cta, int ctas) { return Schedule(q.base, cta, ctas); }
  // (EP: each role makes its schedule again from cta and ctas; held in registers across the
  // register split, its fields spilled 16 bytes)
  __device__ static void produce(const P& q, Storage& s, const Schedule& sched) {
    if constexpr (kEp) run_producer_fp8<kNotes>(q, s, Schedule(q.base, sched.cta, sched.ctas));
    else run_producer_fp8<kNotes>(q, s, sched);
  }
  __device__ static void consume(const P& q, Storage& s, const Schedule& sched, int wg) {
    if constexpr (kEp) run_consumer_fp8<kEp, kNotes>(q, s, Schedule(q.base, sched.cta, sched.ctas), wg);
    else run_consumer_fp8<kEp, kNotes>(q, s, sched, wg);
  }
};

template <bool kNotes>
__global__ void __launch_bounds__(kThreads, 1) forward_fp8_kernel(const __grid_constant__ Fp8ForwardParams p) {
  run_persistent<Fp8ForwardKernel<false, kNotes>>(p, blockIdx.x, gridDim.x);
}

// One rank of an EP group that runs its own launch (EpRank, or a group of one).
__global__ void __launch_bounds__(kThreads, 1) forward_fp8_rank_kernel(const __grid_constant__ Fp8ForwardParams p) {
  run_persistent<Fp8ForwardKernel<true>>(p, blockIdx.x, gridDim.x);
}

// Virtual ranks: CTA c serves rank c / ctas_per_rank (as forward_group_kernel).
__global__ void __launch_bounds__(kThreads, 1) forward_fp8_group_kernel(const __grid_constant__ Fp8ForwardGroupParams g) {
  run_persistent<Fp8ForwardKernel<true>>(g.rank[blockIdx.x / g.ctas_per_rank], blockIdx.x % g.ctas_per_rank,
                                         g.ctas_per_rank);
}

}  // namespace

void launch_forward_fp8(const Fp8ForwardParams& params, int num_ctas, cudaStream_t stream) {
  if (params.base.ep.push)
    launch_persistent<forward_fp8_rank_kernel>(forward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
  else if (forward_task_notes(params.base))
    launch_persistent<forward_fp8_kernel<true>>(forward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
  else
    launch_persistent<forward_fp8_kernel<false>>(forward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
}

void launch_forward_fp8_group(const Fp8ForwardGroupParams& params, cudaStream_t stream) {
  launch_persistent<forward_fp8_group_kernel>(forward_shared_memory_bytes(), kThreads, params,
                                              params.ranks * params.ctas_per_rank, stream);
}

void load_forward_fp8_kernels() {
  configure_persistent<forward_fp8_kernel<true>>(forward_shared_memory_bytes());
  configure_persistent<forward_fp8_kernel<false>>(forward_shared_memory_bytes());
  configure_persistent<forward_fp8_rank_kernel>(forward_shared_memory_bytes());
  configure_persistent<forward_fp8_group_kernel>(forward_shared_memory_bytes());
}

}  // namespace mok::kernels
