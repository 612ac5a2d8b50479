// Fused MoE forward, one GPU: one persistent launch, 384 threads per CTA, 1 CTA per SM.
//
//   warpgroup 0 (producer, 40 regs)   fills a 4-stage ring of {A 128x64, B 256x64} tiles:
//   (one thread of it issues every TMA load)
//       GEMM1: A = 128 rows of x_routed (the dispatch kernel's copy of the routed rows,
//              in plan order) or of x (shared expert); B = gate tile (rows 0-127) and
//              up tile (rows 128-255) of the expert. Gathering rows inside the A load
//              (TMA per row or cp.async) measured 1.4-1.5x slower end to end on deepseek-v3.
//       GEMM2: thread 0 waits h_ready[m], then loads h rows and the down tile
//   warpgroups 1, 2 (consumers, 232 regs)  64 rows each: wgmma m64n256k16 over K, then
//       GEMM1 epilogue: h = swiglu(gate, up) -> bf16 -> swizzled staging -> TMA store;
//                       h_ready[m] += 1 (release) once the store completed, one task later
//       GEMM2 epilogue: fp32 rows -> staging -> TMA stores into the slot buffer; y_done +=
//                       tiles (release) when the warpgroup reaches the combine, so no wait
//                       stalls a tile
//       combine:        after y_done is complete, y[t] = shared[t] + sum_j w[t,j]*slot,
//                       in ascending j, fp32 fma, rounded to bf16 once
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

#include "kernels/ep_push.cuh"
#include "kernels/forward.cuh"
#include "kernels/load.cuh"
#include "kernels/persistent.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/ring_copy.cuh"
#include "kernels/slot_rows.cuh"
#include "kernels/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels {
namespace {

using namespace mok::ptx;

constexpr int kRowBytes = kBlockK * 2;


struct alignas(1024) SharedStorage {
  struct alignas(1024) Stage {
    std::uint16_t a[kBlockM * kBlockK];  // 16 KB
    std::uint16_t b[kBlockN * kBlockK];  // 32 KB
  } stages[kStages];
  union {
    std::uint16_t h_staging[kConsumerWarpgroups][2][64 * 64];  // per warpgroup: two 64-column panels
    CommShared comm;  // comm CTAs (which have no epilogues)
  };
  PipelineBarriers<kStages> barriers;
  PushedRows pushed[kConsumerWarpgroups];  // push combine: rows pushed, not yet published
};
static_assert(kCommStagingBytes <= sizeof(SharedStorage::stages), "comm staging fits the stages");
static_assert(kCommWarps <= kThreads / 32);
static_assert(sizeof(SharedStorage::Stage) % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
static_assert(shared_storage_bytes<SharedStorage>() <= 232448, "shared memory over the sm_90 opt-in limit");
static_assert(kBlockK * 2 == 128, "one K step is one 128-byte swizzle atom");
static_assert(kBlockN == 2 * kGemm1Columns && kBlockM == 64 * kConsumerWarpgroups);

constexpr std::uint32_t kStageBytesB = kBlockN * kRowBytes;
constexpr std::uint32_t kStageBytesA = kBlockM * kRowBytes;

enum TaskKind : int { kGemm1, kGemm2, kCombine };

struct Task {
  TaskKind kind;
  bool shared;  // the shared expert's tiles
  int m, n;     // M-tile (per set), N-tile; combine: token block in m
  int mb;       // ring: the minibatch of a routed GEMM1 tile (else -1)
};

// Ring: plan rows of minibatch mb (the last one may be short).
__device__ __forceinline__ int minibatch_rows(const ForwardParams& p, int mb) {
  return minibatch_rows(p.ring, p.expert_offset[p.num_local_experts], mb);
}

// Task ranges of one launch; routed tile count comes from the device plan.
struct Schedule {
  int cta, ctas;  // this CTA among the CTAs serving this rank: it takes tasks cta, cta + ctas, ...
  int m_routed, m_shared, n1_routed, n1_shared, n2, combine_tasks;
  int g1_routed_end, g1_shared_end, g2_routed_end, g2_shared_end, total;

  __device__ Schedule(const ForwardParams& p, int cta_, int ctas_) : cta(cta_), ctas(ctas_) {
    m_routed = *p.num_tiles;
    m_shared = p.shared_tiles;
    n1_routed = (p.inter + kGemm1Columns - 1) / kGemm1Columns;
    n1_shared = (p.shared_inter + kGemm1Columns - 1) / kGemm1Columns;
    n2 = (p.hidden + kBlockN - 1) / kBlockN;
    combine_tasks = (p.tokens + kCombineTokens - 1) / kCombineTokens;
    g1_routed_end = m_routed * n1_routed;
    g1_shared_end = g1_routed_end + m_shared * n1_shared;
    g2_routed_end = g1_shared_end + m_routed * n2;
    g2_shared_end = g2_routed_end + m_shared * n2;
    total = p.gemm1_only ? g1_shared_end : g2_shared_end + combine_tasks;
  }

  // Inside a set of M-tiles, task i is N-tile i / tiles, M-tile first + i % tiles.
  __device__ static void split(int local, int first_tile, int tiles, Task& t) {
    t.n = local / tiles;
    t.m = first_tile + local % tiles;
  }

  // Ring: routed GEMM1 tasks minibatch by minibatch (N-tile-major inside one), so that
  // a minibatch is done with before later ones need its ring slots.
  __device__ void split_minibatch(const ForwardParams& p, int local, Task& t) const {
    const int per = p.ring.minibatch_rows / kBlockM;  // M-tiles of a full minibatch
    t.mb = local / (per * n1_routed);
    const int l = local - t.mb * per * n1_routed, tiles = min(per, m_routed - t.mb * per);
    t.n = l / tiles;
    t.m = t.mb * per + l % tiles;
  }

  // Routed tasks: find the expert whose task range holds `local`, then split inside it.
  __device__ static void split_routed(const ForwardParams& p, int local, int n_tiles, Task& t) {
    const int e = expert_of_task(p.expert_offset, p.num_local_experts, local, n_tiles, kBlockM);
    const int first = p.expert_offset[e] / kBlockM;
    split(local - first * n_tiles, first, p.expert_offset[e + 1] / kBlockM - first, t);
  }

  __device__ Task decode(const ForwardParams& p, int task) const {
    Task t{kCombine, false, 0, 0, -1};
    if (task < g1_routed_end) {
      t.kind = kGemm1;
      if (p.ring.comm_ctas > 0) split_minibatch(p, task, t);
      else split_routed(p, task, n1_routed, t);
    } else if (task < g1_shared_end) {
      t.kind = kGemm1, t.shared = true;
      split(task - g1_routed_end, 0, m_shared, t);
    } else if (task < g2_routed_end) {
      t.kind = kGemm2;
      split_routed(p, task - g1_shared_end, n2, t);
    } else if (task < g2_shared_end) {
      t.kind = kGemm2, t.shared = true;
      split(task - g2_routed_end, 0, m_shared, t);
    } else {
      t.m = task - g2_shared_end;
    }
    return t;
  }
  __device__ int n1(bool shared) const { return shared ? n1_shared : n1_routed; }
  __device__ int slot_tiles_total() const { return kConsumerWarpgroups * (m_routed + m_shared) * n2; }
};

// ---------------------------------------------------------------------------------- producer

// One GPU, x rows in the slot buffer's upper half (kernels/slot_rows.cuh): before the slot
// rows [row0, row0 + 128) are stored, every GEMM1 tile of the x rows under them must have
// read them: M-tiles at or below this tile's, so lower-numbered tasks.
__device__ void wait_x_rows_read(const ForwardParams& p, const Schedule& sched, int row0, int task) {
  const RowRange x = x_rows_under_slots(row0, kBlockM, p.x_rows_in_slots, static_cast<long long>(sched.m_routed) * kBlockM);
  for (long long m = x.first / kBlockM; m * kBlockM < x.end; ++m)
    wait_counter(p, p.counters.h_ready + m, kConsumerWarpgroups * sched.n1_routed, task, WaitSite::x_rows_read);
}

// One thread issues every load; the rest of the warpgroup has nothing to do.
__device__ void run_producer(const ForwardParams& p, SharedStorage& s, const Schedule& sched) {
  Pipeline<kStages> pipe;
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (t.kind == kCombine) break;  // combine tasks come last and load nothing
    const int expert = t.shared ? 0 : p.tile_expert[t.m];
    const int row0 = t.shared ? t.m * kBlockM : p.tile_row[t.m];
    const CUtensorMap *a, *b0, *b1 = nullptr;
    int k_steps, b_row;
    int a_row = row0;
    if (t.kind == kGemm1) {
      if (t.mb >= 0) {  // ring: the minibatch's rows have landed; they sit at row mod ring_rows
        wait_counter(p, p.ring.landed + t.mb, minibatch_rows(p, t.mb), task, WaitSite::forward_landed);
        fence_proxy_async_global();  // written by the comm CTAs' generic stores
        a_row = row0 % p.ring.ring_rows;
      }
      a = t.shared ? &p.maps.x : &p.maps.x_routed;
      b0 = t.shared ? &p.maps.shared_gate : &p.maps.gate;
      b1 = t.shared ? &p.maps.shared_up : &p.maps.up;
      k_steps = p.hidden / kBlockK;
      b_row = t.n * kGemm1Columns;
    } else {
      wait_counter(p, p.counters.h_ready + (t.shared ? p.max_routed_tiles + t.m : t.m),
                   kConsumerWarpgroups * sched.n1(t.shared), task, WaitSite::hidden_ready);
      if (p.x_rows_in_slots > 0 && !t.shared) wait_x_rows_read(p, sched, row0, task);
      fence_proxy_async_global();  // the h rows were written by other CTAs' TMA stores
      a = t.shared ? &p.maps.shared_h_load : &p.maps.h_load;
      b0 = t.shared ? &p.maps.shared_down : &p.maps.down;
      k_steps = (t.shared ? p.shared_inter : p.inter) / kBlockK;
      b_row = t.n * kBlockN;
    }
    for (int kb = 0; kb < k_steps; ++kb) {
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, task, kStageBytesA + kStageBytesB);
      SharedStorage::Stage& stage = s.stages[pipe.stage()];
      tma_load_2d(stage.a, a, full, kb * kBlockK, a_row);
      if (b1) {
        tma_load_3d(stage.b, b0, full, kb * kBlockK, b_row, expert);
        tma_load_3d(stage.b + kGemm1Columns * kBlockK, b1, full, kb * kBlockK, b_row, expert);
      } else {
        tma_load_3d(stage.b, b0, full, kb * kBlockK, b_row, expert);
      }
      pipe.producer_commit();
    }
  }
}

// ---------------------------------------------------------------------------------- consumers

// Completes this warpgroup's previous GEMM1 store and publishes it: h_ready[index] += 1.
// Deferred to the next task so that the store's latency hides behind a mainloop.
__device__ __forceinline__ void publish_hidden(const ForwardParams& p, int& pending_index) {
  if (pending_index < 0) return;
  if (threadIdx.x % 128 == 0) {
    tma_store_wait_all();
    fence_proxy_async_global();
    red_release_gpu_add(p.counters.h_ready + pending_index, 1);
  }
  pending_index = -1;
}

// Training: the gate and up pre-activations of this warpgroup's tile, bf16, into rows of
// [gate (I) | up (I)] for the backward. A value the clamp cut is saved as +-inf: rounding
// to bf16 must not move a value across the limit (the gradient there is zero).
__device__ void save_pre_activations(const ForwardParams& p, const float (&acc)[128], const Task& t, int row0, int wg,
                                     std::uint16_t* gu) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int inter = t.shared ? p.shared_inter : p.inter, n0 = t.n * kGemm1Columns;
  std::uint16_t* rows = gu + static_cast<std::int64_t>(row0 + wg * 64) * 2 * inter;
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const int col = n0 + acc_col(lane, i);
    if (col >= inter) continue;
    std::uint16_t* row = rows + static_cast<std::int64_t>(acc_row(warp, lane, i)) * 2 * inter;
    *reinterpret_cast<std::uint32_t*>(row + col) =
        pack_bf16x2(saved_gate(acc[i], p.swiglu_limit), saved_gate(acc[i + 1], p.swiglu_limit));
    *reinterpret_cast<std::uint32_t*>(row + inter + col) =
        pack_bf16x2(saved_up(acc[i + 64], p.swiglu_limit), saved_up(acc[i + 65], p.swiglu_limit));
  }
}

// h = swiglu(gate, up) of this warpgroup's 64 x 128 tile -> staging (swizzled) -> TMA store,
// published later by publish_hidden().
__device__ void epilogue_gemm1(const ForwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                               int row0, int wg, int& pending_index) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  publish_hidden(p, pending_index);  // its store has also finished reading the staging
  sync_warpgroup(wg);
  char* staging = reinterpret_cast<char*>(s.h_staging[wg]);
#pragma unroll
  for (int i = 0; i < 64; i += 2) {  // gate column c is element i, up column c + 128 is element i + 64
    const int row = acc_row(warp, lane, i), col = acc_col(lane, i);
    const float h0 = swiglu(acc[i], acc[i + 64], p.swiglu_limit);
    const float h1 = swiglu(acc[i + 1], acc[i + 65], p.swiglu_limit);
    *reinterpret_cast<std::uint32_t*>(staging + swizzled_offset(row, col)) = pack_bf16x2(h0, h1);
  }
  if (std::uint16_t* gu = t.shared ? p.shared_saved_gu : p.saved_gu) save_pre_activations(p, acc, t, row0, wg, gu);
  fence_proxy_async_shared_cta();
  sync_warpgroup(wg);
  if (tid == 0) {
    const int inter = t.shared ? p.shared_inter : p.inter;
    const CUtensorMap* h = t.shared ? &p.maps.shared_h_store : &p.maps.h_store;
    const int n0 = t.n * kGemm1Columns, r0 = row0 + wg * 64;
    tma_store_2d(h, s.h_staging[wg][0], n0, r0);
    if (n0 + 64 < inter) tma_store_2d(h, s.h_staging[wg][1], n0 + 64, r0);
    tma_store_commit_group();
  }
  pending_index = t.shared ? p.max_routed_tiles + t.m : t.m;
}

// Publishes this warpgroup's GEMM2 tiles: y_done += count, once their TMA stores have
// completed. Deferred until the combine (the only reader), so the slot stores drain behind
// later mainloops instead of behind a wait.
__device__ __forceinline__ void publish_slots(const ForwardParams& p, int wg, int& pending_tiles) {
  if (pending_tiles == 0) return;
  if (threadIdx.x % 128 == 0) {
    tma_store_wait_all();
    fence_proxy_async_global();
  }
  publish_count(p.counters.y_done, pending_tiles, wg);
  pending_tiles = 0;
}

// fp32 rows of this warpgroup's 64 x 256 tile into the slot buffer (published by
// publish_slots()): four rounds of 64 columns through the warpgroup's 16 KB staging
// buffer, each as two TMA stores of 64 rows x 32 columns (128-byte swizzle).
__device__ void epilogue_gemm2(const ForwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                               int row0, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const CUtensorMap* map = t.shared ? &p.maps.shared_slots : &p.maps.slots;
  char* staging = reinterpret_cast<char*>(s.h_staging[wg]);
  const int n0 = t.n * kBlockN;
#pragma unroll
  for (int round = 0; round < 4; ++round) {
    if (tid == 0) tma_store_wait_read();  // earlier stores (h or slots) have read the staging
    sync_warpgroup(wg);
#pragma unroll
    for (int i = 32 * round; i < 32 * round + 32; i += 2) {
      const int row = acc_row(warp, lane, i), col = acc_col(lane, i) - 64 * round;  // 0..63
      *reinterpret_cast<float2*>(staging + swizzled_offset_bytes(row, col * 4)) = make_float2(acc[i], acc[i + 1]);
    }
    fence_proxy_async_shared_cta();
    sync_warpgroup(wg);
    if (tid == 0) {
      for (int box = 0; box < 2; ++box) {
        const int col = n0 + 64 * round + 32 * box;
        if (col < p.hidden) tma_store_2d(map, staging + box * 64 * 128, col, row0 + wg * 64);
      }
      tma_store_commit_group();
    }
  }
}

// Expert parallelism: fp32 rows of this warpgroup's 64 x 256 tile straight into the slots
// of the rank that owns each token (row t * k + j there); the rows per owner are counted
// in shared memory and published by publish_pushes(), so that no epilogue waits for its
// stores to land (a fence per tile cost 20% on qwen3-30b-a3b).
__device__ void epilogue_gemm2_push(const ForwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                                    int row0, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int n0 = t.n * kBlockN;
  const int pairs_per_rank = p.tokens * p.top_k;
  float* rows[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int pair = p.row_pair[row0 + wg * 64 + warp * 16 + lane / 4 + 8 * half];
    rows[half] = pair < 0 ? nullptr
                          : p.ep.slots[pair / pairs_per_rank] + static_cast<std::int64_t>(pair % pairs_per_rank) * p.hidden + n0;
  }
#pragma unroll
  for (int i = 0; i < 128; i += 2) {
    float* row = rows[(i >> 1) & 1];
    const int col = acc_col(lane, i);
    if (row != nullptr && n0 + col < p.hidden) *reinterpret_cast<float2*>(row + col) = make_float2(acc[i], acc[i + 1]);
  }
  count_pushed_rows(p.ep, p.row_pair, row0 + wg * 64, pairs_per_rank, s.pushed[wg]);
}

__device__ void publish_pushes(const ForwardParams& p, SharedStorage& s, int wg) {
  if (p.ep.push) publish_pushed_rows(p.ep, s.pushed[wg], wg);
}

__device__ void combine(const ForwardParams& p, const Task& t) {
  const int begin = t.m * kCombineTokens, end = min(p.tokens, (t.m + 1) * kCombineTokens);
  const int tid = threadIdx.x - kProducerThreads, threads = 128 * kConsumerWarpgroups;
  if (p.ep.push)
    combine_tokens<true, true, float>(begin, end, p.hidden, p.top_k, nullptr, p.ep.own_ids, p.topk_weights,
                                p.ep.slots[p.ep.rank], p.shared_slots, p.y, tid, threads);
  else
    combine_tokens<true, false, float>(begin, end, p.hidden, p.top_k, p.pair_row, nullptr, p.topk_weights, p.slots,
                                p.shared_slots, p.y, tid, threads);
}

__device__ void run_consumer(const ForwardParams& p, SharedStorage& s, const Schedule& sched, int wg) {
  Pipeline<kStages> pipe;
  float acc[128];
  bool slots_ready = false;
  int pending_hidden = -1;  // h_ready index of a GEMM1 store not yet published
  int pending_slots = 0;    // GEMM2 tiles not yet counted in y_done
  for (int task = sched.cta; task < sched.total; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    // Publish before anything this CTA might wait for: its own GEMM2 loads can need it.
    if (t.kind != kGemm1) publish_hidden(p, pending_hidden);
    if (t.kind == kCombine) {
      if (!slots_ready) {
        publish_slots(p, wg, pending_slots);
        publish_pushes(p, s, wg);
        if (threadIdx.x == kProducerThreads) {
          wait_counter(p, p.counters.y_done, sched.slot_tiles_total(), task, WaitSite::all_gemm2);
          if (p.ep.push)
            for (int q = 0; q < p.ep.size; ++q)
              wait_peer_counter(p, p.ep.slots_done[p.ep.rank] + q, p.ep.expected_rows[q] * sched.n2, task, WaitSite::forward_pushed, q);
        }
        sync_consumers();
        slots_ready = true;
      }
      combine(p, t);
      continue;
    }
    const int row0 = t.shared ? t.m * kBlockM : p.tile_row[t.m];
    const int k_steps = (t.kind == kGemm1 ? p.hidden : (t.shared ? p.shared_inter : p.inter)) / kBlockK;
    mainloop<KMajor, KMajor>(p, s, pipe, acc, k_steps, wg, task);
    if (t.mb >= 0) publish_count(p.ring.freed + t.mb, 1, wg);  // its ring rows are read: the slot may be reused
    if (t.kind == kGemm1) {
      epilogue_gemm1(p, s, acc, t, row0, wg, pending_hidden);
    } else {
      if (p.ep.push && !t.shared) epilogue_gemm2_push(p, s, acc, t, row0, wg);
      else epilogue_gemm2(p, s, acc, t, row0, wg);
      ++pending_slots;
    }
  }
  publish_hidden(p, pending_hidden);
  publish_slots(p, wg, pending_slots);
  publish_pushes(p, s, wg);
}

// Bad routing (expert id out of range, capacity): no GEMM runs, y becomes NaN so the
// failure cannot pass for a result, and the host reports it at the next check.
__device__ void poison_output(const ForwardParams& p, int cta, int ctas) {
  const std::int64_t n = static_cast<std::int64_t>(p.tokens) * p.hidden;
  for (std::int64_t i = cta * blockDim.x + threadIdx.x; i < n; i += static_cast<std::int64_t>(ctas) * blockDim.x)
    if (p.y) p.y[i] = 0x7fc0;  // bf16 quiet NaN (no y in the backward's recompute)
  if (cta == 0 && threadIdx.x == 0) {
    p.status->code = KernelStatus::bad_plan;
    __threadfence_system();
  }
}

// ------------------------------------------------------------------------------- comm CTAs

// Comm CTA `comm` of `comms`: its kCommWarps warps pull the plan's rows into the ring (see
// RingPull); a minibatch's slots are free again once every GEMM1 warpgroup-tile of it has
// read them.
__device__ void run_comm(const ForwardParams& p, SharedStorage& s, int comm, int comms) {
  init_comm(s.comm);
  const int warp = threadIdx.x / 32;
  if (warp >= kCommWarps) return;
  const RingPull<1> pull{{{p.ring.buffer, p.ring.x}}, p.row_pair, p.expert_offset[p.num_local_experts], p.hidden,
                         p.tokens, p.top_k, p.ring};
  const int n1 = (p.inter + kGemm1Columns - 1) / kGemm1Columns;
  CommPipe pipe = comm_pipe(s.stages, s.comm, warp);
  pull.run(p, pipe, comm * kCommWarps + warp, comms * kCommWarps,
           [&](int mb) { return kConsumerWarpgroups * n1 * pull.rows_of(mb) / kBlockM; }, WaitSite::forward_freed, WaitSite::forward_copy);
}

// One rank's forward on CTAs cta = 0 .. ctas - 1 of those serving it.
__device__ __forceinline__ void run_forward(const ForwardParams& p, int cta, int ctas) {
  if (p.ep.stalled) return;
  if (!all_plans_ok(p, false)) {
    poison_output(p, cta, ctas);
    return;
  }
  SharedStorage& s = shared_storage<SharedStorage>();
  s.barriers.init(kConsumerWarpgroups);
  if (threadIdx.x < kConsumerWarpgroups * 2 * kMaxEpRanks) (&s.pushed[0][0][0])[threadIdx.x] = 0;
  if (threadIdx.x == 32) {
    const ForwardMaps& m = p.maps;
    for (const CUtensorMap* map : {&m.x_routed, &m.gate, &m.up, &m.down, &m.h_load, &m.h_store}) tma_prefetch_descriptor(map);
  }
  if (p.saved_marker && cta == 0 && threadIdx.x == 0) *p.saved_marker = kSavedValid;
  __syncthreads();
  if (cta < p.ring.comm_ctas) {  // comm CTAs copy rows and take no tasks
    run_comm(p, s, cta, p.ring.comm_ctas);
    return;
  }
  const Schedule sched(p, cta - p.ring.comm_ctas, ctas - p.ring.comm_ctas);
  split_roles<kProducerRegisters, kConsumerRegisters>([&] { run_producer(p, s, sched); },
                                                      [&](int wg) { run_consumer(p, s, sched, wg); });
}

__global__ void __launch_bounds__(kThreads, 1) forward_kernel(const __grid_constant__ ForwardParams p) {
  run_forward(p, blockIdx.x, gridDim.x);
}

__global__ void __launch_bounds__(kThreads, 1) forward_group_kernel(const __grid_constant__ ForwardGroupParams g) {
  run_forward(g.rank[blockIdx.x / g.ctas_per_rank], blockIdx.x % g.ctas_per_rank, g.ctas_per_rank);
}

}  // namespace

std::size_t forward_shared_memory_bytes() { return shared_storage_bytes<SharedStorage>(); }

void launch_forward(const ForwardParams& params, int num_ctas, cudaStream_t stream) {
  launch_persistent<forward_kernel>(forward_shared_memory_bytes(), kThreads, params, num_ctas, stream);
}

void load_forward_kernels() {
  configure_persistent<forward_kernel>(forward_shared_memory_bytes());
  configure_persistent<forward_group_kernel>(forward_shared_memory_bytes());
}

void launch_forward_group(const ForwardGroupParams& params, cudaStream_t stream) {
  launch_persistent<forward_group_kernel>(forward_shared_memory_bytes(), kThreads, params,
                    params.ranks * params.ctas_per_rank, stream);
}

}  // namespace mok::kernels
