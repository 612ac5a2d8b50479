// The fused backward's consumer epilogues (dh, weight gradients, dx rows and their pushes),
// the combine, and how consumer warpgroups publish what they have done.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/backward/backward.cuh"
#include "kernels/ep/ep_push.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "kernels/common/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "kernels/backward/tasks.cuh"

namespace mok::kernels::bwd {

using namespace mok::ptx;

// ---------------------------------------------------------------------------------- consumers

// Byte offset of byte `byte` (< 64) of row `row` in a 64-row tile of 64-byte rows, with
// the 16-byte chunks of a row permuted by (row / 2) % 4: the accumulators' 4-byte accesses
// (8 rows x 4 consecutive words a warp) and 16-byte row copies are both free of bank
// conflicts.
__device__ __forceinline__ int dh_staging_offset(int row, int byte) {
  return row * 64 + (((byte / 16) ^ ((row / 2) % 4)) * 16) + byte % 16;
}

// dh tile epilogue (see the header comment). Writes every row of the tile, zeros on rows
// that are padding (routed) or past T (shared). The warpgroup's 64 x 256 tile goes in
// rounds of 32 columns through its 16 KB staging, two rounds' g and u in flight at once
// (4 KB each, 64-byte rows): g, u come in by cp.async, 4 threads to a row's 64 bytes;
// each thread reads its accumulators' g, u there and writes dg, du back in their place;
// dg, du leave with 16-byte stores, then w h through the g buffer, and the buffer takes
// the round after next. (Loaded and stored by each thread at its accumulators' columns,
// 4 bytes a row at a time, this epilogue took 15-23 % of the backward's consumer cycles
// on the presets with I <= 2048: phase timing at a078db1.) acc is consumed: the rolled form
// moves its values down as the rounds go.
template <bool kRolled>
__device__ void epilogue_dh(const BackwardParams& p, SharedStorage& s, float (&acc)[128], const Task& t, int row0,
                            int wg, int n_tiles) {
  constexpr int kRoundColumns = 32, kRounds = kBlockN / kRoundColumns, kBufferBytes = 64 * kRoundColumns * 2;
  static_assert(2 * 2 * kBufferBytes == sizeof(s.staging[0]), "two rounds of g and u fill the staging");
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const ExpertSetData& d = t.shared ? p.shared : p.routed;
  const int inter = d.inter, n0 = t.n * kBlockN;
  const int tile_row = row0 + wg * 64;
  // The accumulators' rows: tile rows acc_row(warp, lane, i) = warp * 16 + lane / 4 + 8 h.
  auto acc_tile_row = [=](int h) { return tile_row + warp * 16 + lane / 4 + 8 * h; };
  float weight[2];
  bool valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (t.shared) {
      valid[h] = acc_tile_row(h) < p.tokens;
      weight[h] = 1.0f;
    } else {
      const int pair = p.plan.row_pair[acc_tile_row(h)];
      valid[h] = pair >= 0;
      weight[h] = valid[h] ? p.topk_weights[pair] : 0.0f;
    }
  }
  // The copies: tile rows tid / 4 + 32 pass, 16 bytes at byte 16 (tid % 4) of a round's row.
  const int chunk = tid % 4;
  char* staging = reinterpret_cast<char*>(s.staging[wg]);
  auto buffer = [=](int round, int which) { return staging + (round % 2) * 2 * kBufferBytes + which * kBufferBytes; };
  auto rounds_in = [=](int round) { return round < kRounds && n0 + kRoundColumns * round < inter; };  // (inter % 64 == 0)
  auto load = [&](int round) {  // g, u of `round` into its buffers (a group, possibly empty)
#if defined(MOK_DIAG_DH_NO_LOADS)  // (timing only, wrong results: the rounds compute on stale staging)
    if (false) {
#else
    if (rounds_in(round)) {
#endif
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        const int r = tid / 4 + 32 * pass;
        const bool row_valid = t.shared ? tile_row + r < p.tokens : p.plan.row_pair[tile_row + r] >= 0;
        const std::uint16_t* src = d.gu + static_cast<std::int64_t>(tile_row + r) * 2 * inter + n0 + kRoundColumns * round + 8 * chunk;
        cp_async_16(buffer(round, 0) + dh_staging_offset(r, 16 * chunk), src, !row_valid);
        cp_async_16(buffer(round, 1) + dh_staging_offset(r, 16 * chunk), src + inter, !row_valid);
      }
    }
    cp_async_commit();
  };
  if (tid == 0) tma_store_wait_read();  // earlier TMA stores (dx rows, weight gradients) have read the staging
  sync_warpgroup(wg);
#if defined(MOK_DIAG_DH_NO_LOADS)  // (the rounds then compute on zeros and their own finite outputs)
#pragma unroll
  for (int k = 0; k < 8; ++k) reinterpret_cast<uint4*>(staging)[tid + 128 * k] = make_uint4(0, 0, 0, 0);
  sync_warpgroup(wg);
#endif
  load(0);
  load(1);
  float partial[2] = {0.0f, 0.0f};
  // kRolled (the FP8 dgrad kernel): one round's code, run kRounds times, each round taking
  // acc[0, 16) and then moving the rest of acc down by 16 (registers only: every index a
  // constant). Unrolled, the eight rounds are ~6 K instructions (~100 KB of code) a tile;
  // rolled, the FP8 kernel's forward+backward measured 5.6-7.3 % faster on qwen3-30b-a3b and
  // olmoe (the BF16 kernels neutral, so they keep the unrolled form; bench/NOTES.md).
  // MOK_DIAG_DH_UNROLLED: unrolled in every kernel.
#if defined(MOK_DIAG_DH_UNROLLED)
  constexpr bool kRoll = false;
#else
  constexpr bool kRoll = kRolled;
#endif
  constexpr int kRoundStep = kRoll ? 0 : kRoundColumns / 2;  // (round r's accumulators: acc[16 r, 16 r + 16))
  constexpr int kUnroll = kRoll ? 1 : kRounds;
#pragma unroll kUnroll
  for (int round = 0; round < kRounds; ++round) {
    if (!rounds_in(round)) break;
    cp_async_wait<1>();  // this round's group has landed (the next one may be pending)
    sync_warpgroup(wg);
    char* g_buffer = buffer(round, 0);
    char* u_buffer = buffer(round, 1);
    std::uint32_t hw[kRoundColumns / 4];
#pragma unroll
    for (int j = 0; j < kRoundColumns / 2; j += 2) {
      // accumulator i = 16 round + j holds column 32 round + acc_col(lane, j) of row acc_row(.., j)
      const int i = kRoundStep * round + j;
      const int h = (j >> 1) & 1, r = acc_row(warp, lane, j), c = acc_col(lane, j);
      auto* g_at = reinterpret_cast<std::uint32_t*>(g_buffer + dh_staging_offset(r, 2 * c));
      auto* u_at = reinterpret_cast<std::uint32_t*>(u_buffer + dh_staging_offset(r, 2 * c));
      std::uint32_t dg = 0, du = 0, hwv = 0;
      if (valid[h]) {
        const float2 gv = unpack_bf16x2(*g_at), uv = unpack_bf16x2(*u_at);
        const SwigluGrad r0 = swiglu_backward(gv.x, uv.x, __fmul_rn(weight[h], acc[i]), p.swiglu_limit);
        const SwigluGrad r1 = swiglu_backward(gv.y, uv.y, __fmul_rn(weight[h], acc[i + 1]), p.swiglu_limit);
        partial[h] = __fmaf_rn(r0.hidden, acc[i], partial[h]);
        partial[h] = __fmaf_rn(r1.hidden, acc[i + 1], partial[h]);
        dg = pack_bf16x2(r0.d_gate, r1.d_gate);
        du = pack_bf16x2(r0.d_up, r1.d_up);
        hwv = pack_bf16x2(__fmul_rn(weight[h], r0.hidden), __fmul_rn(weight[h], r1.hidden));
      }
      *g_at = dg;  // in place: this thread just read these two values
      *u_at = du;
      hw[j / 2] = hwv;
    }
    if constexpr (kRoundStep == 0) {
#pragma unroll
      for (int k = 0; k + kRoundColumns / 2 < 128; ++k) acc[k] = acc[k + kRoundColumns / 2];
    }
    sync_warpgroup(wg);
    [[maybe_unused]] const int col0 = n0 + kRoundColumns * round;
#if !defined(MOK_DIAG_DH_NO_STORES)  // (timing only, wrong results: no dg, du or w h leave the staging)
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {  // dg, du over g, u in the saved tensor
      const int r = tid / 4 + 32 * pass, at = dh_staging_offset(r, 16 * chunk);
      std::uint16_t* dst = d.gu + static_cast<std::int64_t>(tile_row + r) * 2 * inter + col0 + 8 * chunk;
      st_global_v4_ordered(dst, ld_shared_v4_ordered(g_buffer + at));
      st_global_v4_ordered(dst + inter, ld_shared_v4_ordered(u_buffer + at));
    }
#endif
    sync_warpgroup(wg);
#pragma unroll
    for (int j = 0; j < kRoundColumns / 2; j += 2) {
      const int r = acc_row(warp, lane, j), c = acc_col(lane, j);
      *reinterpret_cast<std::uint32_t*>(g_buffer + dh_staging_offset(r, 2 * c)) = hw[j / 2];
    }
    sync_warpgroup(wg);
#if !defined(MOK_DIAG_DH_NO_STORES)
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {  // w h
      const int r = tid / 4 + 32 * pass;
      st_global_v4_ordered(d.hw + static_cast<std::int64_t>(tile_row + r) * inter + col0 + 8 * chunk,
                           ld_shared_v4_ordered(g_buffer + dh_staging_offset(r, 16 * chunk)));
    }
#endif
    sync_warpgroup(wg);  // the buffers are free
    load(round + 2);
  }
  cp_async_wait<0>();  // (only empty groups can be pending here)
  if (!t.shared) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the four lanes of a quad hold one row: a fixed tree
      float v = partial[h];
      v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
      v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
      if (lane % 4 != 0 || !valid[h]) continue;
      if (p.ep.push) {  // into the owner's partials, at its pair t * k + j
        const int pair = p.plan.row_pair[acc_tile_row(h)], pairs_per_rank = p.tokens * p.top_k;
        float* partials = reinterpret_cast<float*>(p.ep.slots[pair / pairs_per_rank] +
                                                   static_cast<std::int64_t>(pairs_per_rank) * p.hidden);
        partials[static_cast<std::int64_t>(pair % pairs_per_rank) * n_tiles + t.n] = v;
      } else {
        p.dw_partial[static_cast<std::int64_t>(acc_tile_row(h)) * n_tiles + t.n] = v;
      }
    }
  }
}

// f32 weight gradient: the warpgroup's 64 x 256 tile added into rows of [rows, cols] where
// a row pointer is given (one owner per element: a plain read-modify-write). empty: the
// expert has no rows (nothing to add; acc was never written).
__device__ inline void accumulate_weight_grad(const float (&acc)[128], void* const (&row)[2], int n0, int cols, bool empty) {
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

// EP: the dx rows of this warpgroup's 64 x 256 tile (plan rows row0 .. row0 + 63) as bf16
// into the slots of the tokens' owners (row t * k + j there); publish_pushes() counts them
// later. Each 64 x 128 half goes through the warpgroup's staging (store_tile_tma's layout)
// and leaves in 16-byte stores, 16 threads to a row's 256 bytes: from the accumulators,
// where a quad of lanes holds 16 contiguous bytes of a row, each write to a peer was a
// 16-byte NVLink fragment. The stores are plain; publish_pushed_rows() orders them.
__device__ inline void push_dx_rows(const BackwardParams& p, SharedStorage& s, const float (&acc)[128], int wg, int n0,
                             int row0) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  char* staging = reinterpret_cast<char*>(s.staging[wg]);
  if (tid == 0) tma_store_wait_read();  // earlier TMA stores (weight gradients, shared dx) have read the staging
  std::uint16_t* dst = nullptr;  // lane l < 16: the slot row of plan row row0 + (l / 2) * 8 + 2 * warp + l % 2
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    sync_warpgroup(wg);  // the staging is free (half 1: every thread has read half 0 out of it)
#pragma unroll
    for (int i = 64 * half; i < 64 * half + 64; i += 2) {
      const int r = acc_row(warp, lane, i), c = acc_col(lane, i) - 128 * half;
      *reinterpret_cast<std::uint32_t*>(staging + swizzled_offset(r, c)) = pack_bf16x2(acc[i], acc[i + 1]);
    }
    sync_warpgroup(wg);  // (read back by threads, the generic proxy: no proxy fence)
    if (half == 0 && lane < 16) {  // (not earlier: with all of acc live, registers spilled)
      const int pair = p.plan.row_pair[row0 + (lane / 2) * 8 + 2 * warp + lane % 2], pairs_per_rank = p.tokens * p.top_k;
      if (pair >= 0)  // (padding: pair -1)
        dst = p.ep.slots[pair / pairs_per_rank] +
              static_cast<std::int64_t>(pair % pairs_per_rank) * p.hidden + n0;
    }
    const int c = (tid % 16) * 8;                     // this thread's 8 columns of the half, rows it * 8 + tid / 16
    const bool in = n0 + 128 * half + c < p.hidden;  // (hidden % 64 == 0: a chunk is wholly in or out)
#pragma unroll 4  // (all 8 at once: registers spilled)
    for (int it = 0; it < 8; ++it) {
      const int r = it * 8 + tid / 16;
      auto* row = reinterpret_cast<std::uint16_t*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<std::uintptr_t>(dst), it * 2 + lane / 16));
      if (row == nullptr || !in) continue;
      st_global_v4_ordered(row + 128 * half + c, *reinterpret_cast<const uint4*>(staging + swizzled_offset(r, c)));
    }
  }
  // (The next writer of the staging, store_tile_tma or this, first syncs the warpgroup.)
}

// A bf16 64 x 256 tile of this warpgroup leaves through its swizzled staging buffer in
// two 64 x 128 halves, each as two TMA stores to (col0 + 64 i, row, layer) of `map`
// (clipped at the matrix edges, skipped when row >= rows or the column >= cols), so the
// writes drain while the next tile's mainloop runs. zero: store zeros instead of acc.
// kSharedWindow: stage_bf16_half's (the FP8 dgrad kernel). kWeightGrad: a weight-gradient tile
// (the timing variants below touch only those). The second half waits for the first half's
// stores to read the staging (staging it in the mainloop's last stage instead, kept until the
// next weight mainloop, measured no faster: bench/NOTES.md; removed).
template <bool kSharedWindow, bool kWeightGrad = false>
__device__ void store_tile_tma(SharedStorage& s, const float (&acc)[128], int wg, const CUtensorMap* map, int col0,
                               int row, int layer, int rows, int cols, bool zero) {
  const int tid = threadIdx.x % 128;
  constexpr int kHalfBytes = sizeof(s.staging[0]);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    char* staging = reinterpret_cast<char*>(s.staging[wg]);
    stage_bf16_half<kSharedWindow>(staging, acc, half, wg,
                                   [zero](float a, float b) { return zero ? 0u : pack_bf16x2(a, b); });
#if defined(MOK_DIAG_WGRAD_NO_TMA)  // (timing build, wrong weight gradients: staged, never stored)
    if constexpr (kWeightGrad) continue;
#endif
    if (tid == 0 && row < rows) {
      for (int panel = 0; panel < 2; ++panel) {
        const int col = col0 + 128 * half + 64 * panel;
        if (col >= cols) continue;
#if defined(MOK_DIAG_WGRAD_EVICT_FIRST)  // (same bits: the weight gradients' lines first out of L2)
        if constexpr (kWeightGrad) {
          tma_store_3d_hint(map, staging + panel * kHalfBytes / 2, col, row, layer, l2_policy_evict_first());
          continue;
        }
#endif
        tma_store_3d(map, staging + panel * kHalfBytes / 2, col, row, layer);
      }
      tma_store_commit_group();
    }
  }
}

// bf16 weight gradient tile (empty: the expert has no rows, the gradient is zero).
template <bool kSharedWindow>
__device__ void store_weight_grad_tma(const BackwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                                      int wg, bool empty) {
  const ExpertSetMaps& maps = t.shared ? p.shared_maps : p.routed_maps;
  const int H = p.hidden, I = (t.shared ? p.shared : p.routed).inter;
  const int row0 = t.m * kBlockM + wg * 64;
  if (t.kind == kWd) {
    store_tile_tma<kSharedWindow, true>(s, acc, wg, &maps.d_down, t.n * kBlockN, row0, t.e, H, I, empty);
  } else {  // rows [0, I) of the tile space are W_gate's, [I, 2I) W_up's (I % 64 == 0)
    const bool gate = row0 < I;
    store_tile_tma<kSharedWindow, true>(s, acc, wg, gate ? &maps.d_gate : &maps.d_up, t.n * kBlockN,
                                        gate ? row0 : row0 - I, t.e, gate ? I : (row0 < 2 * I ? I : 0), H, empty);
  }
}

template <bool kSharedWindow>
__device__ void epilogue_weight(const BackwardParams& p, SharedStorage& s, const float (&acc)[128], const Task& t,
                                int wg, bool empty) {
#if defined(MOK_DIAG_NO_WGRAD_EPILOGUE)
  // (a timing build, wrong weight gradients: the weight-gradient tiles store nothing, so a same-run
  // A/B says what their epilogues cost in wall time — the bound of overlapping them; bench/NOTES.md).
  // The accumulators are kept live by a branch never taken (t.e >= 0): with a bare return ptxas
  // removed the weight-gradient MMAs themselves (their results dead; 4c146b3's run of this
  // variant timed that, not the epilogue).
  if (t.e < 0) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 128; ++i) sum += acc[i];
    p.d_topk_weights[threadIdx.x] = sum;
  }
  return;
#endif
  if (!p.grad_fp32) {
    store_weight_grad_tma<kSharedWindow>(p, s, acc, t, wg, empty);
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
  const std::uint16_t* rows = p.ep.slots[p.ep.rank];
  const auto* partials = reinterpret_cast<const float*>(rows + static_cast<std::int64_t>(pairs_per_rank) * p.hidden);
  combine_tokens<false, true>(begin, end, p.hidden, p.top_k, nullptr, p.ep.own_ids, nullptr, rows, p.shared.dx_rows, p.dx,
                              tid, threads);
  for (int i = begin * p.top_k + tid; i < end * p.top_k; i += threads) {
    float v = 0.0f;
    if (p.ep.own_ids[i] >= 0)
      for (int n = 0; n < sched.n_dh_r; ++n) v = __fadd_rn(v, partials[static_cast<std::int64_t>(i) * sched.n_dh_r + n]);
    p.d_topk_weights[i] = v;
  }
}

template <typename Sched>
__device__ void combine(const BackwardParams& p, const Task& t, const Sched& sched) {
#if defined(MOK_DIAG_NO_COMBINE)  // (a timing build, wrong dx and d_topk_weights: what the combine costs)
  return;
#endif
  if (p.ep.push) {
    combine_pushed(p, t, sched);
    return;
  }
  const int tid = threadIdx.x - kProducerThreads, threads = 128 * kConsumerWarpgroups;
  const int begin = t.m * kCombineTokens, end = min(p.tokens, begin + kCombineTokens);
  // (this launch's column block: the routed dx rows hold its columns, dx and the shared rows all of H)
  const int c0 = col_begin(p);
  combine_tokens<false, false, true>(begin, end, p.hidden, p.top_k, p.plan.pair_row, nullptr, nullptr, p.routed.dx_rows,
                                     p.shared.dx_rows ? p.shared.dx_rows + c0 : nullptr, p.dx + c0, tid, threads,
                                     CombineBlock{col_end(p) - c0, rows_width(p), p.hidden});
  if (c0 > 0) return;  // (d_topk_weights: the first block's launch)
  for (int i = begin * p.top_k + tid; i < end * p.top_k; i += threads) {
    const int row = p.plan.pair_row[i];
    float v = 0.0f;
    if (row >= 0)
      for (int n = 0; n < sched.n_dh_r; ++n) v = __fadd_rn(v, p.dw_partial[static_cast<std::int64_t>(row) * sched.n_dh_r + n]);
    p.d_topk_weights[i] = v;
  }
}

// Publishes this warpgroup's dx tiles (dx_done), deferred until the combine, their only reader.
__device__ inline void publish_dx_rows(const BackwardParams& p, int wg, int& pending) {
  publish_stored_tiles(p.counters.dx_done, pending, wg);
}

// EP: publishes, per owner, the rows this warpgroup pushed (dx rows and d_topk_weights
// partials) in its routed dh and dx tasks before `end`. Counted here, once, from the task
// list rather than in each epilogue: the consumer loop has no registers to spare.
template <typename Sched>
__device__ void publish_pushes(const BackwardParams& p, SharedStorage& s, const Sched& sched, int wg, int end) {
  for (int task = sched.cta; task < end; task += sched.ctas) {
    const Task t = sched.decode(p, task);
    if (!t.shared && (t.kind == kDh || t.kind == kDx))
      count_pushed_rows(p.ep, p.plan.row_pair, tile_row0(p, t) + wg * 64, p.tokens * p.top_k, s.pushed[wg]);
  }
  publish_pushed_rows(p.ep, s.pushed[wg], wg);
}

// Ring: this warpgroup has read the task's dy / x rows (its mainloop is done): freed[mb] += 1
// for every minibatch they lie in.
__device__ inline void free_ring_rows(const BackwardParams& p, const Task& t, int wg) {
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
// thread's writes are published.

// The counter that task t's reads count in (null: none).
__device__ __forceinline__ int* read_counter(const BackwardParams& p, const Task& t) {
  if (!t.shared && t.kind == kWgu && p.dx_over_x) return p.counters.dgu_ready + p.plan.expert_offset[t.e] / kBlockM;
  if (!t.shared && t.kind == kWd && p.rows_in_grads) return p.counters.wd_done;
  return nullptr;
}

__device__ __forceinline__ void switch_read(ReadCount& r, int* counter) {
  if (threadIdx.x % 128 != 0 || counter == r.counter) return;
  if (r.count > 0) red_release_gpu_add(r.counter, r.count);
  r.counter = counter, r.count = 0;
}

}  // namespace mok::kernels::bwd
