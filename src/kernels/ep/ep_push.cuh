// Device side of the push combine (kernels/ep/ep.cuh): counting the rows a warpgroup pushed,
// per owner rank, and publishing them once its stores were issued.
#pragma once

#include <cstdint>

#include "kernels/ep/ep.cuh"
#include "kernels/ep/ep_sync.cuh"
#include "kernels/common/persistent.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"

namespace mok::kernels {

// Rows a warpgroup pushed and has not published yet, per warp 0 / 1 and owner rank (shared memory).
using PushedRows = int[2][kMaxEpRanks];

// Adds the owners of plan rows [row0, row0 + 64) to `pushed`: thread i < 64 of the
// warpgroup looks at row i (padding rows, pair -1, belong to no one).
__device__ __forceinline__ void count_pushed_rows(const EpPeers& ep, const std::int32_t* row_pair, int row0,
                                                  int pairs_per_rank, PushedRows& pushed) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  if (warp >= 2) return;
  const int pair = row_pair[row0 + tid];
  const int owner = pair < 0 ? -1 : pair / pairs_per_rank;
  for (int q = 0; q < ep.size; ++q) {
    const unsigned mask = __ballot_sync(0xffffffffu, owner == q);
    if (lane == 0) pushed[warp][q] += __popc(mask);
  }
}

// slots_done[this rank] += `tiles` x rows at each owner (release; system scope across
// GPUs) for every row counted since the last call, once all of warpgroup `wg`'s stores
// are issued (sync_warpgroup).
__device__ __forceinline__ void publish_pushed_rows(const EpPeers& ep, PushedRows& pushed, int wg) {
  sync_warpgroup(wg);
  const int tid = threadIdx.x % 128, warp = tid / 32;
  if (tid % 32 != 0 || warp >= 2) return;
  if (ep.system_scope) ptx::fence_acq_rel_sys();
  else ptx::fence_acq_rel_gpu();
  for (int q = 0; q < ep.size; ++q) {
    int& rows = pushed[warp][q];
    if (rows == 0) continue;
    if (ep.system_scope) ptx::red_release_sys_add(ep.slots_done[q] + ep.rank, rows);
    else ptx::red_release_gpu_add(ep.slots_done[q] + ep.rank, rows);
    rows = 0;
  }
}

// Whether every rank's plan is good (and, in the backward, its saved tensor): a rank whose
// plan failed pushes nothing, so its peers must not wait for it. Separate launches: waits
// (bounded: WaitSite::plan_flag) for every rank's plan flag of this call. P: a kernel's params.
template <typename P>
__device__ __forceinline__ bool all_plans_ok(const P& p, bool check_saved) {
  const EpPeers& ep = p.ep;
  if (p.plan.status->code != PlanStatus::ok) return false;
  if (!ep.push) return true;
  if (ep.header == nullptr) {  // virtual ranks in one launch: the stream ordered every planner before it
    for (int q = 0; q < ep.size; ++q)
      if (static_cast<const PlanStatus*>(ep.plan_status[q])->code != PlanStatus::ok) return false;
    return true;
  }
  __shared__ int verdict;
  if (threadIdx.x == 0) {
    const auto* header = static_cast<const EpHeader*>(ep.header);
    const unsigned epoch = header->epoch;
    int bad = 0;
    for (int q = 0; q < ep.size; ++q) {
      const int* flag = reinterpret_cast<const int*>(&header->plan_flag[q]);
      unsigned seen = ptx::ld_acquire_sys(flag);
      const std::uint32_t start = wait_clock();
      while (!reached(seen, epoch)) {
        __nanosleep(256);
        if (expired(p, start)) give_up(p, -1, WaitSite::plan_flag, static_cast<int>(seen), static_cast<int>(epoch), q);
        seen = ptx::ld_acquire_sys(flag);
      }
      bad |= *reinterpret_cast<const volatile int*>(&header->plan_code[q]) & (check_saved ? 15 : 7);
    }
    verdict = bad;
  }
  __syncthreads();
  return verdict == 0;
}

}  // namespace mok::kernels
