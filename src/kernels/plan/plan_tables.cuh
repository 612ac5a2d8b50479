// The device plan's tables as the persistent kernels read them (kernels/plan/plan.cu makes
// them; mok/device_plan.hpp's DevicePlanView owns them): each plan row's pair, each
// M-tile's expert and first row, each expert's first row, each pair's row.
#pragma once

#include <cstdint>

#include "mok/kernel_status.hpp"  // PlanStatus

namespace mok::kernels {

struct PlanTables {
  const std::int32_t* row_pair;       // [capacity_rows]: the (global) pair t * k + j of each row; -1 = padding
  const std::int32_t* tile_expert;    // [capacity_rows / 128]
  const std::int32_t* tile_row;       // [capacity_rows / 128]
  const std::int32_t* num_tiles;      // [1]
  const std::int32_t* expert_offset;  // [E_l + 1]: each expert's first row (segments padded to the M-tile)
  const std::int32_t* pair_row;       // [T * k]: the row of each pair (one GPU)
  const PlanStatus* status;           // the planner's verdict: nothing runs on a bad plan
};

}  // namespace mok::kernels
