// Copies of rows: one warp through registers (the dispatch kernel), or through shared
// memory with bulk copies (the ring's comm warps, forward.cu); bench/ring_copy_bench.cu
// measures both alone.
#pragma once

#include <cstdint>

#include "kernels/persistent.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"

namespace mok::kernels {

// One warp copies `vectors` 16-byte vectors from src to dst, four per lane in flight.
__device__ __forceinline__ void warp_copy_row(uint4* dst, const uint4* src, int vectors, int lane) {
  constexpr int kInFlight = 4;
  for (int v0 = lane; v0 < vectors; v0 += 32 * kInFlight) {
    uint4 chunk[kInFlight] = {};
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      if (v0 + 32 * i < vectors) chunk[i] = __ldg(src + v0 + 32 * i);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      if (v0 + 32 * i < vectors) dst[v0 + 32 * i] = chunk[i];
  }
}

// One warp's pipeline (its lane 0 issues every copy): pieces of rows (at most kPiece bytes,
// 16-byte aligned, a multiple of 16) go global -> staging slot (bulk load) -> destination
// (bulk store), at most kSlots - kLag loads in flight. The slot loaded next was stored kLag
// stores ago, so its read is waited for without waiting for the newest stores.
template <int kSlots, int kLag, int kPiece>
struct BulkCopyPipe {
  static_assert(kLag >= 1 && kLag < kSlots && kPiece % 16 == 0);
  std::uint8_t* staging;   // kSlots * kPiece bytes of shared memory
  std::uint64_t* loaded;   // kSlots mbarriers of one arrival (initialised by the caller)
  std::uint16_t** dst;     // kSlots: where each slot's piece goes (shared memory)
  int* bytes;              // kSlots: its size (shared memory)
  std::uint32_t issued = 0, stored = 0;  // pieces loaded / stored so far

  // The oldest loaded piece: wait for its bytes (bounded: task, phase name the wait), store it.
  template <typename P>
  __device__ void retire(const P& p, int task, int phase) {
    const int slot = stored % kSlots;
    wait_barrier(p, &loaded[slot], (stored / kSlots) & 1u, task, phase);
    ptx::bulk_store(dst[slot], staging + slot * kPiece, bytes[slot]);
    ptx::tma_store_commit_group();
    ++stored;
  }

  template <typename P>
  __device__ void copy(const P& p, std::uint16_t* to, const std::uint16_t* from, int n, int task, int phase) {
    if (issued - stored == kSlots - kLag) retire(p, task, phase);
    const int slot = issued % kSlots;
    if (issued >= kSlots) ptx::bulk_wait_read<kLag - 1>();  // the slot's last store has read it
    dst[slot] = to, bytes[slot] = n;
    ptx::mbarrier_arrive_expect_tx(&loaded[slot], n);
    ptx::bulk_load(staging + slot * kPiece, from, n, &loaded[slot]);
    ++issued;
  }

  // Every piece stored and its writes performed.
  template <typename P>
  __device__ void drain(const P& p, int task, int phase) {
    while (stored < issued) retire(p, task, phase);
    ptx::tma_store_wait_all();
  }
};

}  // namespace mok::kernels
