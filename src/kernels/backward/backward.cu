// Fused MoE backward, one GPU: one persistent launch, 384 threads per CTA, 1 CTA per SM,
// the forward's structure (one TMA producer thread, two wgmma consumer warpgroups of 64
// rows, 4-stage ring of {A 128 x 64, B 256 x 64}). Per routed row r (token t, slot j,
// weight w) with the forward's saved pre-activations g, u:
//
//   dh    tasks  d = dy[t] . W_down            A dy rows (K-major), B W_down (MN-major)
//                epilogue: h = swiglu(g, u); partial of d_topk_weights[t,j] = sum_i h * d
//                (one per 256 columns, summed later in order); dg, du = SwiGLU backward of
//                w * d (clamp-aware), written over g, u in the saved tensor; w * h for the
//                weight gradient of W_down
//   dWd   tasks  dW_down[e] = dy^T . (w h) over the expert's rows     (both MN-major)
//   dWgu  tasks  [dW_gate; dW_up][e] = [dg du]^T . x over its rows    (both MN-major)
//                each output tile is one task with the full K loop in row order (no
//                split-K); f32 gradients are accumulated into, bf16 ones written. One
//                GPU with bf16 gradients: the dy rows and w h may live in the W_gate / W_up
//                gradient buffers (rows_in_grads), so a dWgu tile first waits for every
//                routed dWd tile (which read them, after every dh tile of their expert)
//   dx    tasks  dx_row = [dg du] . [W_gate; W_up]   A dgu (K-major), B W_gate|W_up (MN-major)
//                -> bf16 rows (TMA stores); waits for the M-tile's dh tasks (one GPU: the
//                rows overwrite the x rows, so it waits for its expert's dWgu tasks too)
//   combine      dx[t] = shared[t] + sum_j row_j (ascending j); d_topk_weights from the
//                partials in column order
//
// The shared expert is one more expert set with rows = tokens and w = 1. Task order and
// the no-deadlock argument are the forward's: a task waits only on lower-numbered tasks.
// Padding rows carry zeros into the weight-gradient sums (dispatch zeroes their x and dy,
// the dh epilogue writes zero dg, du, w h).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/backward/backward.cuh"
#include "kernels/backward/epilogues.cuh"
#include "kernels/backward/producer.cuh"
#include "kernels/backward/tasks.cuh"
#include "kernels/ep/ep_push.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/phase_timing.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "kernels/common/skeleton.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/mainloop_fp8.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"

namespace mok::kernels {

MOK_PHASE_TABLE(backward)  // (kernels/common/phase_timing.cuh)

namespace {

using namespace mok::ptx;
using namespace bwd;

static_assert(kFp8TileBytes == sizeof(SharedStorage::Stage::a) && 2 * kFp8TileBytes == sizeof(SharedStorage::Stage::b));
static_assert(kBlockN == 2 * kBlockM, "each half of an FP8 stage's B is one 128 x 128 weight block");

// The weight scales of a routed FP8 dgrad task: dh reads W_down^T's blocks (N-blocks 2n, 2n + 1 of
// I; past I the zero-filled rows take block 2n's), dx [W_gate^T | W_up^T]'s (N-blocks of H). (A's
// row scales, dy's or dgate|dup's, come with the stages.)
__device__ __forceinline__ Fp8TaskScales fp8_scales(const Fp8BackwardParams& q, const Task& t) {
  const BackwardParams& p = q.base;
  const int hb = p.hidden / kFp8BlockK, ib = p.routed.inter / kFp8BlockK;
  const bool dh = t.kind == kDh;
  const int n_blocks = dh ? ib : hb, k_blocks = dh ? hb : 2 * ib;
  const int b0 = 2 * t.n, b1 = b0 + 1 < n_blocks ? b0 + 1 : b0;
  const std::int32_t* w = (dh ? q.down_t_exponents : q.gate_up_t_exponents) + static_cast<std::int64_t>(t.e) * n_blocks * k_blocks;
  return {{w + b0 * k_blocks, w + b1 * k_blocks}};
}

// FP8 dgrad: this warpgroup's 64 rows of dgate | dup that epilogue_dh has just written (bf16,
// over the pre-activations) again as E4M3 for the dx tiles, with one power-of-two scale per row
// and 128 columns (the tile's 256 columns of I are two such blocks of dgate and two of dup; one
// past I when I = 128 mod 256). A half-warp takes a row's block (16 lanes x 8 values; its amax
// is a max, the same in any order), eight in flight a lane. Quantized from the bf16 values the
// weight gradients read.
__device__ void quantize_dgu_rows(const Fp8BackwardParams& q, const Task& t, int row0, int wg) {
  const BackwardParams& p = q.base;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int inter = p.routed.inter, n0 = t.n * kBlockN, blocks = inter - n0 > kBlockM ? 2 : 1;
  const int units = 64 * 2 * blocks;  // (row, dgate or dup, block)
  constexpr int kInFlight = 8;
  sync_warpgroup(wg);  // the warpgroup's dgate|dup stores are done (and visible to it)
  const std::int64_t row_base = row0 + wg * 64;
#pragma unroll 1
  for (int first = 2 * warp; first < units; first += 8 * kInFlight) {
    uint4 bits[kInFlight];
    int column[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int unit = first + 8 * j + lane / 16, r = unit % 64, which = (unit / 64) % 2, b = unit / 128;
      column[j] = which * inter + n0 + b * kBlockM;
      bits[j] = unit < units ? __ldcg(reinterpret_cast<const uint4*>(p.routed.gu + (row_base + r) * 2 * inter + column[j]) +
                                      lane % 16)
                             : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int unit = first + 8 * j + lane / 16, r = unit % 64;
      const std::uint32_t w[4] = {bits[j].x, bits[j].y, bits[j].z, bits[j].w};
      float v[8];
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack_bf16x2(w[i]);
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
      for (int offset = 1; offset < 16; offset *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      if (unit >= units) continue;
      const int e = fp8_scale_exponent(amax);
      const InverseScale inverse(e);
      const std::int64_t row = row_base + r;
      *reinterpret_cast<uint2*>(q.dgu_values + row * 2 * inter + column[j] + 8 * (lane % 16)) =
          make_uint2(pack_e4m3x4(inverse(v[0]), inverse(v[1]), inverse(v[2]), inverse(v[3])),
                     pack_e4m3x4(inverse(v[4]), inverse(v[5]), inverse(v[6]), inverse(v[7])));
      if (lane % 16 == 0) q.dgu_exps[column[j] / kFp8BlockK * q.capacity + row] = e8m0_byte(e);
    }
  }
}

template <typename Sched, typename Q>
__device__ void run_consumer(const Q& q, SharedStorage& s, const Sched& sched, int wg) {
  const BackwardParams& p = base_of(q);
  Pipeline<kStages> pipe;
  float acc[128];
  // dx tiles not yet counted in dx_done; -1 once the combine's inputs are ready (one register:
  // a flag of its own was the FP8 dgrad kernel's one consumer spill)
  int pending_dx = 0;
  PhaseTimer timer(backward_phase_table);  // (empty unless built with MOK_PHASE_TIMING)
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    switch_read(s.reads[wg], read_counter(p, t));
    timer.lap<Phase::other>();
    if (t.kind == kCombine) {
      if (pending_dx >= 0) {
        publish_dx_rows(p, wg, pending_dx);
        if (p.ep.push) publish_pushes(p, s, sched, wg, task);
        if (threadIdx.x == kProducerThreads) {
          wait_counter(p, p.counters.dx_done, sched.dx_tiles_total(p), task, WaitSite::all_dx);
          for (int m = 0, tiles = Sched::routed_tiles(p); m < tiles; ++m)  // the d_topk_weights partials (complete)
            wait_counter(p, p.counters.dgu_ready + m, kConsumerWarpgroups * sched.n_dh_r, task, WaitSite::dh_ready);
          if (p.ep.push)  // every pushed dx row and partial of this rank's tokens
            for (int q = 0; q < p.ep.size; ++q)
              wait_peer_counter(p, p.ep.slots_done[p.ep.rank] + q, p.ep.expected_rows[q] * (sched.n_dx + sched.n_dh_r),
                                task, WaitSite::backward_pushed, q);
        }
        sync_consumers();
        pending_dx = -1;
        timer.lap<Phase::combine_wait>();
      }
      combine(p, t, sched);
      timer.lap<Phase::combine>();
      continue;
    }
    const ExpertSetData& d = t.shared ? p.shared : p.routed;
    if (t.kind == kDh || t.kind == kDx) {
      const int row0 = tile_row0(p, t);
      bool fp8 = false;
      if constexpr (kFp8Dgrad<Q>) {
        fp8 = fp8_task<Q>(t);
        if (fp8)
          mainloop_fp8<kStages>(p, s, pipe, acc, (t.kind == kDh ? p.hidden : 2 * d.inter) / kFp8BlockK, wg, task,
                                fp8_scales(q, t));
      }
      if (t.kind == kDh) {
        if (!fp8) {
          mainloop<KMajor, MnMajor>(p, s, pipe, acc, p.hidden / kBlockK, wg, task);
        }
        timer.lap<Phase::mainloop_dh>();
        epilogue_dh<kFp8Dgrad<Q>>(p, s, acc, t, row0, wg, sched.n_dh(t.shared));
#ifndef MOK_DIAG_NO_DGU_QUANTIZE  // (timing only: without it the dx tiles read stale E4M3 rows)
        if constexpr (kFp8Dgrad<Q>)
          if (fp8) quantize_dgu_rows(q, t, row0, wg);
#endif
        if (reads_ring<Sched>(t)) free_ring_rows(p, t, wg);  // (after the epilogue: acc's registers are free)
        fence_proxy_async_global();  // TMA loads of other CTAs read these rows next
        publish_count(p.counters.dgu_ready + dgu_counter(p, t, t.m), 1, wg);
        timer.lap<Phase::epilogue_dh>();
      } else {
        if (!fp8) {
          mainloop<KMajor, MnMajor>(p, s, pipe, acc, 2 * d.inter / kBlockK, wg, task);
        }
        timer.lap<Phase::mainloop_dx>();
        const ExpertSetMaps& maps = t.shared ? p.shared_maps : p.routed_maps;
        const bool push = p.ep.push && !t.shared;
        if (push) push_dx_rows(p, s, acc, wg, t.n * kBlockN, row0 + wg * 64);
        else {  // (the routed dx rows: the column block's columns from col_begin on)
          const int c0 = t.shared ? 0 : col_begin(p);
          store_tile_tma<kFp8Dgrad<Q>>(s, acc, wg, &maps.dx_rows, t.n * kBlockN - c0, row0 + wg * 64, 0, 1 << 30,
                                       p.hidden - c0, false);
        }
        ++pending_dx;
        timer.lap<Phase::epilogue_dx>();
      }
    } else {
      int first = 0, count = 0;
      expert_rows(p, t, first, count);
      mainloop<MnMajor, MnMajor>(p, s, pipe, acc, weight_k_steps(count), wg, task);
      timer.lap<Phase::mainloop_wgrad>();
      epilogue_weight<kFp8Dgrad<Q>>(p, s, acc, t, wg, count == 0);
      if (threadIdx.x % 128 == 0 && read_counter(p, t) != nullptr && (count > 0 || t.kind == kWd))  // (an expert without
        ++s.reads[wg].count;                                                             //  rows has no dx tiles)
      if (reads_ring<Sched>(t)) free_ring_rows(p, t, wg);
      timer.lap<Phase::epilogue_wgrad>();
    }
  }
  switch_read(s.reads[wg], nullptr);
  if (pending_dx >= 0) {  // (no combine task here)
    publish_dx_rows(p, wg, pending_dx);
    if (p.ep.push) publish_pushes(p, s, sched, wg, sched.total);
  }
  if (threadIdx.x % 128 == 0) tma_store_wait_all();  // weight-gradient stores complete before exit
  timer.lap<Phase::other>();
}

// Bad routing or saved tensor: no task runs; dx and d_topk_weights become NaN and the host
// reports `code`.
__device__ void poison_output(const BackwardParams& p, KernelStatus::Code code, int cta, int ctas) {
  const std::int64_t n = static_cast<std::int64_t>(p.tokens) * p.hidden, nk = static_cast<std::int64_t>(p.tokens) * p.top_k;
  const std::int64_t stride = static_cast<std::int64_t>(ctas) * blockDim.x;
  for (std::int64_t i = cta * blockDim.x + threadIdx.x; i < n; i += stride) p.dx[i] = 0x7fc0;
  for (std::int64_t i = cta * blockDim.x + threadIdx.x; i < nk; i += stride) p.d_topk_weights[i] = __int_as_float(0x7fc00000);
  if (cta == 0 && threadIdx.x == 0) {
    p.status->code = code;
    __threadfence_system();
  }
}

// Comm CTA `comm` of `comms`: its kCommWarps warps pull the plan's dy and x rows into the
// rings (see RingPull). A minibatch's slots are free again once every task that reads its
// rows is done: 2 warpgroups x (its M-tiles' dh tiles + the weight-gradient tiles of every
// expert with rows in it).
__device__ void bwd_run_comm(const BackwardParams& p, const RingSources& sources, SharedStorage& s, int comm, int comms) {
  init_comm(s.comm);
  const int warp = threadIdx.x / 32;
  if (warp >= kCommWarps) return;
  const RingPull<2> pull{{{p.ring.dy_buffer, sources.dy}, {p.ring.x_buffer, sources.x}}, p.plan.row_pair,
                         p.plan.expert_offset[p.num_local_experts], p.hidden, p.tokens, p.top_k, p.ring};
  const Schedule<true> sched(p, 0, 1);  // (for its tile counts)
  CommPipe pipe = comm_pipe(s.stages, s.comm, warp);
  const auto expected_freed = [&](int mb) {
    const int begin = mb * p.ring.minibatch_rows, end = begin + pull.rows_of(mb);
    int tasks = sched.n_dh_r * (end - begin) / kBlockM;
    for (int e = 0; e < p.num_local_experts; ++e) {
      const int lo = p.plan.expert_offset[e], hi = p.plan.expert_offset[e + 1];
      if (lo < hi && lo < end && hi > begin) tasks += sched.weight_tasks();
    }
    return kConsumerWarpgroups * tasks;
  };
  pull.run(p, pipe, comm * kCommWarps + warp, comms * kCommWarps, expected_freed, WaitSite::backward_freed, WaitSite::backward_copy);
}

// The backward as a policy of the persistent skeleton (kernels/common/skeleton.cuh): one rank's
// backward on CTAs cta = 0 .. ctas - 1 of those serving it.
// Q: BackwardParams, or Fp8BackwardParams (the FP8 dgrad: one GPU or an EpRank, no ring). kRoutedWeights
// false (Fp8BackwardParams::routed_weights; a kernel of its own, so that the default one's code
// is as it was): no routed weight-gradient task.
template <bool kRing, typename Q = BackwardParams, bool kRoutedWeights = true>
struct BackwardKernel {
  using Storage = SharedStorage;
  // The producer's dy loads are 3-D (two regions: BackwardParams::dy_split): at 40 registers
  // it spilled, so the BF16 backward takes the FP8 forward's split. The FP8 dgrad kernel's
  // consumers need 232 (at 224 they spilled 146 bytes): its producer has the 40 left, spill-free
  // since its state across tasks is in shared memory and the waits' clock is 32 bits.
  static constexpr int kProducerRegs = kFp8Dgrad<Q> ? 40 : 56, kConsumerRegs = kFp8Dgrad<Q> ? 232 : 224;
  static constexpr int kStageReaders = kConsumerWarpgroups;  // both warpgroups read every stage
  using P = Q;
  static_assert(!kRing || !kFp8Dgrad<Q>, "the FP8 dgrad runs without the ring");

  __device__ static bool stalled(const P& q) { return base_of(q).ep.stalled; }
  __device__ static bool inputs_valid(const P& q, int cta, int ctas) {
    const BackwardParams& p = base_of(q);
    if (!all_plans_ok(p, true)) {
      poison_output(p, KernelStatus::bad_plan, cta, ctas);
      return false;
    }
    // Never filled by a forward, or consumed by an earlier backward. EP: on any rank, or
    // a rank that stops here would leave its peers waiting for its pushes.
    bool saved_ok = *p.saved_marker == kSavedValid;
    if (p.ep.push && p.ep.header == nullptr)  // (separate launches: checked through the plan flags above)
      for (int q = 0; q < p.ep.size; ++q) saved_ok = saved_ok && *p.ep.saved_marker[q] == kSavedValid;
    if (!saved_ok) {
      poison_output(p, KernelStatus::saved_not_valid, cta, ctas);
      return false;
    }
    return true;
  }
  __device__ static void init_shared(const P& q, Storage& s, int cta) {
    if (threadIdx.x < kConsumerWarpgroups) s.reads[threadIdx.x] = {nullptr, 0};
    if constexpr (kFp8Dgrad<Q>) {
      if (threadIdx.x == 0) s.schedule = schedule(q, cta, static_cast<int>(gridDim.x));
      if (threadIdx.x == 32)
        for (const CUtensorMap* map : {&q.maps.dy, &q.maps.down_t, &q.maps.dgu, &q.maps.gate_up_t}) tma_prefetch_descriptor(map);
    }
  }
  __device__ static bool is_comm(const P& q, int cta) { return kRing && cta < base_of(q).ring.comm_ctas; }
  __device__ static void run_comm(const P& q, const RingSources& sources, Storage& s, int cta) {
    if constexpr (!kFp8Dgrad<Q>) bwd_run_comm(q, sources, s, cta, q.ring.comm_ctas);
  }
  __device__ static Schedule<kRing> schedule(const P& q, int cta, int ctas) {
    const BackwardParams& p = base_of(q);
    return Schedule<kRing>(p, cta - p.ring.comm_ctas, ctas - p.ring.comm_ctas, kRoutedWeights);
  }
  __device__ static void produce(const P& p, Storage& s, const Schedule<kRing>& sched) {
    if constexpr (kFp8Dgrad<Q>) run_producer(p, s, s.schedule);
    else run_producer(p, s, sched);
  }
  __device__ static void consume(const P& p, Storage& s, const Schedule<kRing>& sched, int wg) {
    if constexpr (kFp8Dgrad<Q>) run_consumer(p, s, s.schedule, wg);
    else run_consumer(p, s, sched, wg);
  }
};

template <bool kRing>
__device__ __forceinline__ void run_backward(const BackwardParams& p, const RingSources& sources, int cta, int ctas) {
  run_persistent<BackwardKernel<kRing>>(p, cta, ctas, sources);
}

template <bool kRoutedWeights>
__global__ void __launch_bounds__(kThreads, 1) backward_fp8_kernel(const __grid_constant__ Fp8BackwardParams q) {
  run_persistent<BackwardKernel<false, Fp8BackwardParams, kRoutedWeights>>(q, blockIdx.x, gridDim.x, RingSources{});
}

struct BackwardLaunch {  // the plain kernel's parameters
  BackwardParams rank;
  RingSources sources;
};

template <bool kRing>
__global__ void __launch_bounds__(kThreads, 1) backward_kernel(const __grid_constant__ BackwardLaunch l) {
  run_backward<kRing>(l.rank, l.sources, blockIdx.x, gridDim.x);
}

template <bool kRing>
__global__ void __launch_bounds__(kThreads, 1) backward_group_kernel(const __grid_constant__ BackwardGroupParams g) {
  run_backward<kRing>(g.rank[blockIdx.x / g.ctas_per_rank], g.sources, blockIdx.x % g.ctas_per_rank, g.ctas_per_rank);
}

}  // namespace

std::size_t backward_shared_memory_bytes() { return shared_storage_bytes<SharedStorage>(); }

void launch_backward(const BackwardParams& params, int num_ctas, cudaStream_t stream, const RingSources& sources) {
  const BackwardLaunch launch{params, sources};
  if (params.ring.comm_ctas > 0) launch_persistent<backward_kernel<true>>(backward_shared_memory_bytes(), kThreads, launch, num_ctas, stream);
  else launch_persistent<backward_kernel<false>>(backward_shared_memory_bytes(), kThreads, launch, num_ctas, stream);
}

void launch_backward_fp8(const Fp8BackwardParams& params, int num_ctas, cudaStream_t stream) {
  if (params.routed_weights)
    launch_persistent<backward_fp8_kernel<true>>(backward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
  else
    launch_persistent<backward_fp8_kernel<false>>(backward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
}

void load_backward_kernels() {
  configure_persistent<backward_kernel<false>>(backward_shared_memory_bytes());
  configure_persistent<backward_kernel<true>>(backward_shared_memory_bytes());
  configure_persistent<backward_group_kernel<false>>(backward_shared_memory_bytes());
  configure_persistent<backward_group_kernel<true>>(backward_shared_memory_bytes());
  configure_persistent<backward_fp8_kernel<true>>(backward_shared_memory_bytes());
  configure_persistent<backward_fp8_kernel<false>>(backward_shared_memory_bytes());
}

// (Every rank of a group has the same ring configuration.)
void launch_backward_group(const BackwardGroupParams& params, cudaStream_t stream) {
  const int ctas = params.ranks * params.ctas_per_rank;
  if (params.rank[0].ring.comm_ctas > 0)
    launch_persistent<backward_group_kernel<true>>(backward_shared_memory_bytes(), kThreads, params, ctas, stream);
  else launch_persistent<backward_group_kernel<false>>(backward_shared_memory_bytes(), kThreads, params, ctas, stream);
}

}  // namespace mok::kernels
