// The forward's combine with more bytes in flight per CTA (a diagnostic build's, kernels/common/diag.cuh
// MOK_DIAG_FWD_STAGED_COMBINE; bench/combine_rate.cu measures it alone). combine_tokens keeps ~32 KB of
// register loads in flight a CTA, and each round's row addresses are dependent loads: ~20 GB/s a CTA
// (bench/NOTES.md, forty-seventh session). Here every thread copies its own 16-byte columns of the next
// units into its own part of a shared-memory staging area with cp.async, depth - 1 units ahead, and sums
// unit u once its group has landed. A unit is one column round of one token (threads x 8 columns), all
// its rows: the shared-expert row first, then slot rows j = 0 .. k-1. No thread reads another's bytes,
// so there is no barrier. The sums run in combine_tokens' order (the shared row, then each valid slot in
// ascending j, fp32 fma, one bf16 rounding), so y is bitwise combine_tokens<true, false>'s.
#pragma once

#include <cstdint>

#include "kernels/common/persistent.cuh"
#include "mok/ptx/ld_st.cuh"

namespace mok::kernels {

inline constexpr int kStagedColumns = 8;  // bf16 columns of one 16-byte copy

// Staging bytes of one unit: its rows x threads x 16 bytes.
__host__ __device__ inline int staged_unit_bytes(int top_k, bool shared, int threads) {
  return (top_k + (shared ? 1 : 0)) * threads * 16;
}

// Tokens [begin, end) on `threads` threads (tid: this one's index), kDepth units in the staging area
// (kDepth x staged_unit_bytes bytes).
template <int kDepth>
__device__ void combine_tokens_staged(int begin, int end, int hidden, int top_k, const std::int32_t* pair_row,
                                      const float* weights, const std::uint16_t* slots, const std::uint16_t* shared,
                                      std::uint16_t* out, int tid, int threads, uint4* staging) {
  static_assert(kDepth >= 2);
  const int rows = top_k + (shared ? 1 : 0), first_slot = shared ? 1 : 0;
  const int chunks = hidden / kStagedColumns, rounds = (chunks + threads - 1) / threads;
  const int units = (end - begin) * rounds;
  auto issue = [&](int u) {  // unit u's copies into its slot of the staging area: one group (empty past the end)
    if (u < units) {
      const int token = begin + u / rounds, chunk = tid + (u % rounds) * threads;
      if (chunk < chunks) {
        uint4* slot = staging + static_cast<std::size_t>(u % kDepth) * rows * threads + tid;
        const std::int64_t column = static_cast<std::int64_t>(chunk) * kStagedColumns;
        if (shared) ptx::cp_async_16(slot, shared + static_cast<std::int64_t>(token) * hidden + column, false);
        for (int j = 0; j < top_k; ++j) {
          const int row = pair_row[token * top_k + j];
          ptx::cp_async_16(slot + (first_slot + j) * threads,
                           slots + static_cast<std::int64_t>(row < 0 ? 0 : row) * hidden + column, row < 0);
        }
      }
    }
    ptx::cp_async_commit();
  };
  auto unpack = [](const uint4& v, float (&f)[kStagedColumns]) {
    const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = unpack_bf16x2(w[i]);
      f[2 * i] = pair.x, f[2 * i + 1] = pair.y;
    }
  };
  for (int u = 0; u < kDepth - 1; ++u) issue(u);
  for (int u = 0; u < units; ++u) {
    issue(u + kDepth - 1);
    ptx::cp_async_wait<kDepth - 1>();  // unit u's group has landed (this thread's own copies)
    const int token = begin + u / rounds, chunk = tid + (u % rounds) * threads;
    if (chunk >= chunks) continue;
    const uint4* slot = staging + static_cast<std::size_t>(u % kDepth) * rows * threads + tid;
    float acc[kStagedColumns];
    if (shared) {
      unpack(slot[0], acc);
    } else {
#pragma unroll
      for (int i = 0; i < kStagedColumns; ++i) acc[i] = 0.0f;
    }
    for (int j = 0; j < top_k; ++j) {
      if (pair_row[token * top_k + j] < 0) continue;  // (a padding slot: combine_tokens skips it too)
      const float w = weights[token * top_k + j];
      float v[kStagedColumns];
      unpack(slot[(first_slot + j) * threads], v);
#pragma unroll
      for (int i = 0; i < kStagedColumns; ++i) acc[i] = __fmaf_rn(w, v[i], acc[i]);
    }
    const uint4 packed{pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
                       pack_bf16x2(acc[6], acc[7])};
    *reinterpret_cast<uint4*>(out + static_cast<std::int64_t>(token) * hidden + static_cast<std::int64_t>(chunk) * kStagedColumns) =
        packed;
  }
  ptx::cp_async_wait<0>();
}

// The deepest of kDepth 8, 6, 4, 2 whose units fit in staging_bytes; false (nothing done) if not even
// two fit, so that the caller combines the usual way.
__device__ inline bool combine_tokens_staged_fit(int begin, int end, int hidden, int top_k, const std::int32_t* pair_row,
                                                 const float* weights, const std::uint16_t* slots,
                                                 const std::uint16_t* shared, std::uint16_t* out, int tid, int threads,
                                                 uint4* staging, std::size_t staging_bytes) {
  const std::size_t units = staging_bytes / staged_unit_bytes(top_k, shared != nullptr, threads);
#define MOK_STAGED_COMBINE(D) \
  combine_tokens_staged<D>(begin, end, hidden, top_k, pair_row, weights, slots, shared, out, tid, threads, staging)
  if (units >= 8) MOK_STAGED_COMBINE(8);
  else if (units >= 6) MOK_STAGED_COMBINE(6);
  else if (units >= 4) MOK_STAGED_COMBINE(4);
  else if (units >= 2) MOK_STAGED_COMBINE(2);
  else return false;
#undef MOK_STAGED_COMBINE
  return true;
}

}  // namespace mok::kernels
