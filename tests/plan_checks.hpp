// Invariants every plan must satisfy, shared by the host- and device-planner tests.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "mok/plan.hpp"

namespace mok::testing {

inline void expect_plan_invariants(const MoeShape& s, const Plan& p, const std::vector<std::int32_t>& all_ids) {
  const std::int64_t El = s.num_local_experts, k = s.top_k, T = p.tokens;
  const std::int64_t first = p.rank * El;
  ASSERT_EQ(static_cast<std::int64_t>(p.expert_offset.size()), El + 1);
  EXPECT_EQ(p.expert_offset[0], 0);
  std::vector<int> seen(all_ids.size(), 0);
  std::int64_t expected_tiles = 0;
  for (std::int64_t e = 0; e < El; ++e) {
    std::int64_t count = 0;
    for (std::int32_t id : all_ids) count += (id == first + e);
    EXPECT_EQ(p.expert_rows[e], count) << "expert " << e;
    const std::int64_t begin = p.expert_offset[e], end = p.expert_offset[e + 1];
    EXPECT_EQ((end - begin) % p.block_m, 0) << "expert " << e;
    EXPECT_EQ(end - begin, (count + p.block_m - 1) / p.block_m * p.block_m) << "expert " << e;
    expected_tiles += (end - begin) / p.block_m;
    for (std::int64_t r = begin; r < end; ++r) {
      const std::int32_t pair = p.row_pair[r];
      if (r < begin + count) {
        ASSERT_GE(pair, 0) << "row " << r;
        EXPECT_EQ(all_ids[pair], first + e) << "row " << r << " holds pair " << pair;
        ++seen[pair];
        if (r > begin) EXPECT_LT(p.row_pair[r - 1], pair) << "rows of expert " << e << " out of order at " << r;
      } else {
        EXPECT_EQ(pair, -1) << "padding row " << r;
      }
    }
  }
  for (std::size_t i = 0; i < all_ids.size(); ++i) {
    const bool local = all_ids[i] >= first && all_ids[i] < first + El;
    EXPECT_EQ(seen[i], local ? 1 : 0) << "pair " << i;
  }
  ASSERT_EQ(p.num_tiles(), expected_tiles);
  for (std::int64_t t = 0; t < p.num_tiles(); ++t) {
    const std::int32_t e = p.tile_expert[t];
    EXPECT_GE(p.tile_row[t], p.expert_offset[e]);
    EXPECT_LT(p.tile_row[t], p.expert_offset[e + 1]);
    if (t > 0) EXPECT_EQ(p.tile_row[t], p.tile_row[t - 1] + p.block_m);
  }
  ASSERT_EQ(static_cast<std::int64_t>(p.pair_row.size()), T * k);
  for (std::int64_t i = 0; i < T * k; ++i) {
    const std::int32_t id = all_ids[p.rank * T * k + i];
    const bool local = id >= first && id < first + El;
    if (!local) {
      EXPECT_EQ(p.pair_row[i], -1) << "own pair " << i;
    } else {
      ASSERT_GE(p.pair_row[i], 0) << "own pair " << i;
      EXPECT_EQ(p.row_pair[p.pair_row[i]], p.rank * T * k + i);
    }
  }
}

inline void expect_plans_equal(const Plan& a, const Plan& b) {
  EXPECT_EQ(a.expert_rows, b.expert_rows);
  EXPECT_EQ(a.expert_offset, b.expert_offset);
  EXPECT_EQ(a.row_pair, b.row_pair);
  EXPECT_EQ(a.tile_expert, b.tile_expert);
  EXPECT_EQ(a.tile_row, b.tile_row);
  EXPECT_EQ(a.pair_row, b.pair_row);
}

}  // namespace mok::testing
