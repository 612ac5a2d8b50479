#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mok/error.hpp"
#include "mok/plan.hpp"
#include "mok/routing.hpp"
#include "host/layer_launch.hpp"
#include "kernels/common/slot_rows.cuh"
#include "kernels/fp8/tile_order.cuh"
#include "kernels/common/sm_sides.hpp"
#include "kernels/forward/interleave.cuh"
#include "plan_checks.hpp"

namespace mok {
namespace {

template <typename F>
void expect_error_naming(F&& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no error (expected one naming " << needle << ")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

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

// Sizes at the ends of their range are named, not wrapped (a review found a block_m of 2^32 wrote
// through a null row table, a top_k that does not divide the ids read past them, and a capacity
// factor of 1e17 gave a negative capacity).
TEST(HostPlan, RejectsSizesThatWouldWrap) {
  const MoeShape s = shape(4, 4, 1);
  const std::vector<std::int32_t> ids{0, 1, 2, 3};
  for (std::int64_t block_m : {std::int64_t{1} << 31, std::int64_t{1} << 32, std::int64_t{1} << 17})
    expect_error_naming([&] { plan_host(s, 4, ids, 0, {.block_m = block_m}); }, "argument 'block_m'");
  expect_error_naming([&] { plan_host(s, 4, ids, 0, {.block_m = 128, .capacity_rows = std::int64_t{1} << 40}); },
                      "argument 'capacity_rows'");
  EXPECT_EQ(plan_host(s, 4, ids, 0, {.block_m = 1 << 16}).padded_rows(), 4 << 16);
  expect_error_naming([&] { make_routing_weights({0, 1, 2}, 2, 1); }, "argument 'top_k'");
  expect_error_naming([&] { make_routing_weights({0, 1}, 0, 1); }, "argument 'top_k'");
  Config huge;
  huge.capacity_factor = 1e17;
  EXPECT_EQ(plan_capacity_rows(shape(8, 8, 2), huge, 1024, 128), 2 * 1024 + 8 * 127);  // the worst case
}

// On one GPU the x rows live in the last bytes of the bf16 slot buffer (bf16 rows each under
// its own slot row, E4M3 rows its upper half): a GEMM2 tile must wait for exactly the x rows
// its slot rows share bytes with (checked byte by byte, in units of H), and those lie in
// M-tiles at or below its own (no wait on a later task).
TEST(SlotRows, XRowsUnderSlotTilesAreTheOnesSharingBytes) {
  constexpr long long kTile = 128;
  for (int per_slot : {1, 2}) {
    const long long xb = 2 / per_slot;  // bytes of an x value
    for (long long capacity : {128ll, 300ll, 1278ll, 4350ll, 8192ll}) {
      for (long long used = kTile; used <= capacity; used += kTile) {
        for (long long row0 = 0; row0 < used; row0 += kTile) {
          const kernels::RowRange x = kernels::x_rows_under_slots(row0, kTile, capacity, used, per_slot);
          for (long long r = 0; r < used; ++r) {
            // slot rows [row0, row0 + 128): bytes [2 row0, 2 (row0 + 128)); x row r: [(2 - xb) C + xb r, ... + xb)
            const long long begin = (2 - xb) * capacity + xb * r;
            const bool shares = begin < 2 * (row0 + kTile) && begin + xb > 2 * row0;
            const bool waited = r >= x.first && r < x.end;
            ASSERT_EQ(shares, waited) << "per slot " << per_slot << " capacity " << capacity << " used " << used
                                      << " tile row " << row0 << " x row " << r;
            if (waited) ASSERT_LE(r / kTile, row0 / kTile) << "a wait on a later M-tile could deadlock";
          }
        }
      }
    }
  }
}

// The FP8 forward's buffers: its E4M3 x rows in the bf16 slots' upper half (where
// x_rows_under_slots(..., 2) finds them), x's scale bytes, h, h's scale bytes and the shared h
// after the slots, nothing overlapping, 512-byte aligned.
TEST(ScratchLayout, Fp8ForwardXRowsInTheSlotsUpperHalf) {
  using U = std::uintptr_t;
  const U base = U{1} << 39;
  auto at = [](const void* p) { return reinterpret_cast<U>(p); };
  for (std::int64_t H : {256, 2048, 7168})
    for (std::int64_t I : {128, 768, 2048})
      for (std::int64_t Is : {0, 256}) {
        detail::ScratchShape sh;
        sh.shape.hidden = H, sh.shape.intermediate = I, sh.shape.num_experts = sh.shape.num_local_experts = 16;
        sh.shape.top_k = 4, sh.shape.shared_intermediate = Is;
        sh.tokens = 1000, sh.precision = Precision::fp8;
        sh.capacity = plan_capacity_rows(sh.shape, {}, sh.tokens, detail::kTileRows) / 128 * 128;
        const std::int64_t cap = sh.capacity, Tpad = detail::shared_tiles(sh.shape, sh.tokens) * detail::kTileRows;
        const detail::CallBuffers f = detail::forward_buffers(sh, reinterpret_cast<void*>(base));
        const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + " Is " + std::to_string(Is);
        EXPECT_EQ(at(f.x_fp8), base + cap * H) << what;
        const U slots_end = base + 2 * (cap + Tpad) * H;
        const U regions[][2] = {{at(f.x_exps), at(f.x_exps) + (H / 128) * cap},
                                {at(f.h_fp8), at(f.h_fp8) + cap * I},
                                {at(f.h_exps), at(f.h_exps) + (I / 128) * cap},
                                {at(f.shared_hidden), at(f.shared_hidden) + 2 * Tpad * Is}};
        U previous = slots_end;
        for (const auto& r : regions) {
          EXPECT_TRUE(r[0] >= previous && (r[0] - base) % 512 == 0) << what;
          previous = r[1];
        }
        EXPECT_EQ(base + f.bytes, previous) << what;
        auto padded = [](std::int64_t bytes) { return (bytes + 511) / 512 * 512; };
        EXPECT_EQ(f.bytes, 2 * (cap + Tpad) * H + cap * I + padded((H / 128) * cap) + padded((I / 128) * cap) + 2 * Tpad * Is)
            << what << ": nothing but the scale bytes, h and the shared h beyond the slots";
      }
}

// Where a call's buffers lie in its scratch (and, with bf16 weight gradients, in the
// W_gate / W_up gradient buffers): every buffer inside its block, no two overlapping,
// the forward's x rows under its bf16 slot rows, the backward's dy rows / w h in
// the gradient buffers exactly when they fit, and the sizes each mode asks for.
// Config::interleave_rows: every routed GEMM tile exactly once, and every GEMM1 tile of
// M-tiles at or below m before the first GEMM2 tile of m (what a GEMM2 tile waits for:
// its own M-tile's h, and on one GPU the x rows under its slot rows), so that every wait
// is on a lower-numbered task.
TEST(Schedule, InterleavedOrderCoversEveryTileAndWaitsOnlyBackwards) {
  for (int m_routed = 1; m_routed <= 40; ++m_routed)
    for (int chunk : {1, 2, 3, 5, 32})
      for (auto [n1, n2] : {std::pair{1, 1}, {2, 3}, {4, 28}, {16, 8}}) {
        SCOPED_TRACE(::testing::Message() << m_routed << " M-tiles, chunks of " << chunk << ", n " << n1 << "/" << n2);
        const int total = m_routed * (n1 + n2);
        std::vector<int> g1_last(m_routed, -1), g2_first(m_routed, total), seen(total, 0);
        for (int task = 0; task < total; ++task) {
          const auto t = kernels::interleaved_task(m_routed, n1, n2, chunk, task);
          ASSERT_TRUE(t.m >= 0 && t.m < m_routed && t.n >= 0 && t.n < (t.gemm2 ? n2 : n1)) << "task " << task;
          ++seen[(t.gemm2 ? m_routed * n1 + t.m * n2 : t.m * n1) + t.n];
          if (t.gemm2) g2_first[t.m] = std::min(g2_first[t.m], task);
          else g1_last[t.m] = std::max(g1_last[t.m], task);
        }
        EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), total);
        int g1_done = -1;  // the last GEMM1 task of M-tiles 0 .. m
        for (int m = 0; m < m_routed; ++m) {
          g1_done = std::max(g1_done, g1_last[m]);
          EXPECT_LT(g1_done, g2_first[m]) << "M-tile " << m;
        }
      }
}

// near_far_cut (bench/l2_sides.cu): the cut falls in the widest gap of the
// latencies — with an H200's measured two sides (near 278–302 cycles, far 364–388) between them,
// not halfway to the DRAM's ~680, which put every SM on one side — and there is none without a
// gap of 10 % (one side) or with fewer than two SMs that ran.
TEST(L2Sides, CutFallsInTheWidestGap) {
  std::vector<double> lat;
  for (int s = 0; s < 132; ++s) lat.push_back((s / 2) % 3 == 0 ? 278.0 + s % 25 : 364.0 + s % 25);
  lat[5] = -1.0;  // an SM that had no CTA
  const double cut = kernels::near_far_cut(lat);
  EXPECT_GT(cut, 302.0);
  EXPECT_LT(cut, 364.0);
  std::vector<double> one_side;
  for (int s = 0; s < 132; ++s) one_side.push_back(280.0 + s % 20);
  EXPECT_LT(kernels::near_far_cut(one_side), 0.0);
  EXPECT_LT(kernels::near_far_cut({290.0}), 0.0);
  EXPECT_LT(kernels::near_far_cut({290.0, -1.0, 0.0}), 0.0);
  EXPECT_DOUBLE_EQ(kernels::near_far_cut({400.0, 300.0}), 350.0);
}

TEST(ScratchLayout, BuffersFitAndNeverOverlap) {
  struct Region {
    const char* name;
    std::uintptr_t begin, end;
  };
  const std::uintptr_t base = std::uintptr_t{1} << 40, gate = std::uintptr_t{2} << 40, up = std::uintptr_t{3} << 40;
  auto check = [](const std::vector<Region>& regions, std::uintptr_t lo, std::uintptr_t hi, const std::string& what) {
    for (std::size_t i = 0; i < regions.size(); ++i) {
      const Region& r = regions[i];
      EXPECT_TRUE(r.begin >= lo && r.end <= hi && r.begin <= r.end) << what << ": " << r.name << " outside its block";
      for (std::size_t j = 0; j < i; ++j)
        EXPECT_TRUE(r.end <= regions[j].begin || regions[j].end <= r.begin)
            << what << ": " << r.name << " overlaps " << regions[j].name;
    }
  };
  auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  for (std::int64_t H : {64, 256, 7168})
    for (std::int64_t I : {64, 512, 2048})
      for (std::int64_t E : {1, 8, 48})
        for (std::int64_t k : {1, 2, 8})
          for (std::int64_t Is : {0, 128})
            for (std::int64_t T : {1, 300, 8192}) {
              if (k > E) continue;
              detail::ScratchShape sh;
              sh.shape.hidden = H, sh.shape.intermediate = I, sh.shape.num_experts = sh.shape.num_local_experts = E;
              sh.shape.top_k = k, sh.shape.shared_intermediate = Is;
              sh.tokens = T;
              sh.capacity = plan_capacity_rows(sh.shape, {}, T, detail::kTileRows);
              const std::int64_t cap = sh.capacity, Tpad = detail::shared_tiles(sh.shape, T) * detail::kTileRows;
              sh.saved_elements = 2 * (cap * I + Tpad * Is) + 8;
              const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + " E " +
                                       std::to_string(E) + " k " + std::to_string(k) + " Is " + std::to_string(Is) +
                                       " T " + std::to_string(T);
              void* b = reinterpret_cast<void*>(base);
              const detail::CallBuffers f = detail::forward_buffers(sh, b);
              check({{"slots", at(f.slots), at(f.slots) + 2 * (cap + Tpad) * H},
                     {"h", at(f.hidden), at(f.hidden) + 2 * cap * I},
                     {"shared h", at(f.shared_hidden), at(f.shared_hidden) + 2 * Tpad * Is}},
                    base, base + f.bytes, what + " forward");
              EXPECT_EQ(at(f.x_rows), at(f.slots)) << what << ": x rows not under their own slot rows";
              EXPECT_EQ(f.bytes, 2 * (cap + Tpad) * H + 2 * (cap * I + Tpad * Is)) << what;
              // Gradient buffers: none (f32), two apart, or one block (up right after gate).
              enum class Grads { f32, apart, one_block };
              // (whole rows, and two column blocks: a save layout's x rows W wide, a recompute one's
              // room whole rows all the same)
              const std::int64_t two_blocks = std::min(H, ((H + 255) / 256 + 1) / 2 * 256);
              for (bool blocked : {false, true})
              for (Training mode : {Training::save, Training::recompute})
                for (Grads grads : {Grads::apart, Grads::one_block, Grads::f32}) {
                  if (blocked && two_blocks == H) continue;  // (one tile: one block)
                  const std::int64_t W = blocked ? two_blocks : H;
                  sh.training = mode;
                  sh.block_columns = W;
                  const std::int64_t room_columns = mode == Training::save ? W : H;
                  const bool bf16 = grads != Grads::f32, block = grads == Grads::one_block;
                  const std::uintptr_t up_at = block ? gate + 2 * E * I * H : up;
                  void* g = bf16 ? reinterpret_cast<void*>(gate) : nullptr;
                  void* u = bf16 ? reinterpret_cast<void*>(up_at) : nullptr;
                  const detail::CallBuffers w = detail::backward_buffers(sh, b, g, u);
                  const std::string wb = what + (mode == Training::save ? " save" : " recompute") +
                                         (!bf16 ? " f32" : block ? " bf16 one block" : " bf16 apart") +
                                         (blocked ? " two column blocks" : "");
                  const bool in_grads = bf16;  // (save and recompute alike: the recompute's GEMM1 runs first)
                  // Apart: dy rows in gate's E I H, w h in up's, each where it fits. One block of
                  // 2 E I H: both (dy rows first) if they fit together, else the larger that fits.
                  const std::int64_t room = 2 * E * I * H, dy = cap * H, hw = cap * I;
                  const bool both = dy + hw <= room;
                  const bool dy_in = in_grads && (block ? both || (dy <= room && (dy >= hw || hw > room)) : cap <= E * I);
                  const bool hw_in = in_grads && (block ? both || (!dy_in && hw <= room) : cap <= E * H);
                  const std::uintptr_t hw_expected = block ? gate + (dy_in ? 2 * dy : 0) : up;
                  const std::uintptr_t grads_end = block ? gate + 4 * E * I * H : 0;
                  EXPECT_EQ(at(w.dy_rows) == gate, dy_in) << wb;
                  EXPECT_EQ(at(w.hidden) == hw_expected, hw_in) << wb;
                  EXPECT_EQ(w.rows_in_grads, dy_in || hw_in) << wb;
                  EXPECT_EQ(w.dx_rows, w.x_rows) << wb;
                  EXPECT_EQ(w.row_columns, W) << wb;
                  std::vector<Region> in_scratch{{"x rows", at(w.x_rows), at(w.x_rows) + 2 * cap * room_columns},
                                                 {"shared dx rows", at(w.shared_dx_rows), at(w.shared_dx_rows) + 2 * Tpad * H},
                                                 {"shared w h", at(w.shared_hidden), at(w.shared_hidden) + 2 * Tpad * Is}};
                  if (!dy_in) in_scratch.push_back({"dy rows", at(w.dy_rows), at(w.dy_rows) + 2 * cap * H});
                  if (!hw_in) in_scratch.push_back({"w h", at(w.hidden), at(w.hidden) + 2 * cap * I});
                  if (mode == Training::recompute)
                    in_scratch.push_back({"recompute", at(w.recompute), at(w.recompute) + 2 * sh.saved_elements});
                  check(in_scratch, base, base + w.bytes, wb);
                  if (block) {
                    std::vector<Region> in_block;
                    if (dy_in) in_block.push_back({"dy rows", gate, gate + 2 * cap * H});
                    if (hw_in) in_block.push_back({"w h", hw_expected, hw_expected + 2 * cap * I});
                    check(in_block, gate, grads_end, wb);
                    // (TMA: every row buffer 16-byte aligned)
                    EXPECT_EQ(at(w.hidden) % 16, 0u) << wb;
                  } else {
                    if (dy_in) check({{"dy rows", gate, gate + 2 * cap * H}}, gate, gate + 2 * E * I * H, wb);
                    if (hw_in) check({{"w h", up, up + 2 * cap * I}}, up, up + 2 * E * I * H, wb);
                  }
                  // The recompute runs the forward kernel's GEMM1 on this layout (its x rows the backward's,
                  // after the dy rows where those are in the scratch; its slots unused).
                  if (mode == Training::recompute) EXPECT_EQ(at(w.x_rows), base + (dy_in ? 0 : 2 * cap * H)) << wb;
                  std::int64_t expect = 2 * cap * room_columns + 2 * Tpad * H + 2 * Tpad * Is + (dy_in ? 0 : 2 * cap * H) +
                                        (hw_in ? 0 : 2 * cap * I) + (mode == Training::recompute ? 2 * sh.saved_elements : 0);
                  EXPECT_EQ(w.bytes, expect) << wb;
                  if (block) {  // never more than with the gradients apart
                    const detail::CallBuffers apart = detail::backward_buffers(sh, b, g, reinterpret_cast<void*>(up));
                    EXPECT_LE(w.bytes, apart.bytes) << wb;
                  }
                }
            }
}

// An EP rank's slot buffer: the routed dx rows keep a room only where the rank stores them (a
// group of one) or FP8's weight gradients use it; a bf16 rank with peers pushes its dx rows, so
// its buffer is the dy rows and the shared expert's rows — capacity x H bf16 less (at the worst-case
// capacity of EP x T x k rows, the largest buffer it held). The shared rows sit where the forward
// puts its shared slot rows (after capacity rows) whenever the dx rows have no room.
TEST(ScratchLayout, RankSlotsKeepDxRowsOnlyWhereStored) {
  for (std::int64_t ep : {1, 2, 8})
    for (Precision precision : {Precision::bf16, Precision::fp8})
      for (Training training : {Training::off, Training::save, Training::recompute}) {
        MoeShape shape;
        shape.hidden = 512, shape.intermediate = 256, shape.top_k = 2;
        shape.num_local_experts = 4, shape.num_experts = 4 * ep;
        const std::int64_t cap = 1280, tpad = 256;
        const detail::RankSlotRows r = detail::rank_slot_rows(shape, training, precision, cap, tpad);
        const std::string what = "ep " + std::to_string(ep) + (precision == Precision::fp8 ? " fp8 " : " bf16 ") +
                                 std::to_string(static_cast<int>(training));
        if (training == Training::off) {
          EXPECT_EQ(r.rows, cap + tpad) << what;
          EXPECT_EQ(r.dx_rows, -1) << what;
          continue;
        }
        const bool keeps = ep == 1 || precision == Precision::fp8;
        EXPECT_EQ(r.dx_rows, keeps ? cap : -1) << what;                 // (after the dy rows)
        EXPECT_EQ(r.shared_dx_rows, keeps ? 2 * cap : cap) << what;     // (after the last routed room)
        EXPECT_EQ(r.rows, r.shared_dx_rows + tpad) << what;
        EXPECT_EQ(r.rows, (keeps ? 2 : 1) * cap + tpad) << what;
      }
}

// Config::backward_column_blocks = 0 (mok::default_backward_column_blocks): Training::save two blocks,
// but one for a Precision::fp8 workspace where H <= 2048 (measured faster there: bench/NOTES.md,
// forty-fifth session); Training::recompute two where I > H, else one, whatever the precision; an
// inference workspace one; a count asked for is kept in every case.
TEST(ScratchLayout, DefaultColumnBlocksByTrainingPrecisionAndHidden) {
  for (std::int64_t H : {256, 1024, 2048, 2304, 2880, 4096, 7168})
    for (std::int64_t I : {768, 14336})
      for (Precision precision : {Precision::bf16, Precision::fp8}) {
        MoeShape shape;
        shape.hidden = H, shape.intermediate = I, shape.num_experts = shape.num_local_experts = 8, shape.top_k = 2;
        const bool fp8 = precision == Precision::fp8;
        const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + (fp8 ? " fp8" : " bf16");
        EXPECT_EQ(default_backward_column_blocks(shape, Training::save, precision), fp8 && H <= 2048 ? 1 : 2) << what;
        EXPECT_EQ(default_backward_column_blocks(shape, Training::recompute, precision), I > H ? 2 : 1) << what;
        EXPECT_EQ(default_backward_column_blocks(shape, Training::off, precision), 1) << what;
        Config config;
        config.precision = precision;
        const std::int64_t tiles = (H + 255) / 256, two = std::min(H, (tiles + 1) / 2 * 256);
        EXPECT_EQ(detail::backward_block_columns(shape, config, Training::save), fp8 && H <= 2048 ? H : two) << what;
        config.backward_column_blocks = 2;
        EXPECT_EQ(detail::backward_block_columns(shape, config, Training::save), two) << what << " (2 asked for)";
      }
  MoeShape shape;
  shape.hidden = 2048, shape.intermediate = 768;
  EXPECT_EQ(default_backward_column_blocks(shape, Training::save), 2) << "the precision's default is bf16";
}

// The backward's column blocks (Config::backward_column_blocks): whole 256-column tiles, the
// first blocks the widest; Training::save two by default (for the bf16 Config these use), Training::recompute two where I > H, else one,
// whole rows with the ring or communication SMs (an EP rank) and without training. A save
// layout's x rows take capacity x W, a recompute one's capacity x H whatever W (the recompute's
// GEMM1 reads whole rows there before the first block's columns are gathered over them), so a
// recompute's blocks leave its scratch and every other buffer where one block puts them.
TEST(ScratchLayout, ColumnBlocksAndTheRecomputesWholeRows) {
  auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  void* base = reinterpret_cast<void*>(std::uintptr_t{1} << 40);
  for (std::int64_t H : {320, 2048, 4096, 7168})
    for (std::int64_t I : {512, 14336})
    for (std::int64_t blocks : {0, 1, 2, 3, 8}) {
      MoeShape shape;
      shape.hidden = H, shape.intermediate = I, shape.num_experts = shape.num_local_experts = 8, shape.top_k = 2;
      Config config;
      config.backward_column_blocks = static_cast<int>(blocks);
      const std::int64_t tiles = (H + 255) / 256;
      const auto width = [&](std::int64_t n) { return std::min(H, (tiles + n - 1) / n * 256); };
      const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + " blocks " + std::to_string(blocks);
      EXPECT_EQ(detail::backward_block_columns(shape, config, Training::save), width(blocks > 0 ? blocks : 2)) << what;
      // (recompute's default: two blocks where the expert is wider than the model, else one)
      EXPECT_EQ(detail::backward_block_columns(shape, config, Training::recompute),
                width(blocks > 0 ? blocks : I > H ? 2 : 1))
          << what;
      EXPECT_EQ(detail::backward_block_columns(shape, config, Training::off), H) << what;
      Config ring = config, comm = config;
      ring.ring_rows = 256, comm.comm_sms = 4;
      for (Training mode : {Training::save, Training::recompute}) {
        EXPECT_EQ(detail::backward_block_columns(shape, ring, mode), H) << what << " ring";
        EXPECT_EQ(detail::backward_block_columns(shape, comm, mode), H) << what << " comm_sms";
      }
      for (Training mode : {Training::save, Training::recompute}) {
        detail::ScratchShape sh;
        sh.shape = shape, sh.tokens = 1000, sh.training = mode;
        sh.capacity = plan_capacity_rows(shape, {}, sh.tokens, detail::kTileRows);
        sh.saved_elements = 2 * sh.capacity * shape.intermediate + 8;
        sh.block_columns = detail::backward_block_columns(shape, config, mode);
        detail::ScratchShape whole = sh;
        whole.block_columns = H;
        const detail::CallBuffers b = detail::backward_buffers(sh, base, nullptr, nullptr);
        const detail::CallBuffers w = detail::backward_buffers(whole, base, nullptr, nullptr);
        const std::int64_t W = sh.block_columns, cap = sh.capacity;
        const std::string wm = what + (mode == Training::save ? " save" : " recompute");
        EXPECT_EQ(b.row_columns, W) << wm;
        EXPECT_EQ(w.bytes - b.bytes, mode == Training::save ? 2 * cap * (H - W) : 0) << wm;
        // (the buffers after the x rows: right after their room)
        EXPECT_EQ(at(b.shared_dx_rows) - at(b.x_rows), 2 * cap * (mode == Training::save ? W : H)) << wm;
        if (mode == Training::recompute)
          EXPECT_TRUE(b.hidden == w.hidden && b.shared_hidden == w.shared_hidden && b.recompute == w.recompute)
              << wm << ": a recompute's buffers after the x rows moved with its column blocks";
      }
    }
}

// The routed dy rows that miss the W_gate / W_up gradients continue in dx when it is given
// (below or above the gradients): each part inside its buffer, split at a 128-row tile, the
// lower address holding the first rows, never more scratch than without dx, and the layout
// unchanged where the rows fitted the gradients already.
TEST(ScratchLayout, DyRowsContinueInDx) {
  using U = std::uintptr_t;
  const U base = U{1} << 39, gate = U{2} << 39, up = U{3} << 39;
  auto at = [](const void* p) { return reinterpret_cast<U>(p); };
  auto inside = [](U begin, U end, U lo, U hi) { return begin >= lo && end <= hi && begin <= end; };
  int splits[2] = {0, 0}, in_dx_only = 0;
  int shared_in_dx = 0;
  for (std::int64_t H : {256, 2048, 7168})
    for (std::int64_t I : {128, 512, 2048})
      for (std::int64_t E : {8, 48, 128})
        for (std::int64_t k : {1, 2, 8})
          for (std::int64_t T : {300, 4096, 16384})
            for (std::int64_t Is : {0, 256})
            for (bool block : {false, true})
              for (bool dx_below : {false, true}) {
                detail::ScratchShape sh;
                sh.shape.hidden = H, sh.shape.intermediate = I, sh.shape.num_experts = sh.shape.num_local_experts = E;
                sh.shape.top_k = k, sh.shape.shared_intermediate = Is;
                sh.tokens = T, sh.training = Training::save;
                sh.capacity = plan_capacity_rows(sh.shape, {}, T, detail::kTileRows);
                const std::int64_t cap = sh.capacity, half = E * I * H, Tpad = detail::shared_tiles(sh.shape, T) * 128;
                const U up_at = block ? gate + 2 * half : up, grads_end = block ? gate + 4 * half : gate + 2 * half;
                const U dx = dx_below ? gate - (U{1} << 36) : up + (U{1} << 36), dx_end = dx + 2 * T * H;
                const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + " E " + std::to_string(E) +
                                         " k " + std::to_string(k) + " T " + std::to_string(T) + " Is " + std::to_string(Is) +
                                         (block ? " one block" : " apart") + (dx_below ? " dx below" : " dx above");
                void* b = reinterpret_cast<void*>(base);
                void *g = reinterpret_cast<void*>(gate), *u = reinterpret_cast<void*>(up_at);
                const detail::CallBuffers w0 = detail::backward_buffers(sh, b, g, u);
                const detail::CallBuffers w = detail::backward_buffers(sh, b, g, u, reinterpret_cast<void*>(dx));
                EXPECT_LE(w.bytes, w0.bytes) << what;
                const U other_dx = dx_below ? up + (U{1} << 36) : gate - (U{1} << 36);  // (Workspace's figure
                EXPECT_EQ(w.bytes, detail::backward_buffers(sh, b, g, u, reinterpret_cast<void*>(other_dx)).bytes)
                    << what << ": the scratch depends on where dx lies";  //  does not know where dx lies)
                const U scratch_end = base + w.bytes;
                const bool dy_in_scratch = inside(at(w.dy_rows), at(w.dy_rows), base, scratch_end);
                const bool hw_in_scratch = inside(at(w.hidden), at(w.hidden), base, scratch_end);
                EXPECT_EQ(w.rows_in_grads, !dy_in_scratch || !hw_in_scratch) << what;
                // The shared expert's dx rows in dx unless dy rows are there.
                const bool dy_in_dx = at(w.dy_rows) == dx || at(w.dy_rows_hi) == dx;
                const bool shared_dx_in_dx = at(w.shared_dx_rows) == dx;
                EXPECT_EQ(shared_dx_in_dx, Is > 0 && !dy_in_dx) << what;
                shared_in_dx += shared_dx_in_dx;
                EXPECT_EQ(w.bytes, 2 * cap * H + (dy_in_scratch ? 2 * cap * H : 0) + (hw_in_scratch ? 2 * cap * I : 0) +
                                       (shared_dx_in_dx ? 0 : 2 * Tpad * H) + 2 * Tpad * Is)
                    << what;
                const bool w0_all_in = w0.rows_in_grads && at(w0.dy_rows) >= gate && at(w0.hidden) >= gate;
                if (w0_all_in) {  // (the rows fitted the gradients: nothing moves)
                  EXPECT_EQ(w.dy_rows, w0.dy_rows) << what;
                  EXPECT_EQ(w.hidden, w0.hidden) << what;
                  EXPECT_EQ(w.dy_rows_hi, nullptr) << what;
                }
                // The dy rows' parts: [0, split) at dy_rows, the rest at dy_rows_hi (or all at dy_rows).
                const std::int64_t first = w.dy_rows_hi ? w.dy_split : cap;
                struct Part {
                  U begin, end;
                };
                std::vector<Part> parts{{at(w.dy_rows), at(w.dy_rows) + 2 * first * H}};
                if (w.dy_rows_hi) {
                  EXPECT_EQ(w.dy_split % detail::kTileRows, 0) << what;
                  EXPECT_TRUE(w.dy_split > 0 && w.dy_split < cap) << what;
                  EXPECT_LT(at(w.dy_rows), at(w.dy_rows_hi)) << what;
                  parts.push_back({at(w.dy_rows_hi), at(w.dy_rows_hi) + 2 * (cap - first) * H});
                  ++splits[dx_below];
                } else if (at(w.dy_rows) == dx) {
                  ++in_dx_only;
                }
                if (!hw_in_scratch) parts.push_back({at(w.hidden), at(w.hidden) + 2 * cap * I});
                for (std::size_t i = 0; i < parts.size(); ++i) {
                  const Part& r = parts[i];
                  const bool in_dx = inside(r.begin, r.end, dx, dx_end);
                  const bool in_grads = block ? inside(r.begin, r.end, gate, grads_end)
                                              : inside(r.begin, r.end, gate, gate + 2 * half) ||
                                                    inside(r.begin, r.end, up_at, up_at + 2 * half);
                  const bool in_scratch = inside(r.begin, r.end, base, scratch_end);
                  EXPECT_TRUE(in_dx || in_grads || in_scratch) << what << ": part " << i << " outside every buffer";
                  if (!block && i + 1 == parts.size() && !hw_in_scratch)  // (apart: w h only in d_w_up's)
                    EXPECT_TRUE(inside(r.begin, r.end, up_at, up_at + 2 * half)) << what;
                  for (std::size_t j = 0; j < i; ++j)
                    EXPECT_TRUE(r.end <= parts[j].begin || parts[j].end <= r.begin) << what << ": parts overlap";
                }
              }
  EXPECT_GT(shared_in_dx, 0) << "no shape put the shared expert's dx rows in dx";
  EXPECT_GT(splits[0], 0) << "no shape split its dy rows with dx above the gradients";
  EXPECT_GT(splits[1], 0) << "no shape split its dy rows with dx below the gradients";
  std::printf("dy rows split into dx: %d shapes (dx above), %d (dx below); all in dx: %d; shared dx rows in dx: %d\n",
              splits[0], splits[1], in_dx_only, shared_in_dx);
}

// The FP8 dgrad's rows (E4M3 dy and dgate|dup and their scales' E8M0 bytes) are in a backward's scratch only when the
// call asks for them (BackwardArgs::fp8) on a Precision::fp8 workspace, after the rest, 512-byte aligned.
TEST(ScratchLayout, Fp8DgradRowsOnlyWhenAsked) {
  detail::ScratchShape sh;
  sh.shape.hidden = 384, sh.shape.intermediate = 256, sh.shape.num_experts = sh.shape.num_local_experts = 8;
  sh.shape.top_k = 2, sh.shape.shared_intermediate = 128;
  sh.tokens = 300;
  sh.capacity = plan_capacity_rows(sh.shape, {}, sh.tokens, detail::kTileRows) / 128 * 128;  // (whole tiles, as a plan's)
  sh.training = Training::save;
  const std::int64_t cap = sh.capacity, H = 384, I = 256;
  void* base = reinterpret_cast<void*>(std::uintptr_t{1} << 20);
  const detail::CallBuffers bf16 = detail::backward_buffers(sh, base, nullptr, nullptr, nullptr, /*fp8_dgrad=*/true);
  EXPECT_EQ(bf16.dy_fp8, nullptr);  // (a bf16 workspace: no FP8 rows, whatever is asked)
  sh.precision = Precision::fp8;
  const detail::CallBuffers plain = detail::backward_buffers(sh, base, nullptr, nullptr);
  EXPECT_TRUE(plain.bytes == bf16.bytes && plain.dy_fp8 == nullptr);
  const detail::CallBuffers fp8 = detail::backward_buffers(sh, base, nullptr, nullptr, nullptr, true);
  auto off = [&](const void* p) { return reinterpret_cast<std::uintptr_t>(p) - reinterpret_cast<std::uintptr_t>(base); };
  auto padded = [](std::int64_t bytes) { return static_cast<std::uintptr_t>((bytes + 511) / 512 * 512); };
  EXPECT_EQ(off(fp8.dy_fp8), static_cast<std::uintptr_t>(plain.bytes));
  EXPECT_EQ(off(fp8.dy_exps), off(fp8.dy_fp8) + cap * H);
  EXPECT_EQ(off(fp8.dgu_fp8), off(fp8.dy_exps) + padded((H / 128) * cap));
  EXPECT_EQ(off(fp8.dgu_exps), off(fp8.dgu_fp8) + cap * 2 * I);
  EXPECT_EQ(fp8.bytes, static_cast<std::int64_t>(off(fp8.dgu_exps) + padded((2 * I / 128) * cap)));
  for (const void* p : {static_cast<const void*>(fp8.dy_fp8), static_cast<const void*>(fp8.dy_exps),
                        static_cast<const void*>(fp8.dgu_fp8), static_cast<const void*>(fp8.dgu_exps)})
    EXPECT_EQ(off(p) % 512, 0u);
}

// A Precision::fp8, Training::save backward's scratch shape (capacity in whole tiles, as a plan's).
detail::ScratchShape fp8_training_shape(std::int64_t H, std::int64_t I, std::int64_t E, std::int64_t k, std::int64_t T,
                                        std::int64_t Is) {
  detail::ScratchShape sh;
  sh.shape.hidden = H, sh.shape.intermediate = I, sh.shape.num_experts = sh.shape.num_local_experts = E;
  sh.shape.top_k = k, sh.shape.shared_intermediate = Is;
  sh.tokens = T, sh.training = Training::save, sh.precision = Precision::fp8;
  sh.capacity = plan_capacity_rows(sh.shape, {}, T, detail::kTileRows) / 128 * 128;
  return sh;
}

// The FP8 dgrad's E4M3 dy rows and their scale bytes go into the room the bf16 rows leave in the W_gate /
// W_up gradients when they fit there (512-byte aligned, overlapping none of the rows; rows_in_grads
// then, so that the dW_gate|up tiles wait for every dh tile), else into the scratch as before; the
// bf16 rows lie where they lie without the FP8 dgrad.
TEST(ScratchLayout, Fp8DgradDyRowsInTheGradientsRoom) {
  using U = std::uintptr_t;
  const U base = U{1} << 39, gate = U{2} << 39, up = U{3} << 39;
  auto at = [](const void* p) { return reinterpret_cast<U>(p); };
  auto inside = [](U begin, U end, U lo, U hi) { return begin >= lo && end <= hi && begin <= end; };
  int in_grads = 0, in_scratch = 0;
  for (std::int64_t H : {256, 2048, 7168})
    for (std::int64_t I : {128, 512, 2048, 14336})
      for (std::int64_t E : {8, 48})
        for (std::int64_t k : {2, 8})
          for (std::int64_t T : {300, 4096, 8192})
            for (bool block : {false, true})
              for (bool with_dx : {false, true}) {
                const detail::ScratchShape sh = fp8_training_shape(H, I, E, k, T, 0);
                const std::int64_t cap = sh.capacity, half = E * I * H;
                const U up_at = block ? gate + 2 * half : up, dx = up + (U{1} << 36);
                const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + " E " + std::to_string(E) +
                                         " k " + std::to_string(k) + " T " + std::to_string(T) +
                                         (block ? " one block" : " apart") + (with_dx ? " dx" : "");
                void *b = reinterpret_cast<void*>(base), *g = reinterpret_cast<void*>(gate), *u = reinterpret_cast<void*>(up_at);
                void* dxp = with_dx ? reinterpret_cast<void*>(dx) : nullptr;
                const detail::CallBuffers plain = detail::backward_buffers(sh, b, g, u, dxp, false);
                const detail::CallBuffers w = detail::backward_buffers(sh, b, g, u, dxp, true);
                EXPECT_TRUE(w.dy_rows == plain.dy_rows && w.dy_rows_hi == plain.dy_rows_hi && w.dy_split == plain.dy_split &&
                            w.hidden == plain.hidden && w.x_rows == plain.x_rows && w.shared_dx_rows == plain.shared_dx_rows)
                    << what << ": the bf16 rows moved";
                auto padded = [](std::int64_t bytes) { return (bytes + 511) / 512 * 512; };
                const std::int64_t dy8 = cap * H + padded((H / 128) * cap);
                const std::int64_t dgu8 = cap * 2 * I + padded((2 * I / 128) * cap);
                ASSERT_NE(w.dy_fp8, nullptr) << what;
                EXPECT_EQ(at(w.dy_exps), at(w.dy_fp8) + cap * H) << what;
                EXPECT_EQ(at(w.dgu_exps), at(w.dgu_fp8) + cap * 2 * I) << what;
                const U lo = at(w.dy_fp8), hi = lo + dy8;
                const bool scratch = inside(lo, hi, base, base + w.bytes);
                EXPECT_EQ(w.bytes, plain.bytes + (scratch ? dy8 : 0) + dgu8) << what;
                EXPECT_TRUE(inside(at(w.dgu_fp8), at(w.dgu_fp8) + dgu8, base, base + w.bytes)) << what;
                if (scratch) {
                  ++in_scratch;
                  EXPECT_EQ(w.rows_in_grads, plain.rows_in_grads) << what;
                  EXPECT_TRUE(hi <= at(w.dgu_fp8)) << what;
                  continue;
                }
                ++in_grads;
                EXPECT_TRUE(w.rows_in_grads) << what;
                const U region = block || lo < up_at ? gate : up_at;
                EXPECT_TRUE(inside(lo, hi, region, region + (block ? 4 : 2) * half)) << what << ": outside the gradients";
                EXPECT_EQ((lo - region) % 512, 0u) << what;
                const std::int64_t first = plain.dy_rows_hi ? plain.dy_split : cap;
                const U rows[][2] = {{at(plain.dy_rows), at(plain.dy_rows) + 2 * first * H},
                                     {at(plain.dy_rows_hi), at(plain.dy_rows_hi) + 2 * (cap - first) * H},
                                     {at(plain.hidden), at(plain.hidden) + 2 * cap * I}};
                for (const auto& r : rows) EXPECT_TRUE(hi <= r[0] || r[1] <= lo) << what << ": overlaps the bf16 rows";
              }
  EXPECT_GT(in_grads, 0) << "no shape put the E4M3 dy rows in the gradients";
  EXPECT_GT(in_scratch, 0) << "no shape left the E4M3 dy rows in the scratch";
  std::printf("E4M3 dy rows in the gradients: %d shapes, in the scratch: %d\n", in_grads, in_scratch);
}

// The FP8 weight gradients' operands (fp8_wgrad): every other buffer where the FP8 dgrad alone puts
// it; dgate|dup^T and its scale bytes in the E4M3 dgate|dup rows' room; dy^T, x^T and w h^T, made after
// the dgrad launches and after dgate|dup^T, in rooms dead by then (the bf16 dy rows' and the E4M3
// dy rows' in the scratch, the x / dx rows', the routed pre-activations' in the saved tensor) or in
// new scratch; and nothing written while a buffer is still read: w h^T and its exponents overlap
// neither w h nor dgate|dup^T, the weight-gradient launch's operands none of each other nor the
// gradients it writes, and none lies outside the scratch and the saved tensor's routed rows. The
// figure of a size query (no scratch, no saved tensor) is the call's, and with mok.moe's layout
// (bf16 gradients in one block, dx apart, two column blocks) and H <= 4I (every FP8 preset) the
// operands need at most capacity x I bytes of new scratch besides their scales and exponents, where they needed
// capacity x (2H + I) before.
TEST(ScratchLayout, Fp8WgradOperandsTakeOnlyDeadRooms) {
  using U = std::uintptr_t;
  const U base = U{1} << 39, gate = U{2} << 39, up = U{3} << 39, saved_at = (U{4} << 39) + 16;  // (16-byte aligned: check_saved)
  auto at = [](const void* p) { return reinterpret_cast<U>(p); };
  int in_dy_rows = 0, in_x_rows = 0, in_saved = 0, in_dy_fp8 = 0, shapes = 0;
  for (std::int64_t H : {256, 2048, 7168})
    for (std::int64_t I : {128, 512, 2048, 14336})
      for (std::int64_t E : {8, 48})
        for (std::int64_t k : {2, 8})
          for (std::int64_t T : {300, 8192})
            for (bool bf16_grads : {false, true})
              for (bool with_dx : {false, true}) {
                detail::ScratchShape sh = fp8_training_shape(H, I, E, k, T, 256);
                sh.block_columns = (H / 256 + 1) / 2 * 256;  // (two column blocks, as the default)
                const std::int64_t cap = sh.capacity, half = E * I * H, Tpad = (T + 127) / 128 * 128;
                const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + " E " + std::to_string(E) +
                                         " k " + std::to_string(k) + " T " + std::to_string(T) +
                                         (bf16_grads ? " bf16 grads (one block)" : " f32 grads") + (with_dx ? " dx" : "");
                void* b = reinterpret_cast<void*>(base);
                void* g = bf16_grads ? reinterpret_cast<void*>(gate) : nullptr;
                void* u = bf16_grads ? reinterpret_cast<void*>(gate + 2 * half) : nullptr;
                void* dxp = with_dx ? reinterpret_cast<void*>(up) : nullptr;
                void* sv = reinterpret_cast<void*>(saved_at);
                const detail::CallBuffers d = detail::backward_buffers(sh, b, g, u, dxp, true, false, sv);
                const detail::CallBuffers w = detail::backward_buffers(sh, b, g, u, dxp, true, true, sv);
                ++shapes;
                EXPECT_EQ(w.bytes, detail::backward_buffers(sh, nullptr, g, u, dxp, true, true).bytes) << what;
                EXPECT_TRUE(w.dy_rows == d.dy_rows && w.dy_rows_hi == d.dy_rows_hi && w.hidden == d.hidden &&
                            w.x_rows == d.x_rows && w.shared_dx_rows == d.shared_dx_rows &&
                            w.shared_hidden == d.shared_hidden && w.dy_fp8 == d.dy_fp8 && w.dy_exps == d.dy_exps &&
                            w.dgu_fp8 == d.dgu_fp8 && w.dgu_exps == d.dgu_exps)
                    << what << ": a buffer of the FP8 dgrad moved";
                EXPECT_EQ(d.dy_t, nullptr) << what;
                EXPECT_TRUE(w.dgu_t == w.dgu_fp8 && w.dgu_t_exps == w.dgu_exps) << what;
                const U scratch_end = base + w.bytes, saved_lo = saved_at, saved_hi = saved_at + 4 * cap * I;
                const std::int64_t rb = cap / 128, xrow = rb + 1;
                struct R {
                  const char* name;
                  U lo, hi;
                };
                auto r = [&](const char* name, const void* p, std::int64_t bytes) { return R{name, at(p), at(p) + bytes}; };
                const R dy_t = r("dy^T", w.dy_t, cap * H);
                const bool dy_rows_in_scratch = at(d.dy_rows) >= base && at(d.dy_rows) < scratch_end && !d.dy_rows_hi;
                in_dy_rows += dy_rows_in_scratch && dy_t.lo >= at(w.dy_rows) && dy_t.hi <= at(w.dy_rows) + 2 * cap * H;
                in_x_rows += dy_t.lo >= at(w.x_rows) && dy_t.hi <= at(w.x_rows) + 2 * cap * w.row_columns;
                in_saved += at(w.x_t) >= saved_lo && at(w.x_t) < saved_hi;
                in_dy_fp8 += at(w.hw_t) >= at(w.dy_fp8) && at(w.hw_t) < at(w.dy_fp8) + cap * H;
                const std::vector<R> operands{dy_t, r("x^T", w.x_t, cap * H), r("dy^T scale bytes", w.dy_t_exps, rb * H),
                                              r("x^T exponents", w.x_t_exponents, 4 * (H / 128) * xrow),
                                              r("tile order", w.tile_order, 4 * rb), r("w h^T", w.hw_t, cap * I),
                                              r("w h^T exponents", w.hw_t_exponents, 4 * (I / 128) * xrow),
                                              r("dgu^T", w.dgu_t, cap * 2 * I), r("dgu^T scale bytes", w.dgu_t_exps, rb * 2 * I)};
                auto apart = [&](const std::vector<R>& a, const std::vector<R>& c, const char* when) {
                  for (const R& x : a)
                    for (const R& y : c)
                      if (&x != &y) EXPECT_TRUE(x.hi <= y.lo || y.hi <= x.lo) << what << ": " << x.name << " overlaps " << y.name << " " << when;
                };
                apart(operands, operands, "(the weight-gradient launch reads them all)");
                apart({operands[5], operands[6]}, {r("w h", w.hidden, 2 * cap * I)}, "(w h^T is made from w h)");
                apart({operands[7], operands[8]}, {R{"the pre-activations", saved_lo, saved_hi}},
                      "(dgate|dup^T is made from them)");
                if (bf16_grads) {
                  const std::vector<R> grads{R{"the gradients", gate, gate + 4 * half}};
                  apart(operands, grads, "(the weight-gradient launch writes the gradients)");
                }
                for (const auto& x : operands) {
                  EXPECT_TRUE((x.lo >= base && x.hi <= scratch_end) || (x.lo >= saved_lo && x.hi <= saved_hi))
                      << what << ": " << x.name << " outside the scratch and the saved rows";
                  EXPECT_EQ(x.lo % 16, 0u) << what << ": " << x.name << " unaligned";  // (TMA)
                }
                if (bf16_grads && with_dx && 2 * w.row_columns >= H && H <= 4 * I) {  // mok.moe's layout; x^T fits the saved rows
                  const std::int64_t small = rb * H + 4 * (H / 128) * xrow + 4 * rb + 4 * (I / 128) * xrow + 4 * 512;
                  EXPECT_LE(w.bytes - d.bytes, cap * I + small) << what;
                }
              }
  EXPECT_GT(in_dy_rows, 0) << "no shape put dy^T in the bf16 dy rows' room";
  EXPECT_GT(in_x_rows, 0) << "no shape put dy^T in the x / dx rows' room";
  EXPECT_GT(in_saved, 0) << "no shape put x^T in the saved pre-activations' room";
  std::printf("%d shapes: dy^T in the bf16 dy rows' room %d, in the x / dx rows' %d; x^T in the saved rows %d; "
              "w h^T in the E4M3 dy rows' %d\n", shapes, in_dy_rows, in_x_rows, in_saved, in_dy_fp8);
}

// An EP rank's FP8 rows (Config::fp8_dgrad): the FP8 dgrad's E4M3 dy and dgate|dup rows and their
// scale bytes inside the rank's buffer and apart; then, for its FP8 weight gradients, the four
// transposed operands, their scale bytes and exponents apart from each other, inside the rank buffer or
// the dx rows' room, and apart from the rows they are made from (the bf16 x and dy rows, w h) —
// for any plan capacity up to the allocated rows; the FP8 forward's E4M3 x rows and h with their
// scale bytes inside the bf16 rows' buffers. TMA-read operands 16-byte aligned.
TEST(ScratchLayout, RankFp8RowsAndOperandsNeverOverlap) {
  struct Region {
    const char* name;
    std::uintptr_t begin, end;
  };
  auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  auto apart = [](const std::vector<Region>& rs, const std::string& what) {
    for (std::size_t i = 0; i < rs.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        EXPECT_TRUE(rs[i].end <= rs[j].begin || rs[j].end <= rs[i].begin)
            << what << ": " << rs[i].name << " overlaps " << rs[j].name;
  };
  // (the sources where the workspace puts them: the bf16 dy rows right before the dx rows in its slot
  // buffer — Workspace::dy_routed(), dx_rows() — and the x rows and w h in buffers of their own)
  const std::uintptr_t base = std::uintptr_t{1} << 40, slots = std::uintptr_t{2} << 40;
  const std::uintptr_t x_rows = std::uintptr_t{4} << 40, hidden = std::uintptr_t{5} << 40;
  for (std::int64_t rows : {128, 1024, 4224})
    for (std::int64_t H : {128, 512, 7168})
      for (std::int64_t I : {128, 384, 2048, 14336})
        for (std::int64_t cap : {std::int64_t{128}, rows}) {
          if (cap > rows) continue;
          const std::string what = "rows " + std::to_string(rows) + " H " + std::to_string(H) + " I " +
                                   std::to_string(I) + " capacity " + std::to_string(cap);
          const std::uintptr_t dy_rows = slots, dx = slots + 2 * rows * H;
          const std::int64_t bytes = detail::rank_fp8_dgrad_bytes(rows, H, I), rb = cap / 128;
          const std::int64_t stride = kernels::wgrad_exponent_stride(cap);
          auto inside = [&](const Region& r) {
            return (r.begin >= base && r.end <= base + bytes) || (r.begin >= dx && r.end <= dx + 2 * rows * H);
          };
          detail::CallBuffers d;
          detail::rank_fp8_dgrad_buffers(d, rows, H, I, reinterpret_cast<void*>(base));
          const std::vector<Region> dgrad{{"dy E4M3", at(d.dy_fp8), at(d.dy_fp8) + cap * H},
                                          {"dgate|dup E4M3", at(d.dgu_fp8), at(d.dgu_fp8) + cap * 2 * I},
                                          {"dy scale bytes", at(d.dy_exps), at(d.dy_exps) + (H / 128) * cap},
                                          {"dgate|dup scale bytes", at(d.dgu_exps), at(d.dgu_exps) + (2 * I / 128) * cap}};
          apart(dgrad, what + " dgrad");
          EXPECT_EQ(at(d.dy_exps) % 16 + at(d.dgu_exps) % 16, 0u) << what << " (bulk copies)";
          for (const Region& r : dgrad) EXPECT_TRUE(inside(r)) << what << ": " << r.name << " outside the rank buffer";
          EXPECT_EQ(at(d.dy_fp8) % 16 + at(d.dgu_fp8) % 16, 0u) << what;

          detail::CallBuffers w;
          detail::rank_fp8_wgrad_buffers(w, rows, H, I, reinterpret_cast<void*>(base), reinterpret_cast<void*>(dx));
          const std::vector<Region> operands{
              {"dgate|dup^T", at(w.dgu_t), at(w.dgu_t) + 2 * I * cap},
              {"w h^T", at(w.hw_t), at(w.hw_t) + I * cap},
              {"w h^T exponents", at(w.hw_t_exponents), at(w.hw_t_exponents) + 4 * (I / 128) * stride},
              {"dy^T", at(w.dy_t), at(w.dy_t) + H * cap},
              {"dy^T scale bytes", at(w.dy_t_exps), at(w.dy_t_exps) + rb * H},
              {"dgate|dup^T scale bytes", at(w.dgu_t_exps), at(w.dgu_t_exps) + rb * 2 * I},
              {"x^T", at(w.x_t), at(w.x_t) + H * cap},
              {"x^T exponents", at(w.x_t_exponents), at(w.x_t_exponents) + 4 * (H / 128) * stride}};
          apart(operands, what + " wgrad");
          for (const Region& r : operands) {
            EXPECT_TRUE(inside(r)) << what << ": " << r.name << " outside the rank buffer and the dx rows' room";
            for (const Region& source : {Region{"bf16 dy rows", dy_rows, dy_rows + 2 * rows * H},
                                         Region{"bf16 x rows", x_rows, x_rows + 2 * rows * H},
                                         Region{"w h", hidden, hidden + 2 * rows * I}})
              EXPECT_TRUE(r.end <= source.begin || source.end <= r.begin) << what << ": " << r.name << " over " << source.name;
          }
          for (const std::uint8_t* t : {w.dgu_t, w.hw_t, w.dy_t, w.x_t, w.dy_t_exps, w.dgu_t_exps}) EXPECT_EQ(at(t) % 16, 0u) << what;

          detail::CallBuffers f;
          f.x_rows = reinterpret_cast<std::uint16_t*>(x_rows), f.hidden = reinterpret_cast<std::uint16_t*>(hidden);
          detail::rank_fp8_forward_buffers(f, rows, H, I);
          const std::vector<Region> forward{{"x E4M3", at(f.x_fp8), at(f.x_fp8) + cap * H},
                                            {"h E4M3", at(f.h_fp8), at(f.h_fp8) + cap * I},
                                            {"x scale bytes", at(f.x_exps), at(f.x_exps) + (H / 128) * cap},
                                            {"h scale bytes", at(f.h_exps), at(f.h_exps) + (I / 128) * cap}};
          apart(forward, what + " forward");
          EXPECT_LE(forward[2].end, x_rows + 2 * rows * H) << what;
          EXPECT_LE(forward[3].end, hidden + 2 * rows * I) << what;
          for (const std::uint8_t* e : {f.x_exps, f.h_exps}) EXPECT_EQ(at(e) % 16, 0u) << what;  // (bulk copies)
        }
}

// A save-mode layout with the FP8 weight gradients needs the saved tensor's address (but a size
// query does not).
TEST(ScratchLayout, Fp8WgradLayoutNeedsTheSavedTensor) {
  const detail::ScratchShape sh = fp8_training_shape(256, 256, 8, 2, 300, 0);
  void* b = reinterpret_cast<void*>(std::uintptr_t{1} << 39);
  EXPECT_THROW(detail::backward_buffers(sh, b, nullptr, nullptr, nullptr, true, true), Error);
  EXPECT_GT(detail::backward_buffers(sh, nullptr, nullptr, nullptr, nullptr, true, true).bytes, 0);
}

// The FP8 weight gradients' gathers visit the plan's tiles rank by rank (kernels/fp8/tile_order.cuh):
// the positions of every expert's tiles are a permutation of [0, total), each rank's tiles before
// the next rank's, an expert's tiles in rank order and, within a rank, the experts in order.
TEST(TileOrder, RankOrderIsAPermutationRankByRank) {
  std::mt19937 gen(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int experts = 1 + static_cast<int>(gen() % 40);
    std::vector<int> tiles(experts);
    for (int& n : tiles) n = trial % 3 == 0 ? static_cast<int>(gen() % 3) : static_cast<int>(gen() % 20);  // (empty experts too)
    int total = 0;
    for (int n : tiles) total += n;
    const auto count = [&](int e) { return tiles[e]; };
    std::vector<int> seen(total, 0);
    int last_rank_position = -1;
    for (int r = 0; r < 20; ++r)
      for (int e = 0; e < experts; ++e) {
        if (r >= tiles[e]) continue;
        const int p = kernels::rank_order_position(experts, e, r, count);
        ASSERT_TRUE(p >= 0 && p < total) << "trial " << trial;
        ++seen[p];
        EXPECT_GT(p, last_rank_position) << "trial " << trial << ": rank " << r << ", expert " << e;
        last_rank_position = p;  // (visited rank by rank, experts in order: positions must rise)
      }
    for (int p = 0; p < total; ++p) ASSERT_EQ(seen[p], 1) << "trial " << trial << ", position " << p;
  }
}

}  // namespace
}  // namespace mok
