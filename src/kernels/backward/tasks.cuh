// The fused backward's shared storage, tasks and schedule (see kernels/backward/backward.cu's header):
// what each task is, in which order the CTAs take them, and which rows and counters it uses.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/backward/backward.cuh"
#include "kernels/common/boxes.hpp"
#include "kernels/ep/ep_push.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/diag.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "kernels/common/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"

namespace mok::kernels::bwd {

using namespace mok::ptx;

// Tile sizes, stages and the CTA layout are the forward's (kernels/forward/forward.cuh, persistent.cuh).
constexpr std::uint32_t kBoxBytes = kBoxMN.bytes(2);       // one MN-major box (the host's kBoxMN)
constexpr std::uint32_t kKMajorABytes = kBoxK.bytes(2);    // one K-major A box (the host's kBoxK)
static_assert(kKMajorABytes == kBlockM * kBlockK * 2 && kBoxMN.cols == kBlockK);

struct ReadCount {
  int* counter;  // the counter (switch_read()); null: none
  int count;     // tiles not yet counted in it
};

enum TaskKind : int { kDh, kDx, kWd, kWgu, kCombine };

struct Task {
  TaskKind kind;
  bool shared;
  int m, n, e;  // M-tile, N-tile, expert; combine: token block in m
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Task order. Phase-major (no ring): all dh tiles (routed, then shared), all dW_down tiles,
// all dW_gate|up tiles (which may overwrite the dy rows and w h that dW_down has read), all
// dx tiles (which may overwrite the x rows dW_gate|up has read), the combine. Expert-major
// (ring): per routed expert its dh, dx, dW_down and dW_gate|up tiles, then the shared
// expert's tiles phase by phase, then the combine — an expert's rows are done with before
// later experts need the ring.
// Either way a task waits only on lower-numbered tasks (or on comm progress, which waits
// only on lower-numbered tasks). kRing: a kernel of its own, so that the ring's decoding
// costs the default kernel no registers.
template <bool kRing_>
struct Schedule {
  static constexpr bool kRing = kRing_;
  int cta, ctas;  // this CTA among those serving this rank: it takes tasks cta, cta + ctas, ...
  // dW_down tiles cover [H, I] (N-tiles as dh's), dW_gate|up tiles [2I, H] (N-tiles as dx's)
  int m_routed, m_shared, n_dh_r, n_dh_s, n_dx, m_wd, m_wgu_r, m_wgu_s, experts;
  // The routed dW_gate|up and dx N-tiles of this launch, [n_lo, n_hi) of n_dx (BackwardParams::
  // col_begin, col_end; the ring: all). n_lo > 0: a later column block's launch, which runs only
  // those and the combine.
  int n_lo, n_hi;
  int dh_r, dh_s, wd_r, wd_s, wgu_r, wgu_s, dx_r, dx_s, total;  // end of each task range (phase-major)

  // routed_weights = false (the FP8 dgrad kernel before launch_wgrad_fp8): no routed dW_down or
  // dW_gate|up task (phase-major order only).
  __device__ Schedule(const BackwardParams& p, int cta_, int ctas_, bool routed_weights = true) : cta(cta_), ctas(ctas_) {
    const int I = p.routed.inter, Is = p.shared.inter;
    experts = p.num_local_experts;
    m_routed = *p.plan.num_tiles;
    m_shared = p.shared_tiles;
    n_dh_r = ceil_div(I, kBlockN);
    n_dh_s = ceil_div(Is, kBlockN);
    n_dx = ceil_div(p.hidden, kBlockN);
    m_wd = ceil_div(p.hidden, kBlockM);
    m_wgu_r = ceil_div(2 * I, kBlockM);
    m_wgu_s = ceil_div(2 * Is, kBlockM);
    n_lo = kRing ? 0 : col_begin(p) / kBlockN;
    n_hi = kRing ? n_dx : ceil_div(col_end(p), kBlockN);
    const bool first = n_lo == 0, has_shared = first && m_shared > 0, expert_major = kRing;
    const int n_block = n_hi - n_lo;
    // Expert-major: every routed task in the first range, the other routed ranges empty.
    dh_r = expert_major ? m_routed * (n_dh_r + n_dx) + experts * weight_tasks() : first ? m_routed * n_dh_r : 0;
    dh_s = dh_r + (has_shared ? m_shared * n_dh_s : 0);
    wd_r = dh_s + (expert_major || !first || !routed_weights ? 0 : experts * m_wd * n_dh_r);
    wd_s = wd_r + (has_shared ? m_wd * n_dh_s : 0);
    wgu_r = wd_s + (expert_major || !routed_weights ? 0 : experts * m_wgu_r * n_block);
    wgu_s = wgu_r + (has_shared ? m_wgu_s * n_dx : 0);
    dx_r = wgu_s + (expert_major ? 0 : m_routed * n_block);
    dx_s = dx_r + (has_shared ? m_shared * n_dx : 0);
    total = dx_s + ceil_div(p.tokens, kCombineTokens);
  }

  // Weight-gradient tasks of one routed expert.
  __device__ int weight_tasks() const { return m_wd * n_dh_r + m_wgu_r * n_dx; }

  __device__ void decode_expert_major(const BackwardParams& p, int task, Task& t) const {
    const int per_tile = n_dh_r + n_dx, weights = weight_tasks();
    int lo = 0, hi = experts - 1;  // the last expert whose first task is <= task
#pragma unroll 1
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.plan.expert_offset[mid] / kBlockM * per_tile + mid * weights <= task) lo = mid;
      else hi = mid - 1;
    }
    const int first = p.plan.expert_offset[lo] / kBlockM, tiles = p.plan.expert_offset[lo + 1] / kBlockM - first;
    int l = task - (first * per_tile + lo * weights);
    t.e = lo;
    if (l < tiles * n_dh_r) {
      t.kind = kDh, t.n = l / tiles, t.m = first + l % tiles;
      return;
    }
    l -= tiles * n_dh_r;
    if (l < tiles * n_dx) {
      t.kind = kDx, t.n = l / tiles, t.m = first + l % tiles;
      return;
    }
    l -= tiles * n_dx;
    if (l < m_wd * n_dh_r) {
      t.kind = kWd, t.n = l / m_wd, t.m = l % m_wd;
      return;
    }
    l -= m_wd * n_dh_r;
    t.kind = kWgu, t.n = l / m_wgu_r, t.m = l % m_wgu_r;
  }

  // Routed M-tile tasks: N-tile-major inside each expert (the forward's order). Measured on the
  // dx tiles (bench/NOTES.md): N fastest read mixtral-8x7b's backward 18.7 -> 35.7 GB of DRAM,
  // 2.7 % slower (4.7 % on deepseek-v3): its W_gate|up N-tiles were then shared by CTAs 16 apart;
  // bands of 4 or 8 M-tiles read ~3 GB less and ran no faster.
  __device__ static void split_routed(const BackwardParams& p, int local, int n_tiles, Task& t) {
    const int e = expert_of_task(p.plan.expert_offset, p.num_local_experts, local, n_tiles, kBlockM);
    const int first = p.plan.expert_offset[e] / kBlockM, tiles = p.plan.expert_offset[e + 1] / kBlockM - first;
    const int l = local - first * n_tiles;
    t.e = e, t.n = l / tiles, t.m = first + l % tiles;
  }

  // Weight-gradient tasks: expert-major, then N-tile with M-tile fastest — or, n_fastest, the
  // reverse. The index that runs fastest sweeps its operand's whole expert (K = the expert's
  // rows) once for every tile of the other; that operand must stay in L2 between its sweeps.
  __device__ static void split_weight(int local, int m_tiles, int n_tiles, Task& t, bool n_fastest = false) {
    t.e = local / (m_tiles * n_tiles);
    const int l = local % (m_tiles * n_tiles);
    if (n_fastest) t.m = l / n_tiles, t.n = l % n_tiles;
    else t.n = l / m_tiles, t.m = l % m_tiles;
  }
  // Whether a weight-gradient phase runs N fastest: where its N operand's rows are narrower than
  // its M operand's, so the one swept per tile of the other is the smaller per expert. The ring
  // kernels, whose routed tasks go expert by expert, keep M fastest. dW_gate|up (M: dgate|dup
  // rows, 2I columns; N: x rows, H) takes it: with M fastest everywhere, mixtral-8x7b's dgate|dup
  // rows (117 MB an expert, 224 M-tiles: more than a wave of CTAs) were swept once for each of its
  // 16 N-tiles (bench/NOTES.md); its x rows take 16 MB. dW_down (M: dy rows, H; N: w h rows, I)
  // keeps M fastest: its dy rows fit in L2 on every preset (by the rule too it measured within 1 %
  // on deepseek-v3, kimi-k2 and glm-4.5, 53c96e6). Same tiles, same bits: only the order of the
  // tasks changes. Measured on mixtral-8x7b (bench/NOTES.md): the backward kernel's DRAM bytes
  // ~37 -> 22.7 GB, forward+backward 3.5 % faster. MOK_DIAG_WGU_M_FASTEST: the old order.
#if defined(MOK_DIAG_WGU_M_FASTEST)
  static constexpr bool kWguByRule = false;
#else
  static constexpr bool kWguByRule = true;
#endif
  __device__ static bool n_fastest(int m_columns, int n_columns) { return !kRing && n_columns < m_columns; }

  __device__ Task decode(const BackwardParams& p, int task) const {
    Task t{kCombine, false, 0, 0, 0};
    if (task < dh_r) {
      if constexpr (kRing) decode_expert_major(p, task, t);
      else t.kind = kDh, split_routed(p, task, n_dh_r, t);
    } else if (task < dh_s) {
      t.kind = kDh, t.shared = true, t.n = (task - dh_r) / m_shared, t.m = (task - dh_r) % m_shared;
    } else if (task < wd_r) {
      t.kind = kWd, split_weight(task - dh_s, m_wd, n_dh_r, t);
    } else if (task < wd_s) {
      t.kind = kWd, t.shared = true, split_weight(task - wd_r, m_wd, n_dh_s, t);
    } else if (task < wgu_r) {
      t.kind = kWgu, split_weight(task - wd_s, m_wgu_r, n_hi - n_lo, t, kWguByRule && n_fastest(2 * p.routed.inter, p.hidden));
      t.n += n_lo;
    } else if (task < wgu_s) {
      t.kind = kWgu, t.shared = true, split_weight(task - wgu_r, m_wgu_s, n_dx, t, kWguByRule && n_fastest(2 * p.shared.inter, p.hidden));
    } else if (task < dx_r) {
      t.kind = kDx, split_routed(p, task - wgu_s, n_hi - n_lo, t);
      t.n += n_lo;
    } else if (task < dx_s) {
      t.kind = kDx, t.shared = true, t.n = (task - dx_r) / m_shared, t.m = (task - dx_r) % m_shared;
    } else {
      t.m = task - dx_s;
    }
    return t;
  }

  __device__ int n_dh(bool shared) const { return shared ? n_dh_s : n_dh_r; }
  // The plan's routed M-tiles, loaded again where only the combine's one wait needs them
  // (m_routed kept for it across every task was the one value backward_kernel spilled).
  __device__ static int routed_tiles(const BackwardParams& p) { return *p.plan.num_tiles; }
  // The dx tiles done once this launch's are (counted on from the earlier column blocks' launches;
  // the shared expert's, all in the first).
  __device__ int dx_tiles_total(const BackwardParams& p) const {
    return kConsumerWarpgroups * (routed_tiles(p) * n_hi + m_shared * n_dx);
  }
};

struct alignas(1024) SharedStorage {
  struct alignas(1024) Stage {
    std::uint16_t a[kBlockM * kBlockK];  // 16 KB: K-major 128 x 64, or two MN-major boxes
    std::uint16_t b[kBlockN * kBlockK];  // 32 KB: four MN-major boxes
  } stages[kStages];
  union {
    std::uint16_t staging[kConsumerWarpgroups][2 * 64 * 64];  // per warpgroup: 64 x 128 bf16 of a weight gradient
    CommShared comm;  // comm CTAs (which have no epilogues)
  };
  PipelineBarriers<kStages> barriers;
  PushedRows pushed[kConsumerWarpgroups];  // EP: rows pushed (dx rows, partials), not yet published
  ReadCount reads[kConsumerWarpgroups];    // see switch_read()
  // The FP8 dgrad kernel's schedule of this CTA, which its roles read from here once a task (in
  // registers beside the FP8 mainloop's accumulators it spilled; here it takes the slack before
  // the storage's 1024-byte alignment).
  Schedule<false> schedule;
  // The producer's memory across tasks (kept here: at the FP8 dgrad kernel's 40 registers a
  // thread they spilled): the expert (-1: shared; -2: none yet) whose dh tiles this CTA's
  // weight tasks saw done, and whether every routed dW_down tile was seen done (rows_in_grads).
  int rows_seen;
  int dw_down_seen;
  // The FP8 dgrad: stage i's 128 A rows' scale exponent fields (Fp8BackwardParams::dy_exps / dgu_exps;
  // within the struct's 1024-byte padding: no more shared memory).
  alignas(16) std::uint8_t a_exps[kStages][kBlockM];
};
static_assert(shared_storage_bytes<SharedStorage>() <= kMaxSharedMemoryBytes, "shared memory over the sm_90 opt-in limit");
static_assert(kCommStagingBytes <= sizeof(SharedStorage::stages), "comm staging fits the stages");

// The BF16 kernel's params of either kernel's (Fp8BackwardParams: its base), and whether
// a task is one of the FP8 dgrad's (the routed dh and dx tiles).
__device__ __forceinline__ const BackwardParams& base_of(const BackwardParams& p) { return p; }
__device__ __forceinline__ const BackwardParams& base_of(const Fp8BackwardParams& q) { return q.base; }
template <typename Q>
inline constexpr bool kFp8Dgrad = std::is_same_v<Q, Fp8BackwardParams>;
template <typename Q>
__device__ __forceinline__ bool fp8_task(const Task& t) {
  return kFp8Dgrad<Q> && !t.shared && (t.kind == kDh || t.kind == kDx);
}

// First row of an M-tile task's rows (routed: the plan's tile row; shared: token order).
__device__ __forceinline__ int tile_row0(const BackwardParams& p, const Task& t) {
  return t.shared ? t.m * kBlockM : p.plan.tile_row[t.m];
}

// Row range [first, first + count) of the expert of a weight-gradient task (padded to 128).
__device__ __forceinline__ void expert_rows(const BackwardParams& p, const Task& t, int& first, int& count) {
  if (t.shared) {
    first = 0, count = p.shared_tiles * kBlockM;
  } else {
    first = p.plan.expert_offset[t.e], count = p.plan.expert_offset[t.e + 1] - first;
  }
}

// K steps of a weight-gradient task over `count` rows (a multiple of 64): at least one,
// even for an expert without rows (its loads land, its product is not stored: zeros are),
// so that the consumer's stores always wait for a stage of the producer, which waited for
// what the task's stores overwrite (rows_in_grads: every dW_down tile). (The producer
// writes this rule out: calling it there spilled.)
__device__ __forceinline__ int weight_k_steps(int count) { return max(count, kBlockK) / kBlockK; }

__device__ __forceinline__ int dgu_counter(const BackwardParams& p, const Task& t, int m_tile) {
  return t.shared ? p.max_routed_tiles + m_tile : m_tile;
}

// Ring: whether the task reads dy or x rows from the rings (routed dh, dW_down, dW_gate|up
// tasks), the plan rows of minibatch mb, and where plan row `row` sits in a ring.
template <typename Sched>
__device__ __forceinline__ bool reads_ring(const Task& t) {
  return Sched::kRing && !t.shared && t.kind != kDx;
}
__device__ __forceinline__ int minibatch_rows(const BackwardParams& p, int mb) {
  return minibatch_rows(p.ring, p.plan.expert_offset[p.num_local_experts], mb);
}
__device__ __forceinline__ int ring_row(const BackwardParams& p, bool ring, int row) {
  return ring ? row % p.ring.ring_rows : row;
}

// The plan rows [first, first + count) a ring-reading task reads: its M-tile (dh), or its
// expert's rows (weight gradients; none if the expert has no rows).
__device__ __forceinline__ void ring_rows_read(const BackwardParams& p, const Task& t, int& first, int& count) {
  if (t.kind == kDh) first = p.plan.tile_row[t.m], count = kBlockM;
  else expert_rows(p, t, first, count);
}

}  // namespace mok::kernels::bwd
