// Launchers of the planner kernels (src/kernels/plan/plan.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mok/device_plan.hpp"

namespace mok::kernels {

// One warp per chunk of ids: chunk order + in-warp order = global pair-id order.
inline constexpr std::int64_t kPlanChunk = 512;
// The most local experts one rank's plan takes: scan_kernel keeps 2 ints an expert in its
// 48 KB of shared memory.
inline constexpr std::int64_t kMaxPlanLocalExperts = 6144;

struct PlanProblem {
  const void* ids;  // [ep * T * k]
  bool ids_are_i64;
  std::int64_t num_ids;  // ep * T * k
  std::int64_t tokens_times_k;
  std::int64_t rank;
  std::int32_t num_experts, num_local_experts, block_m;
  std::int64_t capacity_rows;
  std::int64_t ring_minibatch_rows, ring_rows;  // RingFit (ring_rows 0: no check)
  int* zero_words;  // the caller's words reset_kernel also zeroes (zero_count of them)
  std::int64_t zero_count;
};

void launch_plan(const PlanProblem& problem, const DevicePlanView& plan, cudaStream_t stream);

}  // namespace mok::kernels
