// Fused MoE forward with the routed experts in FP8 (E4M3, DeepSeek-V3's recipe with
// power-of-two scales), one GPU: the BF16 forward's CTA, pipeline, schedule and combine
// (src/kernels/forward/forward.cu), with the routed GEMMs replaced.
//
//   before the kernel: the routed x rows are gathered and quantized per 1 x 128 block of a row
//       (launch_quantize_rows: E4M3 rows in plan order, one fp32 power-of-two scale a block)
//   producer: a routed stage is {A 128 rows x 128 K, B 128 rows x 128 K} of E4M3 (32 KB of the
//       BF16 kernel's 48 KB stage); the shared expert's tasks load the BF16 kernel's stages.
//   routed GEMM1 task (128 h columns): two passes over K, each of B = 64 gate rows + 64 up
//       rows of the expert (wgmma m64n128k32 e4m3). A stage's 128 K is one scale block of
//       both operands, so its four MMAs sum into a block accumulator that is then promoted
//       into the fp32 total: total += block * a_scale(row) * b_scale(gate or up block) (the
//       recipe's promotion every 128 K; a power-of-two scale product is exact). Pass 0's
//       SwiGLU output (64 columns) waits in shared memory while pass 1 runs; then each row's
//       largest |h| over the 128 columns gives its scale, h goes out as E4M3 (TMA store) and
//       the scale as fp32 into h_scales, published through h_ready as in the BF16 kernel.
//   routed GEMM2 task (128 columns of H): B = 128 rows of w_down, promoted the same way with
//       h's row scales; the fp32 tile goes to the slot buffer as in the BF16 kernel.
//   The shared expert's GEMMs, the combine and every wait are the BF16 kernel's. Training
//   (Training::save): each pass also saves its gate/up pre-activations as the BF16 kernel
//   does, so the BF16 backward runs on the FP8 forward's activations.
//
// A task only waits on lower-numbered tasks and every CTA is resident: no deadlock. The bits
// do not depend on the grid: each tile's sums run in a fixed order in one warpgroup.
#include "kernels/forward/forward_fp8.cuh"

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/common/skeleton.cuh"
#include "kernels/common/swiglu.cuh"
#include "kernels/forward/epilogues.cuh"
#include "kernels/forward/producer.cuh"
#include "kernels/forward/tasks.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels {
namespace {

using namespace mok::ptx;
using namespace fwd;

constexpr std::uint32_t kFp8TileBytes = kBlockM * kFp8BlockK;  // 16 KB: A, or B, of one stage
static_assert(kFp8TileBytes == sizeof(SharedStorage::Stage::a) && kFp8TileBytes <= sizeof(SharedStorage::Stage::b));
static_assert(kBoxFp8.bytes(1) == kFp8TileBytes && 2 * kBoxFp8Half.bytes(1) == kFp8TileBytes);
static_assert(kBoxFp8.cols == kFp8BlockK && kBoxFp8Half.rows == kFp8BlockN / 2 && kFp8BlockN == kGemm1Columns);
static_assert(sizeof(SharedStorage::h_staging[0]) >= 64 * kFp8BlockK, "a warpgroup's E4M3 h tile fits its staging");

// ---------------------------------------------------------------------------------- producer

__device__ void run_producer_fp8(const Fp8ForwardParams& q, SharedStorage& s, const Schedule& sched) {
  const ForwardParams& p = q.base;
  Pipeline<kStages> pipe;
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind == kCombine) break;  // combine tasks come last and load nothing
    if (t.shared) {                 // BF16, as the BF16 kernel loads it
      load_task(p, s, pipe, sched, t, task);
      continue;
    }
    const int expert = p.plan.tile_expert[t.m], row0 = p.plan.tile_row[t.m];
    const bool gemm1 = t.kind == kGemm1;
    if (!gemm1) {
      wait_counter(p, p.counters.h_ready + t.m, kConsumerWarpgroups * sched.n1_routed, task, WaitSite::hidden_ready);
      fence_proxy_async_global();  // the h rows were written by other CTAs' TMA stores
    }
    // GEMM1: two passes over K (B: 64 gate + 64 up rows each); GEMM2: one (B: 128 w_down rows).
    const int k_steps = (gemm1 ? p.hidden : p.inter) / kFp8BlockK;
    for (int step = 0; step < (gemm1 ? 2 * k_steps : k_steps); ++step) {
      const bool second = step >= k_steps;
      const int k = (second ? step - k_steps : step) * kFp8BlockK;
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, 2 * kFp8TileBytes);
      SharedStorage::Stage& stage = s.stages[pipe.stage()];
      tma_load_2d(stage.a, gemm1 ? &q.maps.x : &q.maps.h_load, full, k, row0);
      if (gemm1) {
        const int b_row = t.n * kGemm1Columns + (second ? kFp8BlockN / 2 : 0);
        tma_load_3d(stage.b, &q.maps.gate, full, k, b_row, expert);
        tma_load_3d(stage.b + kFp8TileBytes / 4, &q.maps.up, full, k, b_row, expert);  // (bf16-typed: 8 KB on)
      } else {
        tma_load_3d(stage.b, &q.maps.down, full, k, t.n * kFp8BlockN, expert);
      }
      pipe.producer_commit();
    }
  }
}

// --------------------------------------------------------------------------------- consumers

// The scales of one pass: A's per row and 128 K ([K / 128, capacity], this warpgroup's rows
// from a_rows), B's per 128 x 128 block (exponents, one a K block: b_lo for accumulator
// columns 0-63, b_hi for 64-127; the same pointer when the tile is one block wide).
struct PassScales {
  const float* a_rows;
  std::int64_t a_stride;
  const std::int32_t *b_lo, *b_hi;
};

// One pass of a routed GEMM over k_steps stages: total = sum over K blocks kb of
// (A_kb B_kb^T) * a_scale(row, kb) * b_scale(column half, kb), each block's four MMAs summed
// by the tensor cores into acc[64, 128), then promoted in fp32 in ascending kb into the total,
// acc[0, 64). (One array of 128 for both, the size the shared expert's BF16 MMAs use: two
// arrays beside the BF16 one spilled.)
__device__ __forceinline__ void mainloop_fp8(const ForwardParams& p, SharedStorage& s, Pipeline<kStages>& pipe,
                                             float (&acc)[128], int k_steps, int wg, int task, const PassScales& sc) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const float* a_rows = sc.a_rows + warp * 16 + lane / 4;  // this thread's rows r and r + 8
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  // The scales of block kb, loaded one block ahead (an L2 load's latency is longer than the
  // block's MMAs). A's are read only after the pass's first stage has landed: GEMM2's h
  // scales are published with the h rows its producer waited for before that stage's loads
  // (all of the tile's K blocks at once).
  float a_lo = 0.0f, a_hi = 0.0f;
  int e_lo = __ldg(sc.b_lo), e_hi = __ldg(sc.b_hi);  // (weights: constant during the kernel)
  for (int kb = 0; kb < k_steps; ++kb) {
    const int stage_index = pipe.consumer_wait(p, s.barriers, task);
    if (kb == 0) a_lo = __ldcg(a_rows), a_hi = __ldcg(a_rows + 8);
    float next_a_lo = 0.0f, next_a_hi = 0.0f;
    int next_e_lo = 0, next_e_hi = 0;
    if (kb + 1 < k_steps) {
      next_a_lo = __ldcg(a_rows + (kb + 1) * sc.a_stride), next_a_hi = __ldcg(a_rows + (kb + 1) * sc.a_stride + 8);
      next_e_lo = __ldg(sc.b_lo + kb + 1), next_e_hi = __ldg(sc.b_hi + kb + 1);
    }
    const auto& stage = s.stages[stage_index];
    const std::uint64_t desc_a = KMajor::descriptor(reinterpret_cast<const char*>(stage.a) + wg * 64 * kFp8BlockK);
    const std::uint64_t desc_b = KMajor::descriptor(stage.b);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kFp8BlockK / 32; ++kk)
      wgmma_m64n128k32_e4m3<64>(acc, desc_a + KMajor::kDescStep * kk, desc_b + KMajor::kDescStep * kk, kk != 0);
    wgmma_commit_group();
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 64; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // no read of the block before the wait
    if (tid == 0) pipe.consumer_release(s.barriers, stage_index);
    pipe.consumer_advance();
    const float b_lo = ldexpf(1.0f, e_lo), b_hi = ldexpf(1.0f, e_hi);
    const float scale[4] = {a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi};  // exact: powers of two
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = __fmaf_rn(acc[64 + i], scale[(i >= 32 ? 2 : 0) + ((i >> 1) & 1)], acc[i]);
    a_lo = next_a_lo, a_hi = next_a_hi, e_lo = next_e_lo, e_hi = next_e_hi;
  }
}

// SwiGLU of one GEMM1 pass in place: gate in acc[0, 32), up in acc[32, 64) (B's rows 0-63
// and 64-127); h of accumulator column acc_col(lane, i) of the pass's 64 lands in acc[i].
// (Everything stays in the one accumulator array: more arrays beside it spilled.)
__device__ __forceinline__ void swiglu_pass(float (&acc)[128], float limit) {
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = swiglu(acc[i], acc[i + 32], limit);
}

// Training: one pass's gate and up pre-activations (acc[0, 32) and acc[32, 64): 64 columns of
// each from column n0) into the saved rows [gate (I) | up (I)], bf16, as the BF16 kernel saves
// them (a clamped value as +-inf): the BF16 backward reads them.
__device__ __forceinline__ void save_pass_pre_activations(const ForwardParams& p, const float (&acc)[128], int n0,
                                                          int rows) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const std::int64_t stride = 2 * static_cast<std::int64_t>(p.inter);
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    std::uint16_t* row = p.saved_gu + (rows + acc_row(warp, lane, i)) * stride + n0 + acc_col(lane, i);
    *reinterpret_cast<std::uint32_t*>(row) =
        pack_bf16x2(saved_gate(acc[i], p.swiglu_limit), saved_gate(acc[i + 1], p.swiglu_limit));
    *reinterpret_cast<std::uint32_t*>(row + p.inter) =
        pack_bf16x2(saved_up(acc[i + 32], p.swiglu_limit), saved_up(acc[i + 33], p.swiglu_limit));
  }
}

// Pass 0's h waits in the warpgroup's staging buffer while pass 1 runs (fp32, each thread's
// 32 values at 4-byte words tid, tid + 128, ...: it reads back only its own). First every
// earlier TMA store must have read the staging.
__device__ __forceinline__ void keep_first_pass(SharedStorage& s, float (&acc)[128], int wg, float limit) {
  const int tid = threadIdx.x % 128;
  if (tid == 0) tma_store_wait_read();
  sync_warpgroup(wg);
  swiglu_pass(acc, limit);
  float* kept = reinterpret_cast<float*>(s.h_staging[wg]) + tid;
#pragma unroll
  for (int i = 0; i < 32; ++i) kept[128 * i] = acc[i];
}

// h of this warpgroup's 64 rows x 128 columns (pass 0's kept in the staging, pass 1's in acc)
// as E4M3 with one power-of-two scale a row (its 128 columns are one block): the row's
// largest |h| is a max over the thread's values and its quad's (any order gives the same),
// the values go through the swizzled staging to one TMA store, the scales to h_scales;
// published by publish_hidden() one task later, as in the BF16 kernel.
__device__ void epilogue_gemm1_fp8(const Fp8ForwardParams& q, SharedStorage& s, float (&acc)[128], const Task& t,
                                   int row0, int wg, int& pending_index) {
  const ForwardParams& p = q.base;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  swiglu_pass(acc, p.swiglu_limit);  // pass 1's h: acc[0, 32)
  const float* kept = reinterpret_cast<const float*>(s.h_staging[wg]) + tid;
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[32 + i] = kept[128 * i];  // pass 0's h: acc[32, 64)
  float amax[2] = {0.0f, 0.0f};  // rows r (accumulators with ((i >> 1) & 1) == 0) and r + 8
#pragma unroll
  for (int i = 0; i < 32; ++i) amax[(i >> 1) & 1] = fmaxf(amax[(i >> 1) & 1], fmaxf(fabsf(acc[i]), fabsf(acc[32 + i])));
#pragma unroll
  for (int half = 0; half < 2; ++half)
    for (int offset = 1; offset < 4; offset *= 2)
      amax[half] = fmaxf(amax[half], __shfl_xor_sync(0xffffffffu, amax[half], offset));
  const int exponent[2] = {fp8_scale_exponent(amax[0]), fp8_scale_exponent(amax[1])};
  publish_hidden(p, pending_index);  // (the previous h store: its staging reads were waited for already)
  sync_warpgroup(wg);                // every thread has read its kept values
  char* staging = reinterpret_cast<char*>(s.h_staging[wg]);
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int row = acc_row(warp, lane, i), col = acc_col(lane, i), e = exponent[(i >> 1) & 1];
    *reinterpret_cast<std::uint16_t*>(staging + swizzled_offset_bytes(row, col)) =
        pack_e4m3x2(ldexpf(acc[32 + i], -e), ldexpf(acc[33 + i], -e));
    *reinterpret_cast<std::uint16_t*>(staging + swizzled_offset_bytes(row, 64 + col)) =
        pack_e4m3x2(ldexpf(acc[i], -e), ldexpf(acc[i + 1], -e));
  }
  if (lane % 4 == 0) {
    float* scales = q.h_scales + t.n * q.capacity + row0 + wg * 64 + warp * 16 + lane / 4;
    scales[0] = ldexpf(1.0f, exponent[0]);
    scales[8] = ldexpf(1.0f, exponent[1]);
  }
  fence_proxy_async_shared_cta();
  sync_warpgroup(wg);  // (also orders every thread's scale stores before the publishing release)
  if (tid == 0) {
    tma_store_2d(&q.maps.h_store, s.h_staging[wg], t.n * kGemm1Columns, row0 + wg * 64);
    tma_store_commit_group();
  }
  pending_index = t.m;
}

__device__ void run_consumer_fp8(const Fp8ForwardParams& q, SharedStorage& s, const Schedule& sched, int wg) {
  const ForwardParams& p = q.base;
  Pipeline<kStages> pipe;
  bool slots_ready = false;
  int pending_hidden = -1;  // h_ready index of a GEMM1 store not yet published
  int pending_slots = 0;    // GEMM2 tiles not yet counted in y_done
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind != kGemm1) publish_hidden(p, pending_hidden);  // (this CTA's own GEMM2 loads may need it)
    if (t.kind == kCombine) {
      if (!slots_ready) {
        publish_slots(p, wg, pending_slots);
        if (threadIdx.x == kProducerThreads)
          wait_counter(p, p.counters.y_done, sched.slot_tiles_total(), task, WaitSite::all_gemm2);
        sync_consumers();
        slots_ready = true;
      }
      combine(p, t);
      continue;
    }
    const int row0 = t.shared ? t.m * kBlockM : p.plan.tile_row[t.m];
    float acc[128];
    if (t.shared) {  // BF16, as the BF16 kernel computes it
      const int k_steps = (t.kind == kGemm1 ? p.hidden : p.shared_inter) / kBlockK;
      mainloop<KMajor, KMajor>(p, s, pipe, acc, k_steps, wg, task);
      if (t.kind == kGemm1) {
        epilogue_gemm1(p, s, acc, t, row0, wg, pending_hidden);
      } else {
        epilogue_gemm2(p, s, acc, t, row0, wg);
        ++pending_slots;
      }
      continue;
    }
    const int expert = p.plan.tile_expert[t.m], rows = row0 + wg * 64;
    if (t.kind == kGemm1) {
      const int k_blocks = p.hidden / kFp8BlockK;
      const std::int64_t block_row = (static_cast<std::int64_t>(expert) * (p.inter / kFp8BlockN) + t.n) * k_blocks;
      const PassScales sc{q.x_scales + rows, q.capacity, q.gate_exponents + block_row, q.up_exponents + block_row};
      mainloop_fp8(p, s, pipe, acc, k_blocks, wg, task, sc);
      if (p.saved_gu) save_pass_pre_activations(p, acc, t.n * kGemm1Columns, rows);
      keep_first_pass(s, acc, wg, p.swiglu_limit);
      mainloop_fp8(p, s, pipe, acc, k_blocks, wg, task, sc);
      if (p.saved_gu) save_pass_pre_activations(p, acc, t.n * kGemm1Columns + kFp8BlockN / 2, rows);
      epilogue_gemm1_fp8(q, s, acc, t, row0, wg, pending_hidden);
    } else {
      const int k_blocks = p.inter / kFp8BlockK;
      const std::int64_t block_row = (static_cast<std::int64_t>(expert) * (p.hidden / kFp8BlockN) + t.n) * k_blocks;
      const PassScales sc{q.h_scales + rows, q.capacity, q.down_exponents + block_row, q.down_exponents + block_row};
      mainloop_fp8(p, s, pipe, acc, k_blocks, wg, task, sc);
      epilogue_gemm2<64>(p, s, acc, t, row0, wg);
      ++pending_slots;
    }
  }
  publish_hidden(p, pending_hidden);
  publish_slots(p, wg, pending_slots);
}

// The FP8 forward as a policy of the persistent skeleton (kernels/common/skeleton.cuh).
struct Fp8ForwardKernel {
  using Storage = SharedStorage;
  // The producer's FP8 and BF16 (shared expert) loads spill in the BF16 kernels' 40
  // registers; the FP8 consumer fits in 224.
  static constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  using P = Fp8ForwardParams;

  __device__ static bool stalled(const P&) { return false; }  // (one GPU)
  __device__ static bool inputs_valid(const P& q, int cta, int ctas) {
    if (q.base.plan.status->code == PlanStatus::ok) return true;
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
  __device__ static Schedule schedule(const P& q, int cta, int ctas) { return Schedule(q.base, cta, ctas, kFp8BlockN); }
  __device__ static void produce(const P& q, Storage& s, const Schedule& sched) { run_producer_fp8(q, s, sched); }
  __device__ static void consume(const P& q, Storage& s, const Schedule& sched, int wg) { run_consumer_fp8(q, s, sched, wg); }
};

__global__ void __launch_bounds__(kThreads, 1) forward_fp8_kernel(const __grid_constant__ Fp8ForwardParams p) {
  run_persistent<Fp8ForwardKernel>(p, blockIdx.x, gridDim.x);
}

}  // namespace

void launch_forward_fp8(const Fp8ForwardParams& params, int num_ctas, cudaStream_t stream) {
  launch_persistent<forward_fp8_kernel>(forward_shared_memory_bytes(), kThreads, params, num_ctas, stream);  // (one storage)
}

}  // namespace mok::kernels
