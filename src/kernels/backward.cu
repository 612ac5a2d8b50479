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

#include "kernels/backward.cuh"
#include "kernels/load.cuh"
#include "kernels/ep_push.cuh"
#include "kernels/persistent.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/ring_copy.cuh"
#include "kernels/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"

namespace mok::kernels {
namespace {

using namespace mok::ptx;

// Tile sizes, stages and the CTA layout are the forward's (kernels/forward.cuh, persistent.cuh).
constexpr std::uint32_t kBoxBytes = 64 * 64 * 2;          // one MN-major box {64, 64}
constexpr std::uint32_t kKMajorABytes = kBlockM * kBlockK * 2;  // one K-major A box {64, 128}


struct ReadCount {
  int at;     // the counter (switch_read())
  int count;  // tiles not yet counted in it
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
};
static_assert(shared_storage_bytes<SharedStorage>() <= 232448, "shared memory over the sm_90 opt-in limit");
static_assert(kCommStagingBytes <= sizeof(SharedStorage::stages), "comm staging fits the stages");

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
  int dh_r, dh_s, wd_r, wd_s, wgu_r, wgu_s, dx_r, dx_s, total;  // end of each task range (phase-major)

  __device__ Schedule(const BackwardParams& p, int cta_, int ctas_) : cta(cta_), ctas(ctas_) {
    const int I = p.routed.inter, Is = p.shared.inter;
    experts = p.num_local_experts;
    m_routed = *p.num_tiles;
    m_shared = p.shared_tiles;
    n_dh_r = ceil_div(I, kBlockN);
    n_dh_s = ceil_div(Is, kBlockN);
    n_dx = ceil_div(p.hidden, kBlockN);
    m_wd = ceil_div(p.hidden, kBlockM);
    m_wgu_r = ceil_div(2 * I, kBlockM);
    m_wgu_s = ceil_div(2 * Is, kBlockM);
    const bool has_shared = m_shared > 0, expert_major = kRing;
    // Expert-major: every routed task in the first range, the other routed ranges empty.
    dh_r = expert_major ? m_routed * (n_dh_r + n_dx) + experts * weight_tasks() : m_routed * n_dh_r;
    dh_s = dh_r + m_shared * n_dh_s;
    wd_r = dh_s + (expert_major ? 0 : experts * m_wd * n_dh_r);
    wd_s = wd_r + (has_shared ? m_wd * n_dh_s : 0);
    wgu_r = wd_s + (expert_major ? 0 : experts * m_wgu_r * n_dx);
    wgu_s = wgu_r + (has_shared ? m_wgu_s * n_dx : 0);
    dx_r = wgu_s + (expert_major ? 0 : m_routed * n_dx);
    dx_s = dx_r + m_shared * n_dx;
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
      if (p.expert_offset[mid] / kBlockM * per_tile + mid * weights <= task) lo = mid;
      else hi = mid - 1;
    }
    const int first = p.expert_offset[lo] / kBlockM, tiles = p.expert_offset[lo + 1] / kBlockM - first;
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

  // Routed M-tile tasks: N-tile-major inside each expert (the forward's order).
  __device__ static void split_routed(const BackwardParams& p, int local, int n_tiles, Task& t) {
    const int e = expert_of_task(p.expert_offset, p.num_local_experts, local, n_tiles, kBlockM);
    const int first = p.expert_offset[e] / kBlockM, tiles = p.expert_offset[e + 1] / kBlockM - first;
    const int l = local - first * n_tiles;
    t.e = e, t.n = l / tiles, t.m = first + l % tiles;
  }
  // Weight-gradient tasks: expert-major, then N-tile, M-tile fastest.
  __device__ static void split_weight(int local, int m_tiles, int n_tiles, Task& t) {
    t.e = local / (m_tiles * n_tiles);
    const int l = local % (m_tiles * n_tiles);
    t.n = l / m_tiles, t.m = l % m_tiles;
  }

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
      t.kind = kWgu, split_weight(task - wd_s, m_wgu_r, n_dx, t);
    } else if (task < wgu_s) {
      t.kind = kWgu, t.shared = true, split_weight(task - wgu_r, m_wgu_s, n_dx, t);
    } else if (task < dx_r) {
      t.kind = kDx, split_routed(p, task - wgu_s, n_dx, t);
    } else if (task < dx_s) {
      t.kind = kDx, t.shared = true, t.n = (task - dx_r) / m_shared, t.m = (task - dx_r) % m_shared;
    } else {
      t.m = task - dx_s;
    }
    return t;
  }

  __device__ int n_dh(bool shared) const { return shared ? n_dh_s : n_dh_r; }
  __device__ int dx_tiles_total() const { return kConsumerWarpgroups * (m_routed + m_shared) * n_dx; }
};

// First row of an M-tile task's rows (routed: the plan's tile row; shared: token order).
__device__ __forceinline__ int tile_row0(const BackwardParams& p, const Task& t) {
  return t.shared ? t.m * kBlockM : p.tile_row[t.m];
}

// Row range [first, first + count) of the expert of a weight-gradient task (padded to 128).
__device__ __forceinline__ void expert_rows(const BackwardParams& p, const Task& t, int& first, int& count) {
  if (t.shared) {
    first = 0, count = p.shared_tiles * kBlockM;
  } else {
    first = p.expert_offset[t.e], count = p.expert_offset[t.e + 1] - first;
  }
}

__device__ __forceinline__ int* wd_done(const BackwardParams& p) { return p.counters.abort + 1; }

// K steps of a weight-gradient task over `count` rows (a multiple of 128): at least one,
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
  return minibatch_rows(p.ring, p.expert_offset[p.num_local_experts], mb);
}
__device__ __forceinline__ int ring_row(const BackwardParams& p, bool ring, int row) {
  return ring ? row % p.ring.ring_rows : row;
}

// The plan rows [first, first + count) a ring-reading task reads: its M-tile (dh), or its
// expert's rows (weight gradients; none if the expert has no rows).
__device__ __forceinline__ void ring_rows_read(const BackwardParams& p, const Task& t, int& first, int& count) {
  if (t.kind == kDh) first = p.tile_row[t.m], count = kBlockM;
  else expert_rows(p, t, first, count);
}

// ---------------------------------------------------------------------------------- producer

// One thread issues every load. Boxes entirely past the matrix edge are not loaded: their
// accumulator rows/columns are never stored.
template <typename Sched>
__device__ void run_producer(const BackwardParams& p, SharedStorage& s, const Sched& sched) {
  Pipeline<kStages> pipe;
  int rows_seen = -2;  // the expert (-1: shared) whose dh tiles this CTA's weight tasks saw done
  bool dw_down_seen = false;  // rows_in_grads: every routed dW_down tile seen done
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
        counter = p.counters.dgu_ready + (over_x ? p.expert_offset[t.e] / kBlockM : dgu_counter(p, t, t.m));
        expected = kConsumerWarpgroups * (sched.n_dh(t.shared) + (over_x ? sched.m_wgu_r * sched.n_dx : 0));
        if constexpr (Sched::kRing) wait_counter(p, counter, expected, task, site);  // (here: fewer registers)
      }
      k_steps = (t.kind == kDh ? p.hidden : 2 * inter) / kBlockK;
    } else {
      int count = 0;
      expert_rows(p, t, row0, count);
      // Its expert's dh tiles, once per run of tasks of one expert (a CTA takes ~tasks / CTAs
      // in a row): each wait is a round trip to L2 before the task's first load.
      const int expert = t.shared ? -1 : t.e;
      if (Sched::kRing || expert != rows_seen)  // (the ring kernel: every time; skipping there spilled)
        for (int m = row0 / kBlockM; m < (row0 + count) / kBlockM; ++m)
          wait_counter(p, p.counters.dgu_ready + dgu_counter(p, t, m), kConsumerWarpgroups * sched.n_dh(t.shared),
                       task, WaitSite::expert_dh_ready);
      if constexpr (!Sched::kRing) rows_seen = expert;
      if (!Sched::kRing && p.rows_in_grads && t.kind == kWgu && !t.shared && !dw_down_seen) {
        counter = wd_done(p);
        expected = kConsumerWarpgroups * sched.experts * sched.m_wd * sched.n_dh_r;
        site = WaitSite::grad_rows_read;
      }
      k_steps = count / kBlockK;
    }
    if (k_steps == 0) k_steps = 1;  // weight_k_steps() (dh and dx tasks have more)
    if (!Sched::kRing && counter != nullptr) {
      wait_counter(p, counter, expected, task, site);
      dw_down_seen = dw_down_seen || site == WaitSite::grad_rows_read;  // (it stays done)
    }
    if (t.kind != kDh) fence_proxy_async_global();  // dgu, w h written by generic stores of other CTAs
    // Boxes of this task: A (K-major: one; MN-major: up to two), B (up to four MN-major).
    const int n0 = t.n * kBlockN, m0 = t.m * kBlockM;
    const int b_limit = t.kind == kDh ? inter : t.kind == kWd ? inter : p.hidden;
    const int a_limit = t.kind == kWd ? p.hidden : 2 * inter;
    int b_boxes = 0, a_boxes = 1;
    while (b_boxes < 4 && n0 + 64 * b_boxes < b_limit) ++b_boxes;
    if (t.kind == kWd || t.kind == kWgu) a_boxes = m0 + 64 < a_limit ? 2 : 1;
    const std::uint32_t a_bytes = (t.kind == kDh || t.kind == kDx) ? kKMajorABytes : a_boxes * kBoxBytes;
    const std::uint32_t bytes = a_bytes + b_boxes * kBoxBytes;
    // Where the dy / x rows of the next load sit: plan row row0 (dh), row0 + k0 (weight
    // gradients: advanced by each K step), mod ring_rows in a ring.
    int rows_at = ring_row(p, ring, row0);
    for (int kb = 0; kb < k_steps; ++kb) {
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, bytes);
      SharedStorage::Stage& st = s.stages[pipe.stage()];
      const int k0 = kb * kBlockK;
      switch (t.kind) {
        case kDh:
          tma_load_2d(st.a, &maps.dy_k, full, k0, rows_at);
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
            tma_load_2d(st.a + w * 4096, &maps.dy_mn, full, m0 + 64 * w, rows_at);
          for (int c = 0; c < b_boxes; ++c) tma_load_2d(st.b + c * 4096, &maps.hw_mn, full, n0 + 64 * c, row0 + k0);
          break;
        default:  // kWgu
          for (int w = 0; w < a_boxes; ++w) tma_load_2d(st.a + w * 4096, &maps.dgu_mn, full, m0 + 64 * w, row0 + k0);
          for (int c = 0; c < b_boxes; ++c)
            tma_load_2d(st.b + c * 4096, &maps.x_mn, full, n0 + 64 * c, rows_at);
          break;
      }
      if (t.kind == kWd || t.kind == kWgu) {  // the next 64 rows (ring_rows is a multiple of 64)
        rows_at += kBlockK;
        if (ring && rows_at == p.ring.ring_rows) rows_at = 0;
      }
      pipe.producer_commit();
    }
  }
}

// ---------------------------------------------------------------------------------- consumers

// dh tile epilogue (see the header comment). Writes every row of the tile, zeros on rows
// that are padding (routed) or past T (shared).
__device__ void epilogue_dh(const BackwardParams& p, const float (&acc)[128], const Task& t, int row0, int wg,
                            int n_tiles) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const ExpertSetData& d = t.shared ? p.shared : p.routed;
  const int inter = d.inter, n0 = t.n * kBlockN;
  std::int64_t row[2];
  float weight[2];
  bool valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = row0 + wg * 64 + warp * 16 + lane / 4 + 8 * h;
    if (t.shared) {
      valid[h] = row[h] < p.tokens;
      weight[h] = 1.0f;
    } else {
      const int pair = p.row_pair[row[h]];
      valid[h] = pair >= 0;
      weight[h] = valid[h] ? p.topk_weights[pair] : 0.0f;
    }
  }
  float partial[2] = {0.0f, 0.0f};
  constexpr int kGroup = 16;  // accumulators whose g, u loads are in flight together
#pragma unroll
  for (int i0 = 0; i0 < 128; i0 += kGroup) {
    std::uint32_t g[kGroup / 2], u[kGroup / 2];
#pragma unroll
    for (int i = i0; i < i0 + kGroup; i += 2) {
      const int h = (i >> 1) & 1, col = n0 + acc_col(lane, i);
      const std::int64_t at = row[h] * 2 * inter + col;
      const bool load = valid[h] && col < inter;
      g[(i - i0) / 2] = load ? ld_global_ordered(d.gu + at) : 0u;
      u[(i - i0) / 2] = load ? ld_global_ordered(d.gu + at + inter) : 0u;
    }
#pragma unroll
    for (int i = i0; i < i0 + kGroup; i += 2) {
      const int h = (i >> 1) & 1, col = n0 + acc_col(lane, i);
      if (col >= inter) continue;
      const std::int64_t at = row[h] * 2 * inter + col;
      std::uint32_t dg = 0, du = 0, hw = 0;
      if (valid[h]) {
        const float2 gv = unpack_bf16x2(g[(i - i0) / 2]), uv = unpack_bf16x2(u[(i - i0) / 2]);
        const SwigluGrad r0 = swiglu_backward(gv.x, uv.x, __fmul_rn(weight[h], acc[i]), p.swiglu_limit);
        const SwigluGrad r1 = swiglu_backward(gv.y, uv.y, __fmul_rn(weight[h], acc[i + 1]), p.swiglu_limit);
        partial[h] = __fmaf_rn(r0.hidden, acc[i], partial[h]);
        partial[h] = __fmaf_rn(r1.hidden, acc[i + 1], partial[h]);
        dg = pack_bf16x2(r0.d_gate, r1.d_gate);
        du = pack_bf16x2(r0.d_up, r1.d_up);
        hw = pack_bf16x2(__fmul_rn(weight[h], r0.hidden), __fmul_rn(weight[h], r1.hidden));
      }
      st_global_ordered(d.gu + at, dg);  // in place: this thread just read these two values
      st_global_ordered(d.gu + at + inter, du);
      st_global_ordered(d.hw + row[h] * inter + col, hw);
    }
  }
  if (!t.shared) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the four lanes of a quad hold one row: a fixed tree
      float v = partial[h];
      v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
      v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
      if (lane % 4 != 0 || !valid[h]) continue;
      if (p.ep.push) {  // into the owner's partials, at its pair t * k + j
        const int pair = p.row_pair[row[h]], pairs_per_rank = p.tokens * p.top_k;
        float* partials = reinterpret_cast<float*>(reinterpret_cast<std::uint16_t*>(p.ep.slots[pair / pairs_per_rank]) +
                                                   static_cast<std::int64_t>(pairs_per_rank) * p.hidden);
        partials[static_cast<std::int64_t>(pair % pairs_per_rank) * n_tiles + t.n] = v;
      } else {
        p.dw_partial[row[h] * n_tiles + t.n] = v;
      }
    }
  }
}

// f32 weight gradient: the warpgroup's 64 x 256 tile added into rows of [rows, cols] where
// a row pointer is given (one owner per element: a plain read-modify-write). empty: the
// expert has no rows (nothing to add; acc was never written).
__device__ void accumulate_weight_grad(const float (&acc)[128], void* const (&row)[2], int n0, int cols, bool empty) {
  if (empty) return;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 128; i += 2) {
    const int h = (i >> 1) & 1, col = n0 + acc_col(lane, i);
    if (row[h] == nullptr || col >= cols) continue;
    float2* out = reinterpret_cast<float2*>(static_cast<float*>(row[h]) + col);
    const float2 old = *out;
    *out = make_float2(__fadd_rn(old.x, acc[i]), __fadd_rn(old.y, acc[i + 1]));
  }
}

// EP: the dx rows of this warpgroup's 64 x 256 tile as bf16 straight into the slots of
// the tokens' owners (row t * k + j there); publish_pushes() counts them later.
__device__ void push_dx_rows(const BackwardParams& p, const float (&acc)[128], int n0, int row0) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, pairs_per_rank = p.tokens * p.top_k;
  std::uint16_t* rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pair = p.row_pair[row0 + warp * 16 + lane / 4 + 8 * h];
    rows[h] = pair < 0 ? nullptr
                       : reinterpret_cast<std::uint16_t*>(p.ep.slots[pair / pairs_per_rank]) +
                             static_cast<std::int64_t>(pair % pairs_per_rank) * p.hidden + n0;
  }
#pragma unroll
  for (int i = 0; i < 128; i += 2) {
    std::uint16_t* row = rows[(i >> 1) & 1];
    const int col = acc_col(lane, i);
    if (row != nullptr && n0 + col < p.hidden) st_global_ordered(row + col, pack_bf16x2(acc[i], acc[i + 1]));
  }
}

// A bf16 64 x 256 tile of this warpgroup leaves through its swizzled staging buffer in
// two 64 x 128 halves, each as two TMA stores to (col0 + 64 i, row, layer) of `map`
// (clipped at the matrix edges, skipped when row >= rows or the column >= cols), so the
// writes drain while the next tile's mainloop runs. zero: store zeros instead of acc.
__device__ void store_tile_tma(SharedStorage& s, const float (&acc)[128], int wg, const CUtensorMap* map, int col0,
                               int row, int layer, int rows, int cols, bool zero) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  char* staging = reinterpret_cast<char*>(s.staging[wg]);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (tid == 0) tma_store_wait_read();  // the previous stores have read the staging
    sync_warpgroup(wg);
#pragma unroll
    for (int i = 64 * half; i < 64 * half + 64; i += 2) {
      const int r = acc_row(warp, lane, i), c = acc_col(lane, i) - 128 * half;
      *reinterpret_cast<std::uint32_t*>(staging + swizzled_offset(r, c)) = zero ? 0u : pack_bf16x2(acc[i], acc[i + 1]);
    }
    fence_proxy_async_shared_cta();
    sync_warpgroup(wg);
    if (tid == 0 && row < rows) {
      for (int panel = 0; panel < 2; ++panel) {
        const int col = col0 + 128 * half + 64 * panel;
        if (col < cols) tma_store_3d(map, s.staging[wg] + panel * 64 * 64, col, row, layer);
      }
      tma_store_commit_group();
    }
  }
}

// bf16 weight gradient tile (empty: the expert has no rows, the gradient is zero).
__device__ void store_weight_grad_tma(const BackwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                                      int wg, bool empty) {
  const ExpertSetMaps& maps = t.shared ? p.shared_maps : p.routed_maps;
  const int H = p.hidden, I = (t.shared ? p.shared : p.routed).inter;
  const int row0 = t.m * kBlockM + wg * 64;
  if (t.kind == kWd) {
    store_tile_tma(s, acc, wg, &maps.d_down, t.n * kBlockN, row0, t.e, H, I, empty);
  } else {  // rows [0, I) of the tile space are W_gate's, [I, 2I) W_up's (I % 64 == 0)
    const bool gate = row0 < I;
    store_tile_tma(s, acc, wg, gate ? &maps.d_gate : &maps.d_up, t.n * kBlockN, gate ? row0 : row0 - I, t.e,
                   gate ? I : (row0 < 2 * I ? I : 0), H, empty);
  }
}

__device__ void epilogue_weight(const BackwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                                int wg, bool empty) {
  if (!p.grad_fp32) {
    store_weight_grad_tma(p, s, acc, t, wg, empty);
    return;
  }
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const ExpertSetData& d = t.shared ? p.shared : p.routed;
  const int H = p.hidden, I = d.inter;
  void* row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = t.m * kBlockM + wg * 64 + warp * 16 + lane / 4 + 8 * h;
    const std::int64_t expert = static_cast<std::int64_t>(t.e) * H * I;  // elements of one expert's matrix
    float* base = nullptr;
    if (t.kind == kWd) {  // dW_down [E, H, I]: row m < H
      if (m < H) base = static_cast<float*>(d.d_down) + expert + static_cast<std::int64_t>(m) * I;
    } else if (m < I) {  // dW_gate [E, I, H]
      base = static_cast<float*>(d.d_gate) + expert + static_cast<std::int64_t>(m) * H;
    } else if (m < 2 * I) {
      base = static_cast<float*>(d.d_up) + expert + static_cast<std::int64_t>(m - I) * H;
    }
    row[h] = base;
  }
  accumulate_weight_grad(acc, row, t.n * kBlockN, t.kind == kWd ? I : H, empty);
}

// dx for a block of tokens, then d_topk_weights[t, j] = sum over N-tiles of the row's
// partials, in N order (0 for a slot without an expert).
// EP: the owner's combine, from the rows and partials its peers pushed.
template <typename Sched>
__device__ void combine_pushed(const BackwardParams& p, const Task& t, const Sched& sched) {
  const int tid = threadIdx.x - kProducerThreads, threads = 128 * kConsumerWarpgroups;
  const int begin = t.m * kCombineTokens, end = min(p.tokens, begin + kCombineTokens);
  const int pairs_per_rank = p.tokens * p.top_k;
  const auto* rows = reinterpret_cast<const std::uint16_t*>(p.ep.slots[p.ep.rank]);
  const auto* partials = reinterpret_cast<const float*>(rows + static_cast<std::int64_t>(pairs_per_rank) * p.hidden);
  combine_tokens<false, true, std::uint16_t>(begin, end, p.hidden, p.top_k, nullptr, p.ep.own_ids, nullptr, rows,
                                             p.shared.dx_rows, p.dx, tid, threads);
  for (int i = begin * p.top_k + tid; i < end * p.top_k; i += threads) {
    float v = 0.0f;
    if (p.ep.own_ids[i] >= 0)
      for (int n = 0; n < sched.n_dh_r; ++n) v = __fadd_rn(v, partials[static_cast<std::int64_t>(i) * sched.n_dh_r + n]);
    p.d_topk_weights[i] = v;
  }
}

template <typename Sched>
__device__ void combine(const BackwardParams& p, const Task& t, const Sched& sched) {
  if (p.ep.push) {
    combine_pushed(p, t, sched);
    return;
  }
  const int tid = threadIdx.x - kProducerThreads, threads = 128 * kConsumerWarpgroups;
  const int begin = t.m * kCombineTokens, end = min(p.tokens, begin + kCombineTokens);
  combine_tokens<false, false, std::uint16_t>(begin, end, p.hidden, p.top_k, p.pair_row, nullptr, nullptr, p.routed.dx_rows,
                                       p.shared.dx_rows, p.dx, tid, threads);
  for (int i = begin * p.top_k + tid; i < end * p.top_k; i += threads) {
    const int row = p.pair_row[i];
    float v = 0.0f;
    if (row >= 0)
      for (int n = 0; n < sched.n_dh_r; ++n) v = __fadd_rn(v, p.dw_partial[static_cast<std::int64_t>(row) * sched.n_dh_r + n]);
    p.d_topk_weights[i] = v;
  }
}

// dx_done += this warpgroup's dx tiles, once their TMA stores have completed (the
// combine reads the rows with plain loads). Deferred until the combine.
__device__ void publish_dx_rows(const BackwardParams& p, int wg, int& pending) {
  if (pending == 0) return;
  if (threadIdx.x % 128 == 0) {
    tma_store_wait_all();
    fence_proxy_async_global();
  }
  publish_count(p.counters.dx_done, pending, wg);
  pending = 0;
}

// EP: publishes, per owner, the rows this warpgroup pushed (dx rows and d_topk_weights
// partials) in its routed dh and dx tasks before `end`. Counted here, once, from the task
// list rather than in each epilogue: the consumer loop has no registers to spare.
template <typename Sched>
__device__ void publish_pushes(const BackwardParams& p, SharedStorage& s, const Sched& sched, int wg, int end) {
  for (int task = sched.cta; task < end; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (!t.shared && (t.kind == kDh || t.kind == kDx))
      count_pushed_rows(p.ep, p.row_pair, tile_row0(p, t) + wg * 64, p.tokens * p.top_k, s.pushed[wg]);
  }
  publish_pushed_rows(p.ep, s.pushed[wg], wg);
}

// Ring: this warpgroup has read the task's dy / x rows (its mainloop is done): freed[mb] += 1
// for every minibatch they lie in.
__device__ void free_ring_rows(const BackwardParams& p, const Task& t, int wg) {
  int first = 0, count = 0;
  ring_rows_read(p, t, first, count);
  const int per = p.ring.minibatch_rows;
  for (int mb = first / per; count > 0 && mb <= (first + count - 1) / per; ++mb) publish_count(p.ring.freed + mb, 1, wg);
}

// Weight tiles that have read their rows (see the dx and dW_gate|up waits) are counted by
// thread 0 of their warpgroup in shared memory and released when the warpgroup moves on to
// a task that counts elsewhere (another expert, another phase) — before that task can wait
// for anything — rather than with a fence per tile (that cost ~1.5 % of fwd+bwd). Thread 0
// saw every load of those tiles land (the full barriers): its release orders them; no other
// thread's writes are published. (Counters as indices: pointers in registers spilled.)
constexpr int kReadNone = -1, kReadWdDone = -2;  // else an index into dgu_ready

__device__ __forceinline__ int read_counter(const BackwardParams& p, const Task& t) {
  if (!t.shared && t.kind == kWgu && p.dx_over_x) return p.expert_offset[t.e] / kBlockM;
  if (!t.shared && t.kind == kWd && p.rows_in_grads) return kReadWdDone;
  return kReadNone;
}

__device__ __forceinline__ void switch_read(const BackwardParams& p, ReadCount& r, int at) {
  if (threadIdx.x % 128 != 0 || at == r.at) return;
  if (r.count > 0) red_release_gpu_add(r.at == kReadWdDone ? wd_done(p) : p.counters.dgu_ready + r.at, r.count);
  r.at = at, r.count = 0;
}

template <typename Sched>
__device__ void run_consumer(const BackwardParams& p, SharedStorage& s, const Sched& sched, int wg) {
  Pipeline<kStages> pipe;
  float acc[128];
  bool rows_ready = false;
  int pending_dx = 0;  // dx tiles not yet counted in dx_done
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    const int read = read_counter(p, t);
    switch_read(p, s.reads[wg], read);
    if (t.kind == kCombine) {
      if (!rows_ready) {
        publish_dx_rows(p, wg, pending_dx);
        if (p.ep.push) publish_pushes(p, s, sched, wg, task);
        if (threadIdx.x == kProducerThreads) {
          wait_counter(p, p.counters.dx_done, sched.dx_tiles_total(), task, WaitSite::all_dx);
          for (int m = 0; m < sched.m_routed; ++m)  // the d_topk_weights partials (already complete)
            wait_counter(p, p.counters.dgu_ready + m, kConsumerWarpgroups * sched.n_dh_r, task, WaitSite::dh_ready);
          if (p.ep.push)  // every pushed dx row and partial of this rank's tokens
            for (int q = 0; q < p.ep.size; ++q)
              wait_peer_counter(p, p.ep.slots_done[p.ep.rank] + q, p.ep.expected_rows[q] * (sched.n_dx + sched.n_dh_r),
                                task, WaitSite::backward_pushed, q);
        }
        sync_consumers();
        rows_ready = true;
      }
      combine(p, t, sched);
      continue;
    }
    const ExpertSetData& d = t.shared ? p.shared : p.routed;
    if (t.kind == kDh || t.kind == kDx) {
      const int row0 = tile_row0(p, t);
      if (t.kind == kDh) {
        mainloop<KMajor, MnMajor>(p, s, pipe, acc, p.hidden / kBlockK, wg, task);
        epilogue_dh(p, acc, t, row0, wg, sched.n_dh(t.shared));
        if (reads_ring<Sched>(t)) free_ring_rows(p, t, wg);  // (after the epilogue: acc's registers are free)
        fence_proxy_async_global();  // TMA loads of other CTAs read these rows next
        publish_count(p.counters.dgu_ready + dgu_counter(p, t, t.m), 1, wg);
      } else {
        mainloop<KMajor, MnMajor>(p, s, pipe, acc, 2 * d.inter / kBlockK, wg, task);
        const ExpertSetMaps& maps = t.shared ? p.shared_maps : p.routed_maps;
        const bool push = p.ep.push && !t.shared;
        if (push) push_dx_rows(p, acc, t.n * kBlockN, row0 + wg * 64);
        else store_tile_tma(s, acc, wg, &maps.dx_rows, t.n * kBlockN, row0 + wg * 64, 0, 1 << 30, p.hidden, false);
        ++pending_dx;
      }
    } else {
      int first = 0, count = 0;
      expert_rows(p, t, first, count);
      mainloop<MnMajor, MnMajor>(p, s, pipe, acc, weight_k_steps(count), wg, task);
      epilogue_weight(p, s, acc, t, wg, count == 0);
      if (threadIdx.x % 128 == 0 && read != kReadNone && (count > 0 || t.kind == kWd))  // (an expert without
        ++s.reads[wg].count;                                                             //  rows has no dx tiles)
      if (reads_ring<Sched>(t)) free_ring_rows(p, t, wg);
    }
  }
  switch_read(p, s.reads[wg], kReadNone);
  publish_dx_rows(p, wg, pending_dx);
  if (p.ep.push && !rows_ready) publish_pushes(p, s, sched, wg, sched.total);
  if (threadIdx.x % 128 == 0) tma_store_wait_all();  // weight-gradient stores complete before exit
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
__device__ void run_comm(const BackwardParams& p, const RingSources& sources, SharedStorage& s, int comm, int comms) {
  init_comm(s.comm);
  const int warp = threadIdx.x / 32;
  if (warp >= kCommWarps) return;
  const RingPull<2> pull{{{p.ring.dy_buffer, sources.dy}, {p.ring.x_buffer, sources.x}}, p.row_pair,
                         p.expert_offset[p.num_local_experts], p.hidden, p.tokens, p.top_k, p.ring};
  const Schedule<true> sched(p, 0, 1);  // (for its tile counts)
  CommPipe pipe = comm_pipe(s.stages, s.comm, warp);
  const auto expected_freed = [&](int mb) {
    const int begin = mb * p.ring.minibatch_rows, end = begin + pull.rows_of(mb);
    int tasks = sched.n_dh_r * (end - begin) / kBlockM;
    for (int e = 0; e < p.num_local_experts; ++e) {
      const int lo = p.expert_offset[e], hi = p.expert_offset[e + 1];
      if (lo < hi && lo < end && hi > begin) tasks += sched.weight_tasks();
    }
    return kConsumerWarpgroups * tasks;
  };
  pull.run(p, pipe, comm * kCommWarps + warp, comms * kCommWarps, expected_freed, WaitSite::backward_freed, WaitSite::backward_copy);
}

// One rank's backward on CTAs cta = 0 .. ctas - 1 of those serving it.
template <bool kRing>
__device__ __forceinline__ void run_backward(const BackwardParams& p, const RingSources& sources, int cta, int ctas) {
  if (p.ep.stalled) return;
  if (!all_plans_ok(p, true)) {
    poison_output(p, KernelStatus::bad_plan, cta, ctas);
    return;
  }
  // Never filled by a forward, or consumed by an earlier backward. EP: on any rank, or
  // a rank that stops here would leave its peers waiting for its pushes.
  bool saved_ok = *p.saved_marker == kSavedValid;
  if (p.ep.push && p.ep.header == nullptr)  // (separate launches: checked through the plan flags above)
    for (int q = 0; q < p.ep.size; ++q) saved_ok = saved_ok && *p.ep.saved_marker[q] == kSavedValid;
  if (!saved_ok) {
    poison_output(p, KernelStatus::saved_not_valid, cta, ctas);
    return;
  }
  SharedStorage& s = shared_storage<SharedStorage>();
  s.barriers.init(kConsumerWarpgroups);
  if (threadIdx.x < kConsumerWarpgroups * 2 * kMaxEpRanks) (&s.pushed[0][0][0])[threadIdx.x] = 0;
  if (threadIdx.x < kConsumerWarpgroups) s.reads[threadIdx.x] = {-1, 0};  // (kReadNone)
  __syncthreads();
  if (kRing && cta < p.ring.comm_ctas) {  // comm CTAs pull rows and take no tasks
    run_comm(p, sources, s, cta, p.ring.comm_ctas);
    return;
  }
  const Schedule<kRing> sched(p, cta - p.ring.comm_ctas, ctas - p.ring.comm_ctas);
  split_roles<kProducerRegisters, kConsumerRegisters>([&] { run_producer(p, s, sched); },
                                                      [&](int wg) { run_consumer(p, s, sched, wg); });
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

void load_backward_kernels() {
  configure_persistent<backward_kernel<false>>(backward_shared_memory_bytes());
  configure_persistent<backward_kernel<true>>(backward_shared_memory_bytes());
  configure_persistent<backward_group_kernel<false>>(backward_shared_memory_bytes());
  configure_persistent<backward_group_kernel<true>>(backward_shared_memory_bytes());
}

// (Every rank of a group has the same ring configuration.)
void launch_backward_group(const BackwardGroupParams& params, cudaStream_t stream) {
  const int ctas = params.ranks * params.ctas_per_rank;
  if (params.rank[0].ring.comm_ctas > 0)
    launch_persistent<backward_group_kernel<true>>(backward_shared_memory_bytes(), kThreads, params, ctas, stream);
  else launch_persistent<backward_group_kernel<false>>(backward_shared_memory_bytes(), kThreads, params, ctas, stream);
}

}  // namespace mok::kernels
