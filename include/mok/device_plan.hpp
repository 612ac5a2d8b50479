// The plan of mok/plan.hpp built on the GPU, stream-ordered, with no host
// synchronisation: counts stay on the device. Bit-identical to plan_host().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "mok/kernel_status.hpp"  // PlanStatus
#include "mok/plan.hpp"
#include "mok/types.hpp"

namespace mok {

// Raw device pointers of a plan, as the kernels take them.
struct DevicePlanView {
  std::int32_t* expert_rows;    // [E_l]
  std::int32_t* expert_offset;  // [E_l + 1]
  std::int32_t* row_pair;       // [capacity_rows]; -1 = padding or unused
  std::int32_t* tile_expert;    // [capacity_rows / block_m]
  std::int32_t* tile_row;       // [capacity_rows / block_m]
  std::int32_t* num_tiles;      // [1]
  std::int32_t* pair_row;       // [T * k]
  std::int32_t* chunk_base;     // scratch [num_chunks * E_l]
  PlanStatus* status;           // [1]
};

// Rows of the plan table a DevicePlan made with `options` has (block_m > 0).
std::int64_t device_plan_capacity_rows(const MoeShape& shape, std::int64_t tokens, const PlanOptions& options);

class DevicePlan {
 public:
  // Allocates the plan of one rank for up to `max_tokens` tokens per rank on the current
  // device (options.capacity_rows: the rows for max_tokens). It plans max_tokens tokens
  // until set_tokens() says otherwise.
  DevicePlan(const MoeShape& shape, std::int64_t max_tokens, const PlanOptions& options = {});
  ~DevicePlan();
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;

  // The next plan_device() plans `tokens` (<= max_tokens()) tokens per rank into the first
  // `capacity_rows` rows (a positive multiple of block_m, <= allocated_rows(); 0: the worst
  // case for `tokens`, capped at allocated_rows()). Host state: set it before the call that
  // plans, on the thread that enqueues it.
  void set_tokens(std::int64_t tokens, std::int64_t capacity_rows = 0);

  const DevicePlanView& view() const { return view_; }
  const MoeShape& shape() const { return shape_; }
  std::int64_t tokens() const { return tokens_; }          // of the current plan
  std::int64_t max_tokens() const { return max_tokens_; }  // it was allocated for
  std::int64_t block_m() const { return block_m_; }
  std::int64_t capacity_rows() const { return capacity_rows_; }    // of the current plan
  std::int64_t allocated_rows() const { return allocated_rows_; }  // >= capacity_rows()
  std::int64_t max_tiles() const { return capacity_rows_ / block_m_; }
  std::int64_t allocated_tiles() const { return allocated_rows_ / block_m_; }
  std::int64_t num_chunks() const;

  // Synchronises `stream` and throws mok::Error if the planner flagged bad input.
  void check(cudaStream_t stream) const;
  // Synchronises `stream` and copies the plan back (tests, debugging).
  Plan to_host(cudaStream_t stream, std::int64_t rank) const;

 private:
  std::int64_t chunks_for(std::int64_t tokens) const;

  MoeShape shape_;
  std::int64_t max_tokens_, tokens_, block_m_, allocated_rows_, capacity_rows_;
  void* memory_ = nullptr;
  DevicePlanView view_{};
};

// A ring token buffer the plan's rows will stream through in the EP backward, whose
// weight-gradient tasks read all of an expert's rows at once: every minibatch an expert's
// rows touch must fit in the ring together. ring_rows = 0: no ring (nothing to check).
struct RingFit {
  std::int64_t minibatch_rows = 0, ring_rows = 0;
};

// Plans `rank` from the routing of every rank: all_topk_ids is [ep, T, k] (or [T, k] when
// ep = 1), i32 or i64, on the plan's device. Launches on `stream`; never synchronises.
// With `ring`, an expert whose rows do not fit it is flagged (PlanStatus::ring_too_small).
// also_zero: device words the planner's first kernel sets to 0 besides its own state (the
// caller's dependency counters: one launch fewer than a memset of them).
void plan_device(const TensorView& all_topk_ids, std::int64_t rank, DevicePlan& plan,
                 cudaStream_t stream, const RingFit& ring = {}, std::span<int> also_zero = {});

}  // namespace mok
