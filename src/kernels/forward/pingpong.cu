// Fused MoE forward, one GPU, with ping-pong consumers (Config::pingpong): the cooperative
// forward's plan, task order, waits, counters and combine (kernels/forward/forward.cu), with
// the two consumer warpgroups taking alternate tasks instead of sharing each one, so that one
// warpgroup's epilogue runs under the other's MMAs.
//
//   tasks: 128 rows x 128 columns, a whole task per warpgroup (two wgmma m64n128k16 a K step
//       into its 128 accumulators: rows 0-63, then 64-127). GEMM1 = 64 gate + 64 up columns
//       (64 h columns a task, so twice the cooperative kernel's N-tiles); GEMM2 = 128 columns
//       of H. h_ready[m] and y_done count whole tasks (the cooperative kernel: warpgroup
//       halves); for I and H multiples of 128 the expected counts are the same numbers.
//   producer (thread 0 of warpgroup 0): the CTA's tasks in list order into a 6-stage ring of
//       {A 128 x 64, B 128 x 64} (32 KB); each stage is read by one warpgroup, so its empty
//       barrier expects one arrival.
//   consumer warpgroup w: the CTA's tasks j = w, w + 2, ... of its list; it skips the stages of
//       the other's tasks (both decode the same list). The mainloops take turns: a warpgroup
//       starts task j's only once every stage of task j - 1 (the other's) has landed and been
//       waited for (a turn barrier each, one arrival a mainloop). That also keeps the parity
//       waits exact: skipping more than a lap of stages, a warpgroup would otherwise take a full
//       barrier's phase of two laps ago for this one. Task j's first stages are loaded by then,
//       so its MMAs queue behind task j - 1's last ones, and each epilogue runs beside the other
//       warpgroup's mainloop.
//   publication: a GEMM1 task's h store is completed and published (h_ready) at the top of the
//       warpgroup's next task, before it waits for anything: the CTA's producer may be waiting
//       for those rows on behalf of the other warpgroup's GEMM2 task. GEMM2 tiles are counted in
//       y_done before the warpgroup's first combine task (or at its end).
//   combine: a warpgroup takes a whole combine task (the cooperative kernel splits one over both).
//
// Not for expert parallelism or the ring (the host keeps those on the cooperative kernel).
// Each output element is the same K-ordered sum as the cooperative kernel's (tests compare
// the bits); no floating-point atomics; results do not depend on the grid size.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/common/skeleton.cuh"
#include "kernels/common/swiglu.cuh"
#include "kernels/forward/epilogues.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/forward/producer.cuh"
#include "kernels/forward/tasks.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels {
namespace {

using namespace mok::ptx;
using namespace fwd;

constexpr int kPpBlockN = 128;       // a task's columns: GEMM1 64 gate + 64 up, GEMM2 128 of H
constexpr int kPpGemm1Columns = 64;  // h columns of a GEMM1 task
constexpr int kPpStages = 6;
using PingPongSchedule = TaskSchedule<kPpGemm1Columns, kPpBlockN, 1>;  // one part a task

struct alignas(1024) PingPongStorage {
  struct alignas(1024) Stage {
    std::uint16_t a[kBlockM * kBlockK];    // 16 KB: 128 rows of x (or h)
    std::uint16_t b[kPpBlockN * kBlockK];  // 16 KB: GEMM1 64 gate rows, then 64 up rows; GEMM2 128 rows of w_down
  } stages[kPpStages];
  std::uint16_t staging[kConsumerWarpgroups][2][64 * 64];  // per warpgroup: two swizzled 64 x 128-byte panels
  PipelineBarriers<kPpStages> barriers;
  std::uint64_t turn[kConsumerWarpgroups];  // turn[w]: the other warpgroup finished a mainloop
  PushedRows pushed[kConsumerWarpgroups];  // (zeroed by the skeleton; no pushes here)
};
static_assert(shared_storage_bytes<PingPongStorage>() <= kMaxSharedMemoryBytes, "shared memory over the sm_90 opt-in limit");
static_assert(sizeof(PingPongStorage::Stage) % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
constexpr std::uint32_t kPpStageBytes = sizeof(PingPongStorage::Stage);
// The host's boxes for this kernel (src/host/forward.cpp): A one K-major box (kBoxK); B one
// kBoxK of w_down, or one kBoxMN of w_gate and one of w_up; h leaves in kBoxMN boxes.
static_assert(kBoxK.rows == kBlockM && kBoxK.rows == kPpBlockN && kBoxMN.rows == kPpGemm1Columns);
static_assert(kPpStageBytes == 2 * kBoxK.bytes(2) && kBoxK.bytes(2) == 2 * kBoxMN.bytes(2));

__device__ __forceinline__ int k_steps_of(const ForwardParams& p, const Task& t) {  // (combine tasks load nothing)
  return t.kind == kCombine ? 0 : gemm_k_steps(p, t);
}

// ---------------------------------------------------------------------------------- producer

__device__ void pp_produce(const ForwardParams& p, PingPongStorage& s, const PingPongSchedule& sched) {
  Pipeline<kPpStages> pipe;
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind == kCombine) break;  // combine tasks come last and load nothing
    const int expert = task_expert(p, t), row0 = task_row0(p, t);
    const bool gemm1 = t.kind == kGemm1;
    if (!gemm1) wait_hidden_rows(p, sched, t, task);  // (GEMM1's rows were copied before the launch: no ring)
    const ForwardMaps& m = p.maps;
    const CUtensorMap* a = gemm1 ? (t.shared ? &m.x : &m.x_routed) : (t.shared ? &m.shared_h_load : &m.h_load);
    const CUtensorMap* b = gemm1 ? (t.shared ? &m.shared_gate : &m.gate) : (t.shared ? &m.shared_down : &m.down);
    const CUtensorMap* up = t.shared ? &m.shared_up : &m.up;
    const int b_row = t.n * (gemm1 ? kPpGemm1Columns : kPpBlockN), k_steps = k_steps_of(p, t);
    for (int kb = 0; kb < k_steps; ++kb) {
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, kPpStageBytes);
      PingPongStorage::Stage& stage = s.stages[pipe.stage()];
      tma_load_2d(stage.a, a, full, kb * kBlockK, row0);
      tma_load_3d(stage.b, b, full, kb * kBlockK, b_row, expert);
      if (gemm1) tma_load_3d(stage.b + kPpGemm1Columns * kBlockK, up, full, kb * kBlockK, b_row, expert);
      pipe.producer_commit();
    }
  }
}

// --------------------------------------------------------------------------------- consumers

// This warpgroup's 128 x 128 tile over k_steps stages: acc[r] holds rows 64 r .. 64 r + 63
// (the m64n128 layout of acc_row / acc_col). Each stage goes back once its MMAs are done. Once
// its last stage has landed, the other warpgroup's turn begins (`next_turn`): its MMAs queue
// behind this one's last ones instead of waiting for them to drain.
__device__ __forceinline__ void pp_mainloop(const ForwardParams& p, PingPongStorage& s, Pipeline<kPpStages>& pipe,
                                            float (&acc)[2][64], int k_steps, int task, std::uint64_t* next_turn) {
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[0][i] = acc[1][i] = 0.0f;  // (why: mainloop() in persistent.cuh)
  const bool leader = threadIdx.x % 128 == 0;
  int previous = -1;
  for (int kb = 0; kb < k_steps; ++kb) {
    const int index = pipe.consumer_wait(p, s.barriers, task);
    if (kb == k_steps - 1 && leader) mbarrier_arrive(next_turn);  // every fill of this task has landed
    const PingPongStorage::Stage& stage = s.stages[index];
    const std::uint64_t a0 = KMajor::descriptor(stage.a), a1 = KMajor::descriptor(stage.a + 64 * kBlockK);
    const std::uint64_t b = KMajor::descriptor(stage.b);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      wgmma_m64n128k16_bf16(acc[0], a0 + KMajor::kDescStep * kk, b + KMajor::kDescStep * kk, (kb | kk) != 0);
      wgmma_m64n128k16_bf16(acc[1], a1 + KMajor::kDescStep * kk, b + KMajor::kDescStep * kk, (kb | kk) != 0);
    }
    wgmma_commit_group();
    wgmma_wait_group<1>();  // the previous stage's MMAs are done: hand it back
    if (previous >= 0 && leader) pipe.consumer_release(s.barriers, previous);
    previous = index;
    pipe.consumer_advance();
  }
  if (k_steps == 0 && leader) mbarrier_arrive(next_turn);
  wgmma_wait_group<0>();
  if (previous >= 0 && leader) pipe.consumer_release(s.barriers, previous);
}

// Training: the gate and up pre-activations (bf16, clamped values as +-inf: save_pre_activations'
// contract) stored from the accumulators, 4 bytes of 8 rows a warp at a time.
__device__ inline void pp_save_pre_activations(const ForwardParams& p, const float (&acc)[2][64], const Task& t, int row0,
                                               std::uint16_t* gu) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int inter = t.shared ? p.shared_inter : p.inter, n0 = t.n * kPpGemm1Columns;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    std::uint16_t* rows = gu + static_cast<std::int64_t>(row0 + 64 * r) * 2 * inter;
#pragma unroll
    for (int i = 0; i < 32; i += 2) {  // gate column c is element i, up column c + 64 is element i + 32
      const int col = n0 + acc_col(lane, i);
      if (col >= inter) continue;
      std::uint16_t* row = rows + static_cast<std::int64_t>(acc_row(warp, lane, i)) * 2 * inter;
      *reinterpret_cast<std::uint32_t*>(row + col) =
          pack_bf16x2(saved_gate(acc[r][i], p.swiglu_limit), saved_gate(acc[r][i + 1], p.swiglu_limit));
      *reinterpret_cast<std::uint32_t*>(row + inter + col) =
          pack_bf16x2(saved_up(acc[r][i + 32], p.swiglu_limit), saved_up(acc[r][i + 33], p.swiglu_limit));
    }
  }
}

// h = swiglu(gate, up) of this warpgroup's 128 x 64 tile -> staging (one swizzled panel per 64
// rows) -> two TMA stores; published by publish_hidden() at the top of the warpgroup's next task.
__device__ void pp_epilogue_gemm1(const ForwardParams& p, PingPongStorage& s, const float (&acc)[2][64], const Task& t,
                                  int row0, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  std::uint16_t* gu = t.shared ? p.shared_saved_gu : p.saved_gu;
  if (gu) pp_save_pre_activations(p, acc, t, row0, gu);
  char* staging = reinterpret_cast<char*>(s.staging[wg]);
  if (tid == 0) tma_store_wait_read();  // the previous task's stores have read the staging
  sync_warpgroup(wg);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int row = acc_row(warp, lane, i), col = acc_col(lane, i);
      const float h0 = swiglu(acc[r][i], acc[r][i + 32], p.swiglu_limit);
      const float h1 = swiglu(acc[r][i + 1], acc[r][i + 33], p.swiglu_limit);
      *reinterpret_cast<std::uint32_t*>(staging + r * 64 * 128 + swizzled_offset(row, col)) = pack_bf16x2(h0, h1);
    }
  }
  fence_proxy_async_shared_cta();
  sync_warpgroup(wg);
  if (tid == 0) {
    const CUtensorMap* h = t.shared ? &p.maps.shared_h_store : &p.maps.h_store;
    tma_store_2d(h, s.staging[wg][0], t.n * kPpGemm1Columns, row0);
    tma_store_2d(h, s.staging[wg][1], t.n * kPpGemm1Columns, row0 + 64);
    tma_store_commit_group();
  }
}

// bf16 rows of this warpgroup's 128 x 128 tile into the slot buffer (published by
// publish_slots()): two rounds (64 rows x 128 columns) through the 16 KB staging (two
// swizzled 64-column panels), each as two TMA stores of 64 x 64.
__device__ void pp_epilogue_gemm2(const ForwardParams& p, PingPongStorage& s, const float (&acc)[2][64], const Task& t,
                                  int row0, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const CUtensorMap* map = t.shared ? &p.maps.shared_slots : &p.maps.slots;
  char* staging = reinterpret_cast<char*>(s.staging[wg]);
  const int n0 = t.n * kPpBlockN;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (tid == 0) tma_store_wait_read();
    sync_warpgroup(wg);
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      const int row = acc_row(warp, lane, i), col = acc_col(lane, i);  // 0..127: two panels
      *reinterpret_cast<std::uint32_t*>(staging + swizzled_offset(row, col)) = pack_bf16x2(acc[r][i], acc[r][i + 1]);
    }
    fence_proxy_async_shared_cta();
    sync_warpgroup(wg);
    if (tid == 0) {
      tma_store_2d(map, s.staging[wg][0], n0, row0 + 64 * r);
      if (n0 + 64 < p.hidden) tma_store_2d(map, s.staging[wg][1], n0 + 64, row0 + 64 * r);
      tma_store_commit_group();
    }
  }
}

// Before this warpgroup's first combine task: publishes its GEMM2 tiles, then waits until every
// GEMM2 tile of the launch has landed.
__device__ void pp_wait_for_slot_rows(const ForwardParams& p, const PingPongSchedule& sched, int wg, int& pending_slots, int task) {
  publish_slots(p, wg, pending_slots);
  if (threadIdx.x % 128 == 0) wait_counter(p, p.counters.y_done, sched.slot_tiles_total(), task, WaitSite::all_gemm2);
  sync_warpgroup(wg);
}

__device__ void pp_consume(const ForwardParams& p, PingPongStorage& s, const PingPongSchedule& sched, int wg) {
  Pipeline<kPpStages> pipe;
  float acc[2][64];
  std::uint32_t turn_phase = 0;  // of s.turn[wg]
  bool waits_turn = wg != 0;     // (warpgroup 0's first mainloop follows none)
  bool slots_ready = false;
  int pending_hidden = -1;  // h_ready index of a GEMM1 store not yet published
  int pending_slots = 0;    // GEMM2 tiles not yet counted in y_done
  for (int j = 0, task = sched.cta; task < sched.total; ++j, task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (j % kConsumerWarpgroups != wg) {  // the other warpgroup's task: step past its stages
      pipe.consumer_skip(k_steps_of(p, t));
      continue;
    }
    publish_hidden(p, pending_hidden);  // before any wait (see the header)
    if (t.kind == kCombine) {
      if (!slots_ready) {
        pp_wait_for_slot_rows(p, sched, wg, pending_slots, task);
        slots_ready = true;
      }
      combine(p, t, threadIdx.x % 128, 128);  // (this warpgroup alone)
      continue;
    }
    const int row0 = task_row0(p, t);
    if (waits_turn) {  // task j - 1's mainloop (the other warpgroup's) is done
      wait_barrier(p, &s.turn[wg], turn_phase, task, WaitSite::mainloop_turn);
      turn_phase ^= 1u;
    }
    waits_turn = true;
    pp_mainloop(p, s, pipe, acc, k_steps_of(p, t), task, &s.turn[wg ^ 1]);
    if (t.kind == kGemm1) {
      pp_epilogue_gemm1(p, s, acc, t, row0, wg);
      pending_hidden = t.shared ? p.max_routed_tiles + t.m : t.m;
    } else {
      pp_epilogue_gemm2(p, s, acc, t, row0, wg);
      ++pending_slots;
    }
  }
  publish_hidden(p, pending_hidden);
  publish_slots(p, wg, pending_slots);
}

// The ping-pong forward as a policy of the persistent skeleton (kernels/common/skeleton.cuh).
struct PingPongForwardKernel {
  using Storage = PingPongStorage;
  static constexpr int kProducerRegs = kProducerRegisters, kConsumerRegs = kConsumerRegisters;
  static constexpr int kStageReaders = 1;  // each stage belongs to one warpgroup's task
  using P = ForwardParams;

  __device__ static bool stalled(const P&) { return false; }
  __device__ static bool inputs_valid(const P& p, int cta, int ctas) {
    if (all_plans_ok(p, false)) return true;
    poison_output(p, cta, ctas);
    return false;
  }
  __device__ static void init_shared(const P& p, Storage& s, int cta) {
    if (threadIdx.x == 0) {  // (the skeleton's __syncthreads follows)
      for (std::uint64_t& turn : s.turn) mbarrier_init(&turn, 1);
      fence_proxy_async_shared_cta();
    }
    if (threadIdx.x == 32) {
      const ForwardMaps& m = p.maps;
      for (const CUtensorMap* map : {&m.x_routed, &m.gate, &m.up, &m.down, &m.h_load, &m.h_store}) tma_prefetch_descriptor(map);
    }
    if (p.saved_marker && cta == 0 && threadIdx.x == 0) *p.saved_marker = kSavedValid;
  }
  __device__ static bool is_comm(const P&, int) { return false; }
  __device__ static void run_comm(const P&, Storage&, int) {}
  __device__ static PingPongSchedule schedule(const P& p, int cta, int ctas) { return PingPongSchedule(p, cta, ctas); }
  __device__ static void produce(const P& p, Storage& s, const PingPongSchedule& sched) { pp_produce(p, s, sched); }
  __device__ static void consume(const P& p, Storage& s, const PingPongSchedule& sched, int wg) { pp_consume(p, s, sched, wg); }
};

__global__ void __launch_bounds__(kThreads, 1) forward_pingpong_kernel(const __grid_constant__ ForwardParams p) {
  run_persistent<PingPongForwardKernel>(p, blockIdx.x, gridDim.x);
}

}  // namespace

void launch_forward_pingpong(const ForwardParams& params, int num_ctas, cudaStream_t stream) {
  launch_persistent<forward_pingpong_kernel>(shared_storage_bytes<PingPongStorage>(), kThreads, params, num_ctas, stream);
}

}  // namespace mok::kernels
