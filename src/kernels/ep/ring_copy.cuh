// Copies of rows: one warp through registers (the dispatch kernel), or through shared
// memory with bulk copies (the ring's comm warps, forward.cu); bench/ring_copy_bench.cu
// measures both alone.
#pragma once

#include <cstdint>

#include "kernels/ep/ep.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/warp_copy.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"

namespace mok::kernels {

// One warp's pipeline (its lane 0 issues every copy): pieces of rows (at most kPiece bytes,
// 16-byte aligned, a multiple of 16) go global -> staging slot (bulk load) -> destination
// (bulk store), at most kSlots - kLag loads in flight. The slot loaded next was stored kLag
// stores ago, so its read is waited for without waiting for the newest stores.
template <int kSlots, int kLag, int kPiece>
struct BulkCopyPipe {
  static_assert(kLag >= 1 && kLag < kSlots && kPiece % 16 == 0);
  static constexpr int kPieceBytes = kPiece;
  std::uint8_t* staging;   // kSlots * kPiece bytes of shared memory
  std::uint64_t* loaded;   // kSlots mbarriers of one arrival (initialised by the caller)
  std::uint16_t** dst;     // kSlots: where each slot's piece goes (shared memory)
  int* bytes;              // kSlots: its size (shared memory)
  std::uint32_t issued = 0, stored = 0;  // pieces loaded / stored so far

  // The oldest loaded piece: wait for its bytes (bounded: task and site name the wait), store it.
  template <typename P>
  __device__ void retire(const P& p, int task, WaitSite site) {
    const int slot = stored % kSlots;
    wait_barrier(p, &loaded[slot], (stored / kSlots) & 1u, task, site);
    ptx::bulk_store(dst[slot], staging + slot * kPiece, bytes[slot]);
    ptx::tma_store_commit_group();
    ++stored;
  }

  template <typename P>
  __device__ void copy(const P& p, std::uint16_t* to, const std::uint16_t* from, int n, int task, WaitSite site) {
    if (issued - stored == kSlots - kLag) retire(p, task, site);
    const int slot = issued % kSlots;
    if (issued >= kSlots) ptx::bulk_wait_read<kLag - 1>();  // the slot's last store has read it
    dst[slot] = to, bytes[slot] = n;
    ptx::mbarrier_arrive_expect_tx(&loaded[slot], n);
    ptx::bulk_load(staging + slot * kPiece, from, n, &loaded[slot]);
    ++issued;
  }

  // Every piece stored and its writes performed.
  template <typename P>
  __device__ void drain(const P& p, int task, WaitSite site) {
    while (stored < issued) retire(p, task, site);
    ptx::tma_store_wait_all();
  }
};

// Comm CTAs (either kernel): kCommWarps warps pull rows, each through kCommSlots staging
// slots of kCommPiece bytes in the kernel's (otherwise unused) pipeline stages.
inline constexpr int kCommWarps = 8, kCommSlots = 6, kCommLag = 2, kCommPiece = 4096;
inline constexpr std::size_t kCommStagingBytes = std::size_t{kCommWarps} * kCommSlots * kCommPiece;
using CommPipe = BulkCopyPipe<kCommSlots, kCommLag, kCommPiece>;

struct CommShared {  // per staging slot
  std::uint64_t loaded[kCommWarps * kCommSlots];  // its load's bytes have arrived
  std::uint16_t* dst[kCommWarps * kCommSlots];    // where its piece goes in a ring
  int bytes[kCommWarps * kCommSlots];
};

// Every thread of a comm CTA calls this: thread 0 initialises the staging barriers. Warp
// `warp` (< kCommWarps) then copies through its slots of `staging` (kCommStagingBytes).
__device__ __forceinline__ void init_comm(CommShared& c) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < kCommWarps * kCommSlots; ++i) ptx::mbarrier_init(&c.loaded[i], 1);
    ptx::fence_proxy_async_shared_cta();
  }
  __syncthreads();
}
__device__ __forceinline__ CommPipe comm_pipe(void* staging, CommShared& c, int warp) {
  return CommPipe{static_cast<std::uint8_t*>(staging) + warp * kCommSlots * kCommPiece, &c.loaded[warp * kCommSlots],
                  &c.dst[warp * kCommSlots], &c.bytes[warp * kCommSlots]};
}

// Plan rows of minibatch mb of a plan of rows_total rows (the last one may be short).
__device__ __forceinline__ int minibatch_rows(const RingGeometry& ring, int rows_total, int mb) {
  return min(ring.minibatch_rows, rows_total - mb * ring.minibatch_rows);
}

// Where one kind of row goes and comes from: ring [ring_rows, H]; ranks[q]: rank q's rows [T, H].
struct RowSource {
  std::uint16_t* ring;
  const std::uint16_t* const* ranks;
};

// The comm side of a ring token buffer: plan rows [0, rows_total) go, minibatch by
// minibatch, to ring row (row mod ring_rows) of each source's ring; row r of a minibatch is
// copied by comm warp r mod workers. Before overwriting a minibatch's slots a warp waits
// until freed[mb - ring_rows / minibatch_rows] reaches expected_freed(that minibatch)
// (what the compute side counts once it has read the rows); after its rows of a minibatch it
// adds their count to landed[mb]. Padding rows (row_pair -1) become zeros.
template <int kSources>
struct RingPull {
  RowSource sources[kSources];
  const std::int32_t* row_pair;
  int rows_total, hidden, tokens, top_k;
  RingGeometry ring;

  __device__ int rows_of(int mb) const { return kernels::minibatch_rows(ring, rows_total, mb); }

  template <typename Pipe, typename P, typename ExpectedFreed>
  __device__ void run(const P& p, Pipe& pipe, int worker, int workers, ExpectedFreed expected_freed, WaitSite freed_site,
                      WaitSite copy_site) const {
    const int lane = threadIdx.x % 32;
    const int per = ring.minibatch_rows, slots = ring.ring_rows / per, minibatches = (rows_total + per - 1) / per;
    const int row_bytes = hidden * 2, pairs_per_rank = tokens * top_k;
    for (int mb = 0; mb < minibatches; ++mb) {
      if (mb >= slots) {
        if (lane == 0) wait_counter(p, ring.freed + (mb - slots), expected_freed(mb - slots), mb, freed_site);
        __syncwarp();
        ptx::fence_proxy_async_global();  // the TMA reads of the slots' old rows come before these writes
      }
      const int first = mb * per, count = rows_of(mb);
      int copied = 0, pair_of_lane = -1;
      for (int i = 0, r = worker; r < count; ++i, r += workers, ++copied) {
        if (i % 32 == 0) {  // the next 32 rows' pairs, one load per lane (not one latency per row)
          const int mine = r + lane * workers;
          pair_of_lane = mine < count ? row_pair[first + mine] : -1;
        }
        const int pair = __shfl_sync(0xffffffffu, pair_of_lane, i % 32);
        const std::int64_t slot = static_cast<std::int64_t>((first + r) % ring.ring_rows) * hidden;
#pragma unroll
        for (int k = 0; k < kSources; ++k) {
          std::uint16_t* dst = sources[k].ring + slot;
          if (pair < 0) {
            uint4* d = reinterpret_cast<uint4*>(dst);
            for (int v = lane; v < row_bytes / 16; v += 32) d[v] = make_uint4(0, 0, 0, 0);
          } else if (lane == 0) {
            const int token = (pair % pairs_per_rank) / top_k;
            const std::uint16_t* src = sources[k].ranks[pair / pairs_per_rank] + static_cast<std::int64_t>(token) * hidden;
            for (int b = 0; b < row_bytes; b += Pipe::kPieceBytes)
              pipe.copy(p, dst + b / 2, src + b / 2, min(Pipe::kPieceBytes, row_bytes - b), mb, copy_site);
          }
        }
      }
      ptx::fence_proxy_async_global();  // the zeroed rows: TMA loads read them next
      __syncwarp();
      if (lane == 0) {
        pipe.drain(p, mb, copy_site);
        ptx::fence_proxy_async_global();
        if (copied > 0) {
          ptx::fence_acq_rel_gpu();
          ptx::red_release_gpu_add(ring.landed + mb, copied);
        }
      }
      __syncwarp();
    }
  }
};

}  // namespace mok::kernels
