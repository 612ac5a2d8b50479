// The FP8 mainloop fed by TMA, two tile shapes (bench/NOTES.md, eleventh session): what the
// kernels do now and the restructure bench/mma_rate.cu points to, on one dense E4M3 GEMM
// C[M x N] = A[M x K] B[N x K]^T with the blockwise recipe's promotion every 128 of K, every SM,
// one CTA each, persistent over the output tiles; nothing is stored (the accumulators go to a
// sink no run reaches), so the time is the mainloops' and the feed's alone.
//
//   current     128 x 256 CTA tiles, two warpgroups of 64 x 256: the kernels' own mainloop_fp8
//               (per K block and N half of 128: four m64n128k32 into a block accumulator,
//               wait_group 0, promote; A's row scales as E8M0 bytes, 128 a stage, bulk-loaded with
//               the operands), stages of A 16 KB + B 32 KB
//   overlapped  128 x 128 CTA tiles, two warpgroups of 64 x 128 with two block accumulators:
//               block kb's MMAs issued into one while block kb - 1's is promoted from the
//               other; straight-line groups of eight K blocks ending in wait_group 0 (a loop
//               back edge with MMAs in flight made ptxas serialize every wgmma, C7514);
//               stages of A 16 KB + B 16 KB (a third more bytes a FLOP)
//   A in regs   current, with each warpgroup's A of a stage loaded once (ldmatrix) and both halves'
//               MMAs taking it from registers (RS form): A's shared-memory reads halved
//   overlap+mc  overlapped (6 stages) in 2-CTA clusters taking tiles (m, 2j) and (m, 2j + 1): each
//               CTA loads one 64-row half of A multicast into both (A's L2 reads halved: the
//               overlapped loop ran with L2 85 % busy, ncu)
//   narrow      128 x 128 CTA tiles, two warpgroups of 64 x 128 promoted in step as current is (four
//               MMAs into one block accumulator, wait_group 0, promote): the structure of the
//               CUTLASS kernel PyTorch can run for a rowwise-scaled torch._scaled_mm on large shapes
//               (cooperative, 128 x 128 x 128 tiles, partial sums promoted every 128 K, 2 x 1
//               clusters), which at the 700 W cap ran 1.55-1.58x dense BF16 (2026-12-06)
//   narrow+bmc  narrow in 2-CTA clusters taking tiles (2i, j) and (2i + 1, j): each CTA loads
//               one 64-row half of B multicast into both (B's L2 reads halved), as those
//               2 x 1 clusters share B
//   narrow-ss   narrow with A's row scales in shared memory: the producer loads a stage's 128
//               scales (512 bytes) beside its operands, so a promotion never waits on an L2 load
//               (the other loops load them one K block ahead, ~250 clocks of MMAs a block here)
//   current-ss  current's pattern (a copy here) with the row scales as fp32 in shared memory, as
//               narrow-ss: what the layer's FP8 mainloops gained from them before they took the
//               E8M0 bytes (CUTLASS's Hopper blockwise kernel loads its scales so)
//   current-ord, current-ss-ord, narrow-ss-ord
//               current, current-ss and narrow-ss with the two warpgroups' MMA batches in a fixed
//               alternation: warpgroup 0 waits at a named barrier of both warpgroups before it issues
//               each batch, warpgroup 1 arrives there after issuing its own, so the batches reach the
//               tensor cores as 1, 0, 1, 0, ... and one warpgroup promotes while the other's batch runs
//               (without it both issue together, complete together and promote together, the tensor
//               cores idle). Nsight Compute's SASS of cuBLAS's blockwise kernel (2026-12-06: 128 x 128
//               tiles, 6 stages, ~0.83 TFLOP/s a MHz against our 0.65) shows this: a 256-thread
//               bar.sync before one warpgroup's QGMMAs and after the other's, once a K block.
//               Measured (H100, at the cap): current-ord 0.84x current; current-ss-ord = current-ss
//               (1.11x current); narrow-ss-ord 1.05x narrow-ss. Kept here as the record; not in the layer.
//   three WGs   192 x 128 CTA tiles, three consumer warpgroups of 64 x 128, each promoted as today
//               (four MMAs into one block accumulator, wait_group 0, promote: 128 registers, so
//               three fit beside the producer at 160 each): while one warpgroup promotes, two
//               can keep the tensor cores busy. Stages of A 24 KB + B 16 KB (11 % more bytes a
//               FLOP than current); M rounded down to a multiple of 192.
//   overlapped-ss, overlap+mc-ss
//               overlapped and overlap+mc with A's row scales in shared memory (as narrow-ss): their
//               promotions, like three WGs', run beside MMAs and loaded the scales from L2 a block ahead
//   three-wgs-ss  three WGs with A's row scales in shared memory (as narrow-ss, 768 bytes a stage, read
//               by LDS): three WGs (883 TFLOP/s in groups, 2026-12-06) loaded them from L2 one block
//               ahead, the load the skewed loop's promotions were found waiting on (bench/NOTES.md,
//               fb414b1), and a loop whose warpgroups promote at different times meets it the same way.
//
//   fp8_tile_rate [--m M] [--n N] [--k K] [--iters I] [--repeats R] [--only NAME] [--group-rows G] [--warmup W]
//
// --warmup W untimed repeats before the timed ones (default 1; fp8_gemm_clocks.py passes enough to
// cover the power controller's ramp, so that the median describes the clock window it samples).
// --group-rows G orders the tiles as the layer orders an expert's of G rows (for_each_tile; the
// three-WGs variants' 192-row tiles in groups of at most G rows dividing M, one group before
// 2026-12-07); 0 (the default, every run before 2026-12-06) is one group of all M rows.
// --only NAME runs that variant alone, once (bench/fp8_gemm_clocks.py runs each so, sampling the
// clock and power while it runs); otherwise every variant, two rounds.
//
// Prints TFLOP/s (2 M N K a launch; median of the repeats, min-max; an L2 flush before each repeat). The scales are real loads
// (A's per row and K block, B's exponents per block) of ones, so the promotions do the kernels' work.
// `current` is the kernels' mainloop_fp8, A's row scales the E8M0 bytes of its stages (since
// drop-fp32-scales; before, it loaded fp32 row scales from L2 one block ahead, so its earlier figures
// are that loop's); `current-ss` the same pattern with fp32 row scales in the stages.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/common/boxes.hpp"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/mainloop_fp8.cuh"
#include "mok/kernel_status.hpp"
#include "mok/ptx/cluster.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"
#include "mok_bench/support.cuh"  // (time_iterations)
#include "tensor_map.hpp"
#include "tile_units.hpp"

namespace {

using namespace mok;
using namespace mok::kernels;


struct Counters {
  int* abort;
};

struct Params {
  CUtensorMap a, b;               // E4M3 [M, K], [N, K]: boxes of 128 rows x 128 K
  CUtensorMap a_half, b_half;     // A and B again, boxes of 64 rows (a cluster's CTAs multicast a half each)
  Counters counters;              // (the bounded waits' abort flag)
  KernelStatus* status;
  long long timeout_ns;
  int tiles_m, tiles_n, k_blocks, m;
  int group_m;                    // tile order: M-tiles a group (see for_each_tile)
  const float* a_scales;          // [K / 128, M]: ones
  const std::uint8_t* a_exps;     // [K / 128, M]: 127, their E8M0 bytes (current: mainloop_fp8's stage bytes)
  const std::int32_t* b_exponents;  // [K / 128]: zeros
  float* sink;
};

// A stage: A 128 rows x 128 K, B kTileN rows x 128 K (E4M3). kClusterSize 2: the CTAs of a
// cluster take the tiles (m, 2j) and (m, 2j + 1) together, each loading one 64-row half of A
// multicast into both CTAs' stages (A's L2 reads halved) and its own B; with kShareB the tiles
// (2i, j) and (2i + 1, j), each loading its own A and one 64-row half of B multicast. kStageBytes:
// A's row scales' E8M0 bytes with each stage (current: mainloop_fp8 reads them from a_exps).
template <int kTileN, int kStageCount, int kClusterSize = 1, int kTileM = 128, bool kShareB = false,
          bool kSmemScales = false, bool kStageBytes = false>
struct alignas(1024) Storage {
  static constexpr int kStages = kStageCount;
  static constexpr int kN = kTileN;
  static constexpr int kM = kTileM;
  static constexpr int kWarpgroups = kTileM / 64;  // consumer warpgroups, 64 rows each
  static constexpr int kCtaThreads = 128 * (1 + kWarpgroups);
  static constexpr int kCluster = kClusterSize;
  static constexpr bool kSharesB = kShareB;
  static constexpr bool kScalesInSmem = kSmemScales;  // A's row scales loaded with each stage (narrow-ss)
  static constexpr bool kExpsInStage = kStageBytes;
  static_assert(kClusterSize == 1 || (kTileM == 128 && kTileN == 128));
  static_assert(!kShareB || kClusterSize == 2);
  struct alignas(1024) Stage {
    std::uint8_t a[kTileM * 128];
    std::uint8_t b[kTileN * 128];
  } stages[kStages];
  float a_scales[kSmemScales ? kStages : 1][kTileM];  // stage i's rows' scales of its K block (kSmemScales)
  alignas(16) std::uint8_t a_exps[kStageBytes ? kStages : 1][kTileM];  // their E8M0 bytes (kStageBytes)
  PipelineBarriers<kStages> barriers;
};

// This CTA's rank in its cluster (0 without clusters).
template <typename St>
__device__ __forceinline__ int cluster_rank() {
  if constexpr (St::kCluster == 2) return static_cast<int>(ptx::cluster_ctarank());
  else return 0;
}

// Calls f(tile, m, n) for this CTA's tiles in order: CTA c takes units c, c + CTAs, ... where a
// unit is one tile, or for a cluster of two the pair (m, 2j), (m, 2j + 1) — or with kSharesB the
// pair (2i, j), (2i + 1, j). Units run in groups of group_m M-tiles, M-fastest inside a group, then
// N, then the next group: the layer's order inside one expert of group_m x 128 rows (its tasks
// take an expert's M-tiles for one N-tile, then the next N-tile). group_m = tiles_m is one group,
// the order of the runs before 2026-12-06 (which streamed all of A once per wave of N-tiles).
template <typename St, typename F>
__device__ __forceinline__ void for_each_tile(const Params& p, F&& f) {
  const int rank = cluster_rank<St>();
  constexpr int um = St::kSharesB ? 2 : 1, un = St::kCluster == 2 && !St::kSharesB ? 2 : 1;  // a unit's tiles
  const int units = bench::unit_count(p.tiles_m, p.tiles_n, um, un);
  for (int u = blockIdx.x / St::kCluster; u < units; u += gridDim.x / St::kCluster) {
    const bench::TileMN t = bench::unit_tile(u, rank, p.tiles_n, p.group_m, um, un);
    f(t.m + t.n * p.tiles_m, t.m, t.n);
  }
}

// Stage `index` may be refilled: this CTA's producer, and with clusters the peer's, whose
// multicast writes into this CTA's stages too, count the release (peer_empty: the shared::cluster
// address of the peer's empty[0], from peer_empty_barriers).
template <typename St>
__device__ __forceinline__ void release(St& s, Pipeline<St::kStages>& pipe, int index, std::uint32_t peer_empty) {
  pipe.consumer_release(s.barriers, index);
  if constexpr (St::kCluster == 2) ptx::mbarrier_arrive_remote(peer_empty + index * sizeof(std::uint64_t));
}
template <typename St>
__device__ __forceinline__ std::uint32_t peer_empty_barriers(St& s) {
  if constexpr (St::kCluster == 2) return ptx::cluster_address(&s.barriers.empty[0], ptx::cluster_ctarank() ^ 1u);
  else return 0;
}

// The consumers' loop: kLoop 0 the tile's own (current for 128 x 256, overlapped for 128 x 128,
// promoted64 for 192 x 128), 1 A in registers (128 x 256), 2 promoted64 in step (narrow, 128 x 128),
// 3 the same with the row scales from shared memory (narrow-ss), 4 current's with them so (current-ss;
// for 128 x 128 tiles overlapped's: overlapped-ss, overlap+mc-ss).
// 5-7: current, current-ss and narrow-ss with the warpgroups' batches alternating (mma_order_*).
enum : int {
  kLoopOfTile = 0,
  kLoopAInRegs = 1,
  kLoopInStep = 2,
  kLoopInStepSmemScales = 3,
  kLoopSmemScales = 4,
  kLoopOrdered = 5,
  kLoopSmemScalesOrdered = 6,
  kLoopInStepSmemScalesOrdered = 7
};
__host__ __device__ constexpr bool loop_has_smem_scales(int loop) {
  return loop == kLoopInStepSmemScales || loop == kLoopSmemScales || loop == kLoopSmemScalesOrdered ||
         loop == kLoopInStepSmemScalesOrdered;
}
// The kernels' mainloop_fp8 (current): A's row scale bytes in the stages.
__host__ __device__ constexpr bool loop_is_kernels(int loop, int tile_n, int tile_m) {
  return loop == kLoopOfTile && tile_n == 256 && tile_m == 128;
}
__host__ __device__ constexpr bool loop_is_ordered(int loop) {
  return loop == kLoopOrdered || loop == kLoopSmemScalesOrdered || loop == kLoopInStepSmemScalesOrdered;
}

// The alternation of the two consumer warpgroups' MMA batches (kOrdered): every batch, warpgroup
// 0 syncs at this barrier before issuing and warpgroup 1 after issuing, so warpgroup 0's batch n
// follows warpgroup 1's batch n, and warpgroup 1's batch n + 1 (issued after its batch n completed
// and was promoted) follows warpgroup 0's batch n. Both issue the same number of batches. (Id 4:
// past the kernels' NamedBarrier ids.)
inline constexpr int kMmaOrderBarrier = 4;
template <bool kOrdered>
__device__ __forceinline__ void mma_order_before_issue(int wg) {
  if constexpr (kOrdered)
    if (wg == 0) ptx::named_barrier_sync(kMmaOrderBarrier, 256);
}
template <bool kOrdered>
__device__ __forceinline__ void mma_order_after_issue(int wg) {
  if constexpr (kOrdered)
    if (wg == 1) ptx::named_barrier_sync(kMmaOrderBarrier, 256);
}

template <typename St>
__device__ void produce(const Params& p, St& s) {
  constexpr int kTileN = St::kN;
  Pipeline<St::kStages> pipe;
  const int rank = cluster_rank<St>();
  for_each_tile<St>(p, [&](int tile, int m, int n) {
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      constexpr std::uint32_t kScaleBytes = St::kScalesInSmem ? St::kM * 4 : St::kExpsInStage ? kFp8RowExponentBytes : 0;
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, tile, St::kM * 128 + kTileN * 128 + kScaleBytes);
      auto& st = s.stages[pipe.stage()];
      if constexpr (St::kScalesInSmem)  // (a K block's scales of the tile's rows: [K / 128, M], contiguous)
        ptx::bulk_load(s.a_scales[pipe.stage()], p.a_scales + static_cast<long long>(kb) * p.m + m * St::kM, kScaleBytes,
                       full);
      if constexpr (St::kExpsInStage)  // (their bytes, as the kernels' producers load them)
        ptx::bulk_load(s.a_exps[pipe.stage()], p.a_exps + static_cast<long long>(kb) * p.m + m * St::kM, kScaleBytes, full);
      if constexpr (St::kCluster == 2 && !St::kSharesB)  // (the peer's half lands here too, counted by this barrier)
        ptx::tma_load_2d_multicast(st.a + rank * 64 * 128, &p.a_half, full, kb * 128, m * 128 + rank * 64, 0x3);
      else
        ptx::tma_load_2d(st.a, &p.a, full, kb * 128, m * St::kM);
      if constexpr (St::kM == 192) ptx::tma_load_2d(st.a + 128 * 128, &p.a_half, full, kb * 128, m * 192 + 128);
      if constexpr (St::kSharesB)
        ptx::tma_load_2d_multicast(st.b + rank * 64 * 128, &p.b_half, full, kb * 128, n * 128 + rank * 64, 0x3);
      else
        ptx::tma_load_2d(st.b, &p.b, full, kb * 128, n * kTileN);
      if constexpr (kTileN == 256) ptx::tma_load_2d(st.b + 128 * 128, &p.b, full, kb * 128, n * kTileN + 128);
      pipe.producer_commit();
    }
  });
}

// acc += block * a_scale(row) * b_scale (this thread's rows r and r + 8 alternate in pairs).
__device__ __forceinline__ void promote(float (&acc)[64], float (&block)[64], float a_lo, float a_hi, int e) {
  ptx::wgmma_fence_operands(block);
  const float b_scale = exp2_int(e);
  const float scale[2] = {a_lo * b_scale, a_hi * b_scale};
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = __fmaf_rn(block[i], scale[(i >> 1) & 1], acc[i]);
  ptx::wgmma_fence_operands(block);
}

// Four m64n128k32 of the stage into block (its first overwriting it).
template <typename Stage>
__device__ __forceinline__ void issue(const Stage& st, int wg, float (&block)[64]) {
  const std::uint32_t desc_a = ptx::wgmma_descriptor_sw128_lo(st.a + wg * 64 * 128);
  const std::uint32_t desc_b = ptx::wgmma_descriptor_sw128_lo(st.b);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    ptx::wgmma_m64n128k32_e4m3(block, desc_a + KMajor::kDescStep * kk, desc_b + KMajor::kDescStep * kk, kk != 0);
  ptx::wgmma_commit_group();
}

// This thread's A fragments of a 64-row x 128-K E4M3 warpgroup tile (K-major, 128-byte rows,
// the 128-byte swizzle: chunk c of row r at chunk c ^ (r % 8)), one ldmatrix.x4 a 32-K slice:
// matrices (rows 0-7 | 8-15) x (K bytes 0-15 | 16-31) of the warp's 16 rows.
__device__ __forceinline__ void load_a_fragments(const std::uint8_t* tile, std::uint32_t (&a)[4][4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32;
  const int row = warp * 16 + lane % 8 + 8 * (lane / 8 % 2);
  const std::uint32_t base = ptx::smem_address(tile) + row * 128;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int chunk = (2 * kk + lane / 16) ^ (row % 8);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[kk][0]), "=r"(a[kk][1]), "=r"(a[kk][2]), "=r"(a[kk][3])
                 : "r"(base + chunk * 16)
                 : "memory");
  }
}

// The scales of K block kb — this thread's two A rows' and B's exponent — or zeros past the last
// block: the mainloops below load them one block ahead, as mainloop_fp8 does. With kSmemScales the
// A rows' come with the stage instead (stage_scales, once it has landed): only B's is loaded here.
struct BlockScales {
  float a_lo, a_hi;
  int e;
};
template <bool kSmemScales>
__device__ __forceinline__ BlockScales block_scales(const Params& p, const float* a_rows, int kb) {
  if (kb >= p.k_blocks) return {0.0f, 0.0f, 0};
  if constexpr (kSmemScales) return {0.0f, 0.0f, __ldg(p.b_exponents + kb)};
  else return {__ldcg(a_rows + kb * p.m), __ldcg(a_rows + kb * p.m + 8), __ldg(p.b_exponents + kb)};
}
// Warpgroup wg's thread's A row scales from stage `index` (St::kScalesInSmem; read before its release).
template <typename St>
__device__ __forceinline__ void stage_scales(const St& s, int index, int wg, BlockScales& scales) {
  const int tid = threadIdx.x % 128, row = wg * 64 + tid / 32 * 16 + tid % 32 / 4;  // this thread's rows: row, row + 8
  const std::uint32_t at = ptx::smem_address(&s.a_scales[index][row]);  // (LDS: a generic pointer compiled to LD.E)
  scales.a_lo = ptx::ld_shared_f32(at), scales.a_hi = ptx::ld_shared_f32(at + 8 * sizeof(float));
}

// mainloop_fp8's pattern (per K block and N half of 128: four MMAs into block, wait_group 0,
// promote), the scale product formed before the MMAs complete; kAInRegs: this warpgroup's A of a
// stage loaded once into registers and read by both halves' MMAs (RS form: A's shared-memory reads
// halved; timing only, the fragment layout is not checked here); St::kScalesInSmem: A's row scales
// from the stage (current-ss). Timing only.
template <typename St, bool kAInRegs, bool kOrdered = false>
__device__ void mainloop_wide(const Params& p, St& s, Pipeline<St::kStages>& pipe, float (&acc)[128], int wg, int task,
                              const float* a_rows) {
  const int tid = threadIdx.x % 128;
  float block[64];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) block[i] = 0.0f;
  BlockScales scales = block_scales<St::kScalesInSmem>(p, a_rows, 0);
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    const int stage_index = pipe.consumer_wait(p, s.barriers, task);
    if constexpr (St::kScalesInSmem) stage_scales(s, stage_index, wg, scales);
    const BlockScales next = block_scales<St::kScalesInSmem>(p, a_rows, kb + 1);
    const auto& st = s.stages[stage_index];
    const std::uint32_t desc_a = ptx::wgmma_descriptor_sw128_lo(st.a + wg * 64 * 128);
    std::uint32_t a[4][4];
    if constexpr (kAInRegs) load_a_fragments(st.a + wg * 64 * 128, a);
    const float b_scale = exp2_int(scales.e);
    const float scale[2] = {scales.a_lo * b_scale, scales.a_hi * b_scale};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::uint32_t desc_b = ptx::wgmma_descriptor_sw128_lo(st.b + half * 128 * 128);
      mma_order_before_issue<kOrdered>(wg);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (kAInRegs) ptx::wgmma_m64n128k32_e4m3_rs(block, a[kk], desc_b + KMajor::kDescStep * kk, kk != 0);
        else ptx::wgmma_m64n128k32_e4m3(block, desc_a + KMajor::kDescStep * kk, desc_b + KMajor::kDescStep * kk, kk != 0);
      }
      ptx::wgmma_commit_group();
      mma_order_after_issue<kOrdered>(wg);
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(block);
      if (half == 1) {
        if (tid == 0) pipe.consumer_release(s.barriers, stage_index);
        pipe.consumer_advance();
      }
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[64 * half + i] = __fmaf_rn(block[i], scale[(i >> 1) & 1], acc[64 * half + i]);
    }
    scales = next;
  }
}

// One 64 x 128 warpgroup tile promoted as the kernels promote (per 128-K block four MMAs into
// block, wait_group 0, release the stage, acc += block * scales; the scales one block ahead, or
// A's from the stage with St::kScalesInSmem: narrow-ss).
template <typename St, bool kOrdered = false>
__device__ void mainloop_promoted64(const Params& p, St& s, Pipeline<St::kStages>& pipe, float (&acc)[64], int wg,
                                    int task, const float* a_rows) {
  const int tid = threadIdx.x % 128;
  const std::uint32_t peer_empty = peer_empty_barriers(s);
  float block[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f, block[i] = 0.0f;
  BlockScales scales = block_scales<St::kScalesInSmem>(p, a_rows, 0);
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    const int stage_index = pipe.consumer_wait(p, s.barriers, task);
    if constexpr (St::kScalesInSmem) stage_scales(s, stage_index, wg, scales);
    const BlockScales next = block_scales<St::kScalesInSmem>(p, a_rows, kb + 1);
    mma_order_before_issue<kOrdered>(wg);
    issue(s.stages[stage_index], wg, block);
    mma_order_after_issue<kOrdered>(wg);
    ptx::wgmma_wait_group<0>();
    if (tid == 0) release(s, pipe, stage_index, peer_empty);
    pipe.consumer_advance();
    promote(acc, block, scales.a_lo, scales.a_hi, scales.e);
    scales = next;
  }
}

// The overlapped mainloop of one 64 x 128 warpgroup tile over k_blocks (a multiple of 8).
template <typename St>
__device__ void mainloop_overlapped(const Params& p, St& s, Pipeline<St::kStages>& pipe, float (&acc)[64],
                                    int wg, int task, const float* a_rows) {
  const int tid = threadIdx.x % 128;
  const std::uint32_t peer_empty = peer_empty_barriers(s);
  float block0[64], block1[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f, block0[i] = 0.0f, block1[i] = 0.0f;
  for (int g = 0; g < p.k_blocks; g += 8) {
    int stage_of[2] = {0, 0};
    float a_lo[2] = {0.0f, 0.0f}, a_hi[2] = {0.0f, 0.0f};
    int e[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int kb = g + j, cur = j % 2;
      stage_of[cur] = pipe.consumer_wait(p, s.barriers, task);
      if constexpr (St::kScalesInSmem) {  // (overlapped-ss: from the stage, released only after its promotion)
        BlockScales staged{};
        stage_scales(s, stage_of[cur], wg, staged);
        a_lo[cur] = staged.a_lo, a_hi[cur] = staged.a_hi;
      } else {
        a_lo[cur] = __ldcg(a_rows + kb * p.m), a_hi[cur] = __ldcg(a_rows + kb * p.m + 8);
      }
      e[cur] = __ldg(p.b_exponents + kb);
      issue(s.stages[stage_of[cur]], wg, cur == 0 ? block0 : block1);
      pipe.consumer_advance();
      if (j > 0) {  // block kb - 1's MMAs are done: promote it while block kb's run, free its stage
        ptx::wgmma_wait_group<1>();
        const int prev = 1 - cur;
        promote(acc, prev == 0 ? block0 : block1, a_lo[prev], a_hi[prev], e[prev]);
        if (tid == 0) release(s, pipe, stage_of[prev], peer_empty);
      }
    }
    ptx::wgmma_wait_group<0>();
    promote(acc, block1, a_lo[1], a_hi[1], e[1]);
    if (tid == 0) release(s, pipe, stage_of[1], peer_empty);
  }
}

template <typename St, int kLoop>
__device__ void consume(const Params& p, St& s, int wg) {
  constexpr int kTileN = St::kN;
  Pipeline<St::kStages> pipe;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  float total = 0.0f;
  for_each_tile<St>(p, [&](int tile, int m, int) {
    const float* a_rows = p.a_scales + m * St::kM + wg * 64 + warp * 16 + lane / 4;
    if constexpr (St::kM == 192 || kLoop == kLoopInStep || kLoop == kLoopInStepSmemScales ||
                  kLoop == kLoopInStepSmemScalesOrdered) {
      float acc[64];
      mainloop_promoted64<St, loop_is_ordered(kLoop)>(p, s, pipe, acc, wg, tile, a_rows);
#pragma unroll
      for (int i = 0; i < 64; ++i) total += acc[i];
    } else if constexpr (kTileN == 256) {
      float acc[128];
      const Fp8TaskScales sc{{p.b_exponents, p.b_exponents}};
      if constexpr (kLoop == kLoopAInRegs || kLoop == kLoopSmemScales || loop_is_ordered(kLoop))
        mainloop_wide<St, kLoop == kLoopAInRegs, loop_is_ordered(kLoop)>(p, s, pipe, acc, wg, tile, a_rows);
      else mainloop_fp8(p, s, pipe, acc, p.k_blocks, wg, tile, sc);
#pragma unroll
      for (int i = 0; i < 128; ++i) total += acc[i];
    } else {
      float acc[64];
      mainloop_overlapped(p, s, pipe, acc, wg, tile, a_rows);
#pragma unroll
      for (int i = 0; i < 64; ++i) total += acc[i];
    }
  });
  if (total == 1234.5f) p.sink[blockIdx.x] = total;  // (keeps the work; never true here)
}

// (three consumer warpgroups: 512 threads launch with 128 registers each; the producer gives
// back to 32 so that the consumers may take 160: 32 x 128 + 160 x 384 = 65536)
template <typename St>
inline constexpr int kTileProducerRegisters = St::kWarpgroups == 3 ? 32 : kProducerRegisters;
template <typename St>
inline constexpr int kTileConsumerRegisters = St::kWarpgroups == 3 ? 160 : kConsumerRegisters;
template <typename St>
inline constexpr bool kRegistersFit =
    kTileProducerRegisters<St> * 128 + kTileConsumerRegisters<St> * 128 * St::kWarpgroups <= 65536;

template <typename St, int kLoop>
__global__ void __launch_bounds__(St::kCtaThreads, 1) tile_kernel(const __grid_constant__ Params p) {
  static_assert(kRegistersFit<St>);
  St& s = shared_storage<St>();
  s.barriers.init(St::kWarpgroups * St::kCluster);  // (with clusters the peer's warpgroups release too)
  if constexpr (St::kCluster == 2) {
    if (threadIdx.x == 0) ptx::fence_mbarrier_init_cluster();
    ptx::cluster_sync();  // (the peer's barriers are initialised before any multicast or remote arrival)
  } else {
    __syncthreads();
  }
  split_roles<kTileProducerRegisters<St>, kTileConsumerRegisters<St>>([&] { produce<St>(p, s); },
                                                                      [&](int wg) { consume<St, kLoop>(p, s, wg); });
  if constexpr (St::kCluster == 2) ptx::cluster_sync();  // (no CTA leaves while its peer may still write into it)
}

// The variant's name as --only and the output give it.
template <int kTileN, int kLoop, int kCluster, int kTileM, bool kShareB>
constexpr const char* variant_name() {
  if (kTileM == 192) return loop_has_smem_scales(kLoop) ? "three-wgs-ss" : "three-wgs";
  if (kTileN == 256) {
    switch (kLoop) {
      case kLoopAInRegs: return "a-in-regs";
      case kLoopSmemScales: return "current-ss";
      case kLoopOrdered: return "current-ord";
      case kLoopSmemScalesOrdered: return "current-ss-ord";
      default: return "current";
    }
  }
  if (kLoop == kLoopInStep) return kShareB ? "narrow+bmc" : "narrow";
  if (kLoop == kLoopInStepSmemScales) return "narrow-ss";
  if (kLoop == kLoopInStepSmemScalesOrdered) return "narrow-ss-ord";
  if (kLoop == kLoopSmemScales) return kCluster == 2 ? "overlap+mc-ss" : "overlapped-ss";
  return kCluster == 2 ? "overlap+mc" : "overlapped";
}

template <int kTileN, int kStages, int kLoop = kLoopOfTile, int kCluster = 1, int kTileM = 128, bool kShareB = false>
void run(Params p, int M, int N, int K, int iters, int repeats, int sms, const char* only, int group_rows, int warmup) {
  constexpr const char* name = variant_name<kTileN, kLoop, kCluster, kTileM, kShareB>();
  if (only != nullptr && std::strcmp(only, name) != 0) return;
  using St = Storage<kTileN, kStages, kCluster, kTileM, kShareB, loop_has_smem_scales(kLoop),
                     loop_is_kernels(kLoop, kTileN, kTileM)>;
  M = M / kTileM * kTileM;  // (192-row tiles: M rounded down; the FLOPs counted are this M's)
  p.tiles_m = M / kTileM, p.tiles_n = N / kTileN, p.k_blocks = K / 128;
  // group_m rows of tiles a group: the --group-rows given (a multiple of 256 dividing M), or all of M;
  // 192-row tiles: the largest divisor of tiles_m with at most as many rows (e.g. 7 tiles, 1344 rows, of
  // M 8064 for 2048; before 2026-12-07 they kept one group)
  p.group_m = p.tiles_m;
  if (group_rows > 0 && kTileM == 128) p.group_m = group_rows / kTileM;
  if (group_rows > 0 && kTileM == 192)
    for (int g = std::max(1, group_rows / kTileM); g >= 1; --g)
      if (p.tiles_m % g == 0) {
        p.group_m = g;
        break;
      }
  const std::size_t smem = shared_storage_bytes<St>();
  static_assert(shared_storage_bytes<St>() <= kMaxSharedMemoryBytes);
  auto kernel = tile_kernel<St, kLoop>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
  config.gridDim = dim3(sms / kCluster * kCluster), config.blockDim = dim3(St::kCtaThreads), config.dynamicSmemBytes = smem;
  config.attrs = &cluster, config.numAttrs = 1;
  if (only != nullptr) {  // (bench/fp8_gemm_clocks.py starts its clock window here: after the process's set-up)
    std::printf("timing %s\n", name);
    std::fflush(stdout);
  }
  const std::vector<float> ms = mok_bench::time_iterations(warmup, repeats, nullptr, [&] {
    for (int i = 0; i < iters; ++i) cudaLaunchKernelEx(&config, kernel, p);
  });
  const double tflop = 2.0 * M * N * K * iters / 1e12;  // (ms: ascending)
  std::printf("%-11s %3d x %3d CTA tiles, %d stages of %2d KB  %7.1f TFLOP/s  [%.1f, %.1f]\n", name, kTileM, kTileN,
              kStages, static_cast<int>(sizeof(typename St::Stage) / 1024), tflop / (ms[ms.size() / 2] * 1e-3),
              tflop / (ms.back() * 1e-3), tflop / (ms.front() * 1e-3));
}

}  // namespace

int main(int argc, char** argv) {
  int M = 8192, N = 4096, K = 7168, iters = 10, repeats = 5;
  const char* only = nullptr;
  int group_rows = 0;  // 0: all of M one group
  int warmup = 1;      // untimed repeats first
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--m")) M = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--n")) N = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--k")) K = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
    else if (!std::strcmp(argv[i], "--group-rows")) group_rows = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--warmup")) warmup = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr,
                   "usage: fp8_tile_rate [--m M] [--n N] [--k K] [--iters I] [--repeats R] [--only NAME] [--group-rows G] "
                   "[--warmup W]\n");
      return 2;
    }
  }
  if (M % 256 || N % 256 || K % 1024) {
    std::fprintf(stderr, "fp8_tile_rate: M and N must be multiples of 256, K of 1024 (eight K blocks)\n");
    return 2;
  }
  if (group_rows < 0 || group_rows % 256 || (group_rows > 0 && M % group_rows)) {
    std::fprintf(stderr, "fp8_tile_rate: --group-rows %d: a multiple of 256 that divides M (%d), or 0 for all of M\n",
                 group_rows, M);
    return 2;
  }
  static const char* const kVariants[] = {"current",   "a-in-regs",  "current-ss", "current-ord", "current-ss-ord",
                                          "overlapped", "overlap+mc", "narrow",     "narrow+bmc",  "narrow-ss",
                                          "narrow-ss-ord", "three-wgs", "three-wgs-ss", "overlapped-ss", "overlap+mc-ss"};
  if (only != nullptr && std::none_of(std::begin(kVariants), std::end(kVariants),
                                      [&](const char* v) { return std::strcmp(v, only) == 0; })) {
    std::fprintf(stderr, "fp8_tile_rate: --only %s: not a variant (", only);
    for (const char* v : kVariants) std::fprintf(stderr, "%s%s", v == kVariants[0] ? "" : ", ", v);
    std::fprintf(stderr, ")\n");
    return 2;
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  std::printf("# %s, %d SMs, E4M3 GEMM M %d N %d K %d, tiles in groups of %d rows, %d launches a repeat, median of %d\n",
              prop.name, sms, M, N, K, group_rows > 0 ? group_rows : M, iters, repeats);
  // Operands: pseudo-random E4M3 bytes (finite: exponent field below all-ones); scales of one.
  std::vector<std::uint8_t> host(static_cast<std::size_t>(std::max(M, N)) * K);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::uint8_t>((i * 2654435761u >> 13) & 0x77);
  std::uint8_t *a = nullptr, *b = nullptr;
  float* a_scales = nullptr;
  std::uint8_t* a_exps = nullptr;
  std::int32_t* b_exponents = nullptr;
  int* abort = nullptr;
  KernelStatus* status = nullptr;
  float* sink = nullptr;
  cudaMalloc(&a, static_cast<std::size_t>(M) * K);
  cudaMalloc(&b, static_cast<std::size_t>(N) * K);
  cudaMemcpy(a, host.data(), static_cast<std::size_t>(M) * K, cudaMemcpyHostToDevice);
  cudaMemcpy(b, host.data(), static_cast<std::size_t>(N) * K, cudaMemcpyHostToDevice);
  const std::vector<float> ones(static_cast<std::size_t>(K / 128) * M, 1.0f);
  cudaMalloc(&a_scales, sizeof(float) * ones.size());
  cudaMemcpy(a_scales, ones.data(), sizeof(float) * ones.size(), cudaMemcpyHostToDevice);
  cudaMalloc(&a_exps, ones.size());
  cudaMemset(a_exps, 127, ones.size());  // (E8M0 127: 2^0)
  cudaMalloc(&b_exponents, sizeof(std::int32_t) * (K / 128));
  cudaMemset(b_exponents, 0, sizeof(std::int32_t) * (K / 128));
  cudaMalloc(&abort, sizeof(int));
  cudaMemset(abort, 0, sizeof(int));
  cudaMalloc(&status, sizeof(KernelStatus));
  cudaMemset(status, 0, sizeof(KernelStatus));
  cudaMalloc(&sink, sizeof(float) * sms);
  using U = std::uint64_t;
  Params p{};
  p.a = detail::make_u8_tensor_map(a, {U(K), U(M)}, kBoxFp8, "a");
  p.b = detail::make_u8_tensor_map(b, {U(K), U(N)}, kBoxFp8, "b");
  p.a_half = detail::make_u8_tensor_map(a, {U(K), U(M)}, kBoxFp8Half, "a_half");
  p.b_half = detail::make_u8_tensor_map(b, {U(K), U(N)}, kBoxFp8Half, "b_half");
  p.counters.abort = abort;
  p.status = status;
  p.timeout_ns = 20'000'000'000LL;
  p.m = M;
  p.a_scales = a_scales;
  p.a_exps = a_exps;
  p.b_exponents = b_exponents;
  p.sink = sink;
  try {  // (time_iterations throws mok::Error on a CUDA error)
    for (int round = 0; round < (only != nullptr ? 1 : 2); ++round) {
      run<256, 4>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<256, 4, kLoopAInRegs>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<256, 4, kLoopSmemScales>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<256, 4, kLoopOrdered>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<256, 4, kLoopSmemScalesOrdered>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      if (only == nullptr) {  // (stage counts the --only runs leave out)
        run<128, 4>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
        run<128, 7>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      }
      run<128, 6>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 6, kLoopOfTile, 2>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 6, kLoopSmemScales>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 6, kLoopSmemScales, 2>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 6, kLoopInStep>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 6, kLoopInStep, 2, 128, true>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 6, kLoopInStepSmemScales>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 6, kLoopInStepSmemScalesOrdered>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      if (only == nullptr) run<128, 5, kLoopOfTile, 1, 192>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 4, kLoopOfTile, 1, 192>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);  // (what the forward could keep beside h staging)
      if (only == nullptr) run<128, 5, kLoopInStepSmemScales, 1, 192>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
      run<128, 4, kLoopInStepSmemScales, 1, 192>(p, M, N, K, iters, repeats, sms, only, group_rows, warmup);
    }
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "fp8_tile_rate: %s\n", e.what());
    return 1;
  }
  KernelStatus seen{};
  cudaMemcpy(&seen, status, sizeof seen, cudaMemcpyDeviceToHost);
  if (seen.code != KernelStatus::ok) {
    std::fprintf(stderr, "fp8_tile_rate: a wait timed out (CTA %d)\n", seen.block);
    return 1;
  }
  return 0;
}
