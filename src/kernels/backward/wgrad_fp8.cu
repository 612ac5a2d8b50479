// The routed weight gradients in E4M3 (Precision::fp8 with BackwardArgs::fp8_weight_gradients;
// kernels/backward/backward.cuh, Fp8WgradParams): one persistent launch after the FP8 dgrad
// kernel, the backward's structure (one TMA producer thread, two consumer warpgroups of 64 rows
// of a 128 x 256 tile, the 4-stage ring), every task one output tile with the full K loop:
//
//   dWd   tasks  dW_down[e] = dy^T . (w h)           A dy_t  [H, rows], B hw_t  [I, rows]
//   dWgu  tasks  [dW_gate; dW_up][e] = [dg du]^T . x  A dgu_t [2I, rows], B x_t  [H, rows]
//
// over the expert's plan rows (padded to 128: padding rows are zeros), K blocks of 128 rows in
// ascending order. The operands are the transposes of the rows, E4M3 (Hopper's FP8 MMAs read
// K-major operands only, and K is the rows here): A, a gradient, with one power-of-two scale
// per channel and 128 rows; B, an activation, one per 128 channels x 128 rows — so that each K
// block promotes as the forward's (a row scale of A times a block scale of B: mainloop_fp8),
// not by an outer product of two per-channel scales (two instructions an accumulator instead
// of one). A's scales travel in the stages as E8M0 bytes (Fp8WgradParams::dy_t_exps / dgu_t_exps,
// 128 a stage, bulk-loaded with the operands, as in the FP8 forward and dgrad). The stores are the BF16
// kernel's (bf16 written, f32 accumulated into). Task order as the BF16 kernel's phase-major one
// (Schedule::split_weight and its rule for dW_gate|up). No task waits on another: the launch
// before wrote every operand.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/backward/backward.cuh"
#include "kernels/backward/epilogues.cuh"
#include "kernels/backward/tasks.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/common/skeleton.cuh"
#include "kernels/ep/ep_push.cuh"
#include "kernels/fp8/fp8_math.cuh"
#include "kernels/fp8/mainloop_fp8.cuh"
#include "mok/ptx/tma.cuh"

namespace mok::kernels {
namespace {

using namespace mok::ptx;
using namespace bwd;

static_assert(kFp8TileBytes == sizeof(SharedStorage::Stage::a) && 2 * kFp8TileBytes == sizeof(SharedStorage::Stage::b));
static_assert(kBlockM == kFp8BlockK && kBlockN == 2 * kBlockM, "a K block is a plan tile; B's halves are 128-channel blocks");

// The launch's tasks: every routed dW_down tile, then every routed dW_gate|up tile.
struct WgradSchedule {
  int cta, ctas;
  int m_wd, n_wd, m_wgu, n_wgu, wd, total;
  bool wgu_n_fastest;
  __device__ WgradSchedule(const BackwardParams& p, int cta_, int ctas_) : cta(cta_), ctas(ctas_) {
    const int H = p.hidden, I = p.routed.inter, E = p.num_local_experts;
    m_wd = H / kBlockM, n_wd = ceil_div(I, kBlockN);
    m_wgu = 2 * I / kBlockM, n_wgu = ceil_div(H, kBlockN);
    wd = E * m_wd * n_wd;
    total = wd + E * m_wgu * n_wgu;
    wgu_n_fastest = Schedule<false>::n_fastest(2 * I, H);
  }
  __device__ Task decode(int task) const {
    Task t{kWd, false, 0, 0, 0};
    if (task < wd) {
      Schedule<false>::split_weight(task, m_wd, n_wd, t);
    } else {
      t.kind = kWgu;
      Schedule<false>::split_weight(task - wd, m_wgu, n_wgu, t, wgu_n_fastest);
    }
    return t;
  }
};

__device__ __forceinline__ int k_blocks_of(const BackwardParams& p, const Task& t, int& first) {
  int count = 0;
  expert_rows(p, t, first, count);
  return count / kFp8BlockK;
}

__device__ void wgrad_produce(const Fp8WgradParams& q, SharedStorage& s, const WgradSchedule& sched) {
  const BackwardParams& p = q.base;
  Pipeline<kStages> pipe;
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(task);
    int first = 0;
    const int k_blocks = k_blocks_of(p, t, first);
    const bool wd = t.kind == kWd;
    const CUtensorMap* a_map = wd ? &q.maps.dy_t : &q.maps.dgu_t;
    const CUtensorMap* b_map = wd ? &q.maps.hw_t : &q.maps.x_t;
    const int m0 = t.m * kBlockM, n0 = t.n * kBlockN;
    // (A's channels' scale bytes of row block b: [b, channels], its 128 from m0 contiguous)
    const int a_channels = wd ? p.hidden : 2 * p.routed.inter;
    const std::uint8_t* a_exps = (wd ? q.dy_t_exps : q.dgu_t_exps) + static_cast<std::int64_t>(first / kFp8BlockK) * a_channels + m0;
    for (int kb = 0; kb < k_blocks; ++kb) {  // (B's second half past I or H: zero-filled)
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, 3 * kFp8TileBytes + kFp8RowExponentBytes);
      SharedStorage::Stage& st = s.stages[pipe.stage()];
      char* b = reinterpret_cast<char*>(st.b);
      const int k0 = first + kb * kFp8BlockK;
      tma_load_2d(st.a, a_map, full, k0, m0);
      bulk_load(s.a_exps[pipe.stage()], a_exps + static_cast<std::int64_t>(kb) * a_channels, kFp8RowExponentBytes, full);
      tma_load_2d(b, b_map, full, k0, n0);
      tma_load_2d(b + kFp8TileBytes, b_map, full, k0, n0 + kBlockM);
      pipe.producer_commit();
    }
  }
}

// A task's B scales: the exponents of its two 128-channel blocks (past I or H: the first's) from the
// expert's first row block on ([channel blocks, wgrad_exponent_stride]). (A's come with the stages.)
__device__ __forceinline__ Fp8TaskScales wgrad_scales(const Fp8WgradParams& q, const Task& t, int first) {
  const BackwardParams& p = q.base;
  const bool wd = t.kind == kWd;
  const int b_blocks = (wd ? p.routed.inter : p.hidden) / kFp8BlockK;
  const int row_block = first / kFp8BlockK, stride = static_cast<int>(wgrad_exponent_stride(q.capacity));
  const std::int32_t* b = (wd ? q.hw_t_exponents : q.x_t_exponents) + row_block;
  const int b0 = 2 * t.n, b1 = b0 + 1 < b_blocks ? b0 + 1 : b0;
  return {{b + static_cast<std::int64_t>(b0) * stride, b + static_cast<std::int64_t>(b1) * stride}};
}

__device__ void wgrad_consume(const Fp8WgradParams& q, SharedStorage& s, const WgradSchedule& sched, int wg) {
  const BackwardParams& p = q.base;
  Pipeline<kStages> pipe;
  float acc[128];
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(task);
    int first = 0;
    const int k_blocks = k_blocks_of(p, t, first);
    mainloop_fp8<kStages>(p, s, pipe, acc, k_blocks, wg, task, wgrad_scales(q, t, first));  // (none: acc = 0)
    epilogue_weight</*kSharedWindow=*/true>(p, s, acc, t, wg, k_blocks == 0);
  }
  if (threadIdx.x % 128 == 0) tma_store_wait_all();  // the gradients' stores complete before exit
}

struct WgradFp8Kernel {
  using Storage = SharedStorage;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // (the FP8 dgrad kernel's split)
  static constexpr int kStageReaders = kConsumerWarpgroups;
  using P = Fp8WgradParams;

  __device__ static bool stalled(const P&) { return false; }
  // A bad plan or saved tensor: the dgrad kernel before this one reported it and poisoned its
  // outputs; the weight gradients are left alone, as there.
  __device__ static bool inputs_valid(const P& q, int, int) {
    return all_plans_ok(q.base, true) && *q.base.saved_marker == kSavedValid;
  }
  __device__ static void init_shared(const P& q, Storage&, int) {
    if (threadIdx.x == 32)
      for (const CUtensorMap* map : {&q.maps.dy_t, &q.maps.hw_t, &q.maps.dgu_t, &q.maps.x_t}) tma_prefetch_descriptor(map);
  }
  __device__ static bool is_comm(const P&, int) { return false; }
  __device__ static void run_comm(const P&, Storage&, int) {}
  __device__ static WgradSchedule schedule(const P& q, int cta, int ctas) { return WgradSchedule(q.base, cta, ctas); }
  __device__ static void produce(const P& q, Storage& s, const WgradSchedule& sched) { wgrad_produce(q, s, sched); }
  __device__ static void consume(const P& q, Storage& s, const WgradSchedule& sched, int wg) {
    wgrad_consume(q, s, sched, wg);
  }
};

__global__ void __launch_bounds__(kThreads, 1) wgrad_fp8_kernel(const __grid_constant__ Fp8WgradParams q) {
  run_persistent<WgradFp8Kernel>(q, blockIdx.x, gridDim.x);
}

}  // namespace

void launch_wgrad_fp8(const Fp8WgradParams& params, int num_ctas, cudaStream_t stream) {
  launch_persistent<wgrad_fp8_kernel>(shared_storage_bytes<bwd::SharedStorage>(), kThreads, params, num_ctas, stream);
}

void load_wgrad_fp8_kernels() { configure_persistent<wgrad_fp8_kernel>(shared_storage_bytes<bwd::SharedStorage>()); }

}  // namespace mok::kernels
