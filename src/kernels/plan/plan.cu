// Device planner: four small stream-ordered launches, no host synchronisation.
//
//   reset_kernel  the call's starting state: status ok, no tiles, row_pair and this rank's
//                 pair_row all -1, the caller's counters 0 (what three memsets did, in one launch)
//   count_kernel  one warp per chunk of kPlanChunk ids: per-local-expert counts of the
//                 chunk, range check of every id (first bad position kept by atomicMin)
//   scan_kernel   one CTA: per expert, exclusive prefix over chunks (chunk_base), row
//                 counts, padded offsets, capacity check, the M-tile list
//   place_kernel  one warp per chunk: walks its ids in order, 32 at a time; lanes that
//                 hit the same expert take consecutive rows (match_any + popc)
//
// Every row position follows from the chunk order and the lane order alone, so the plan
// is bitwise identical run to run and equal to plan_host(). Only integer atomics in
// shared memory are used, for counts (order-free).
#include <algorithm>
#include <cstdint>

#include "kernels/plan/plan.cuh"
#include "kernels/common/load.cuh"

namespace mok::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kScanThreads = 1024;

__device__ std::int64_t load_id(const PlanProblem& p, std::int64_t i) {
  return p.ids_are_i64 ? static_cast<const std::int64_t*>(p.ids)[i]
                       : static_cast<const std::int32_t*>(p.ids)[i];
}

// The call's starting state: status ok, no tiles, every row of row_pair and every own pair
// of pair_row -1 (padding rows, and pairs routed elsewhere or nowhere, stay so), and the
// caller's words (p.zero_words: the layer kernels' dependency counters) 0.
__global__ void reset_kernel(PlanProblem p, DevicePlanView plan) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.capacity_rows; i += stride) plan.row_pair[i] = -1;
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.tokens_times_k; i += stride) plan.pair_row[i] = -1;
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.zero_count; i += stride) p.zero_words[i] = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *plan.status = PlanStatus{PlanStatus::ok, 0, INT64_MAX, 0, 0};
    *plan.num_tiles = 0;
  }
}

__global__ void count_kernel(PlanProblem p, DevicePlanView plan) {
  extern __shared__ std::int32_t counts[];  // [E_l]
  const int lane = threadIdx.x;
  for (int e = lane; e < p.num_local_experts; e += kWarp) counts[e] = 0;
  __syncwarp();
  const std::int64_t first_expert = p.rank * p.num_local_experts;
  const std::int64_t begin = blockIdx.x * kPlanChunk;
  const std::int64_t end = min(begin + kPlanChunk, p.num_ids);
  for (std::int64_t i = begin + lane; i < end; i += kWarp) {
    const std::int64_t e = load_id(p, i);
    if (e < -1 || e >= p.num_experts) {
      plan.status->code = PlanStatus::expert_out_of_range;  // same value from every writer
      atomicMin(reinterpret_cast<unsigned long long*>(&plan.status->index),
                static_cast<unsigned long long>(i));
    } else if (e >= first_expert && e < first_expert + p.num_local_experts) {
      atomicAdd(&counts[e - first_expert], 1);
    }
  }
  __syncwarp();
  for (int e = lane; e < p.num_local_experts; e += kWarp)
    plan.chunk_base[blockIdx.x * p.num_local_experts + e] = counts[e];
}

// scan_kernel's chunk ranges: as many as its threads allow one thread per (range, expert).
__host__ __device__ constexpr int scan_groups(int num_local_experts) {
  return num_local_experts >= kScanThreads ? 1 : kScanThreads / num_local_experts;
}

__global__ void __launch_bounds__(kScanThreads) scan_kernel(PlanProblem p, DevicePlanView plan, std::int64_t num_chunks) {
  extern __shared__ std::int32_t padded[];  // [E_l], then the range sums [scan_groups(E_l)][E_l]
  const int El = p.num_local_experts;
  PlanStatus& status = *plan.status;
  if (status.code == PlanStatus::expert_out_of_range) {
    if (threadIdx.x == 0) {
      status.value = load_id(p, status.index);
      *plan.num_tiles = 0;
    }
    return;
  }
  // Per expert, an exclusive prefix over the chunks' counts in two passes, the chunks split
  // into `groups` ranges (scan_groups): one thread per (range, expert), neighbouring threads on
  // neighbouring experts (coalesced). Pass 1 sums each range (independent loads); pass 2 walks
  // its range again from the sum of the ranges before it. One thread per expert walking every
  // chunk was a chain of dependent loads (~28 us on 256 chunks); a warp per expert reading
  // down a column was slower still (32 cache lines per load). Integer sums: exact in any order.
  std::int32_t* range_sum = padded + El;  // [groups][E_l]
  const int groups = scan_groups(El);
  const std::int64_t per_range = (num_chunks + groups - 1) / groups;
  for (int slot = threadIdx.x; slot < groups * El; slot += blockDim.x) {
    const int e = slot % El;
    const std::int64_t begin = (slot / El) * per_range, end = min(begin + per_range, num_chunks);
    std::int32_t sum = 0;
    for (std::int64_t c = begin; c < end; ++c) sum += plan.chunk_base[c * El + e];
    range_sum[slot] = sum;
  }
  __syncthreads();
  for (int slot = threadIdx.x; slot < groups * El; slot += blockDim.x) {
    const int e = slot % El, range = slot / El;
    std::int32_t running = 0;
    for (int r = 0; r < range; ++r) running += range_sum[r * El + e];
    const std::int64_t begin = range * per_range, end = min(begin + per_range, num_chunks);
    for (std::int64_t c = begin; c < end; ++c) {
      std::int32_t& count = plan.chunk_base[c * El + e];
      const std::int32_t n = count;
      count = running;
      running += n;
    }
    if (range == groups - 1) {
      plan.expert_rows[e] = running;
      padded[e] = (running + p.block_m - 1) / p.block_m * p.block_m;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // E_l is small: a serial scan is cheaper than a block scan here
    std::int64_t offset = 0;
    for (int e = 0; e < El; ++e) {
      plan.expert_offset[e] = static_cast<std::int32_t>(offset);
      offset += padded[e];
    }
    plan.expert_offset[El] = static_cast<std::int32_t>(offset);
    if (offset > p.capacity_rows) {
      status.code = PlanStatus::capacity_exceeded;
      status.value = offset;
      status.limit = p.capacity_rows;
      *plan.num_tiles = 0;
    } else {
      *plan.num_tiles = static_cast<std::int32_t>(offset / p.block_m);
    }
    if (status.code == PlanStatus::ok && p.ring_rows > 0) {  // every expert's minibatches fit the ring together
      const std::int64_t mb = p.ring_minibatch_rows;
      for (int e = 0; e < El; ++e) {
        const std::int64_t first = plan.expert_offset[e], rows = padded[e];
        if (rows > 0 && ((first + rows - 1) / mb - first / mb + 1) * mb > p.ring_rows) {
          status.code = PlanStatus::ring_too_small;
          status.index = e;
          status.value = rows;
          status.limit = p.ring_rows;
          *plan.num_tiles = 0;
          break;
        }
      }
    }
  }
  __syncthreads();
  if (status.code != PlanStatus::ok) return;
  for (int e = threadIdx.x; e < El; e += blockDim.x) {
    const std::int32_t first_tile = plan.expert_offset[e] / p.block_m;
    for (std::int32_t t = 0; t < padded[e] / p.block_m; ++t) {
      plan.tile_expert[first_tile + t] = e;
      plan.tile_row[first_tile + t] = plan.expert_offset[e] + t * p.block_m;
    }
  }
}

__global__ void place_kernel(PlanProblem p, DevicePlanView plan) {
  extern __shared__ std::int32_t next_row[];  // [E_l]
  if (plan.status->code != PlanStatus::ok) return;
  const int lane = threadIdx.x;
  const int El = p.num_local_experts;
  for (int e = lane; e < El; e += kWarp)
    next_row[e] = plan.expert_offset[e] + plan.chunk_base[blockIdx.x * El + e];
  __syncwarp();
  const std::int64_t first_expert = p.rank * El;
  const std::int64_t own_begin = p.rank * p.tokens_times_k;
  const std::int64_t begin = blockIdx.x * kPlanChunk;
  const std::int64_t end = min(begin + kPlanChunk, p.num_ids);
  for (std::int64_t base = begin; base < end; base += kWarp) {
    const std::int64_t i = base + lane;
    int local = -1;
    if (i < end) {
      const std::int64_t e = load_id(p, i);
      if (e >= first_expert && e < first_expert + El) local = static_cast<int>(e - first_expert);
    }
    const unsigned peers = __match_any_sync(0xffffffffu, local);
    if (local >= 0) {
      const int before = __popc(peers & ((1u << lane) - 1u));
      const std::int32_t row = next_row[local] + before;
      plan.row_pair[row] = static_cast<std::int32_t>(i);
      if (i >= own_begin && i < own_begin + p.tokens_times_k) plan.pair_row[i - own_begin] = row;
    }
    __syncwarp();
    if (local >= 0 && lane == __ffs(peers) - 1) next_row[local] += __popc(peers);
    __syncwarp();
  }
}

}  // namespace

void load_plan_kernels() {
  load_kernel(reset_kernel);
  load_kernel(count_kernel);
  load_kernel(scan_kernel);
  load_kernel(place_kernel);
}

void launch_plan(const PlanProblem& p, const DevicePlanView& plan, cudaStream_t stream) {
  const std::int64_t chunks = (p.num_ids + kPlanChunk - 1) / kPlanChunk;
  const std::size_t smem = sizeof(std::int32_t) * p.num_local_experts;
  // (the reset: a grid-stride fill, at most two CTAs an H200 SM)
  const std::int64_t reset_items = std::max({p.capacity_rows, p.tokens_times_k, p.zero_count});
  reset_kernel<<<static_cast<unsigned>(std::clamp<std::int64_t>((reset_items + 255) / 256, 1, 264)), 256, 0, stream>>>(
      p, plan);
  if (chunks > 0) count_kernel<<<static_cast<unsigned>(chunks), kWarp, smem, stream>>>(p, plan);
  // (at most 48 KB without an opt-in: E_l <= 6144, which plan_device checks)
  const std::size_t scan_smem = sizeof(std::int32_t) * p.num_local_experts * (1 + scan_groups(p.num_local_experts));
  scan_kernel<<<1, kScanThreads, scan_smem, stream>>>(p, plan, chunks);
  if (chunks > 0) place_kernel<<<static_cast<unsigned>(chunks), kWarp, smem, stream>>>(p, plan);
}

}  // namespace mok::kernels
