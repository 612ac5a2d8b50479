#include <gtest/gtest.h>

#include "mok/error.hpp"
#include "mok/plan.hpp"
#include "mok/routing.hpp"
#include "kernels/slot_rows.cuh"
#include "plan_checks.hpp"

namespace mok {
namespace {

MoeShape shape(std::int64_t E, std::int64_t El, std::int64_t k) {
  MoeShape s;
  s.hidden = 64, s.intermediate = 64, s.num_experts = E, s.num_local_experts = El, s.top_k = k;
  return s;
}

TEST(HostPlan, HandWorkedExample) {
  // tokens: t0 -> {1, 0}, t1 -> {0, 3}, t2 -> {-1, 1}; pair id = t*k + j.
  const std::vector<std::int32_t> ids{1, 0, 0, 3, -1, 1};
  const Plan p = plan_host(shape(4, 4, 2), 3, ids, 0, {.block_m = 64});
  EXPECT_EQ(p.expert_rows, (std::vector<std::int32_t>{2, 2, 0, 1}));
  EXPECT_EQ(p.expert_offset, (std::vector<std::int32_t>{0, 64, 128, 128, 192}));
  EXPECT_EQ(p.row_pair[0], 1);
  EXPECT_EQ(p.row_pair[1], 2);
  EXPECT_EQ(p.row_pair[2], -1);
  EXPECT_EQ(p.row_pair[64], 0);
  EXPECT_EQ(p.row_pair[65], 5);
  EXPECT_EQ(p.row_pair[128], 3);
  EXPECT_EQ(p.tile_expert, (std::vector<std::int32_t>{0, 1, 3}));
  EXPECT_EQ(p.tile_row, (std::vector<std::int32_t>{0, 64, 128}));
  EXPECT_EQ(p.pair_row, (std::vector<std::int32_t>{64, 0, 1, 128, -1, 65}));
}

struct Case {
  const char* name;
  RoutingKind routing;
  std::int64_t tokens, E, El, k, block_m;
};

class HostPlanCases : public ::testing::TestWithParam<Case> {};

TEST_P(HostPlanCases, Invariants) {
  const Case c = GetParam();
  const MoeShape s = shape(c.E, c.El, c.k);
  const std::int64_t ep = c.E / c.El;
  std::vector<std::int32_t> all;
  for (std::int64_t r = 0; r < ep; ++r) {
    auto ids = make_routing(c.routing, c.tokens, c.E, c.k, 1000 + r);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  std::int64_t routed = 0;
  for (std::int64_t r = 0; r < ep; ++r) {
    const Plan p = plan_host(s, c.tokens, all, r, {.block_m = c.block_m});
    testing::expect_plan_invariants(s, p, all);
    routed += p.routed_rows();
  }
  std::int64_t valid = 0;
  for (std::int32_t id : all) valid += id >= 0;
  EXPECT_EQ(routed, valid) << "every valid pair lands on exactly one rank";
}

INSTANTIATE_TEST_SUITE_P(
    HostPlan, HostPlanCases,
    ::testing::Values(Case{"uniform", RoutingKind::uniform, 1000, 16, 16, 4, 128},
                      Case{"skewed", RoutingKind::skewed, 777, 8, 8, 2, 64},
                      Case{"one_expert_k1", RoutingKind::one_expert, 513, 8, 8, 1, 128},
                      Case{"empty_experts", RoutingKind::first_half, 300, 32, 32, 4, 64},
                      Case{"padded", RoutingKind::padded, 301, 8, 8, 3, 128},
                      Case{"single_token", RoutingKind::uniform, 1, 8, 8, 2, 128},
                      Case{"single_local_expert", RoutingKind::uniform, 200, 4, 1, 2, 64},
                      Case{"ep4_uniform", RoutingKind::uniform, 250, 16, 4, 4, 64},
                      Case{"ep8_skewed", RoutingKind::skewed, 123, 64, 8, 8, 128},
                      Case{"ep2_empty_rank", RoutingKind::first_half, 99, 8, 4, 2, 64}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(HostPlan, RowsFollowGlobalTokenOrderAcrossRanks) {
  // Rank 1 owns experts 2..3; its rows of expert 2 come from rank 0 first, then rank 1.
  const MoeShape s = shape(4, 2, 1);
  const std::vector<std::int32_t> all{2, 0, 2, /* rank 1: */ 2, 3, 2};
  const Plan p = plan_host(s, 3, all, 1, {.block_m = 64});
  EXPECT_EQ(p.expert_rows, (std::vector<std::int32_t>{4, 1}));
  EXPECT_EQ(std::vector<std::int32_t>(p.row_pair.begin(), p.row_pair.begin() + 4),
            (std::vector<std::int32_t>{0, 2, 3, 5}));
  EXPECT_EQ(p.pair_row, (std::vector<std::int32_t>{2, 64, 3}));
}

TEST(HostPlan, CapacityExceededIsAnError) {
  const MoeShape s = shape(8, 8, 2);
  const auto ids = make_routing(RoutingKind::uniform, 500, 8, 2, 3);
  try {
    plan_host(s, 500, ids, 0, {.block_m = 128, .capacity_rows = 512});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity exceeded on rank 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("capacity is 512"), std::string::npos) << e.what();
  }
}

TEST(HostPlan, RejectsBadIdsAndSizes) {
  const MoeShape s = shape(8, 8, 2);
  std::vector<std::int32_t> ids{0, 1, 2, 9};
  EXPECT_THROW(
      {
        try {
          plan_host(s, 2, ids, 0);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("got 9 at rank 0, token 1, slot 1"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  ids[3] = -2;
  EXPECT_THROW(plan_host(s, 2, ids, 0), Error);
  EXPECT_THROW(plan_host(s, 3, ids, 0), Error);          // size mismatch
  const std::vector<std::int32_t> good{0, 1, 2, 3};
  EXPECT_THROW(plan_host(s, 2, good, 1), Error);  // rank out of range at EP=1
}

// On one GPU the x rows live in the upper half of the fp32 slot buffer: a GEMM2 tile must
// wait for exactly the x rows its slot rows share bytes with (checked byte by byte, in
// units of H), and those lie in M-tiles at or below its own (no wait on a later task).
TEST(SlotRows, XRowsUnderSlotTilesAreTheOnesSharingBytes) {
  constexpr long long kTile = 128;
  for (long long capacity : {128ll, 300ll, 1278ll, 4350ll, 8192ll}) {
    for (long long used = kTile; used <= capacity; used += kTile) {
      for (long long row0 = 0; row0 < used; row0 += kTile) {
        const kernels::RowRange x = kernels::x_rows_under_slots(row0, kTile, capacity, used);
        for (long long r = 0; r < used; ++r) {
          // slot rows [row0, row0 + 128): bytes [4 row0, 4 (row0 + 128)); x row r: [2 (C + r), 2 (C + r + 1))
          const bool shares = 2 * (capacity + r) < 4 * (row0 + kTile) && 2 * (capacity + r + 1) > 4 * row0;
          const bool waited = r >= x.first && r < x.end;
          ASSERT_EQ(shares, waited) << "capacity " << capacity << " used " << used << " tile row " << row0 << " x row " << r;
          if (waited) ASSERT_LE(r / kTile, row0 / kTile) << "a wait on a later M-tile could deadlock";
        }
      }
    }
  }
}

}  // namespace
}  // namespace mok
