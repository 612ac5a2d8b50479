// The device planner must build exactly the host planner's plan, without host sync.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>

#include "gpu_support.hpp"
#include "kernels/ep/dispatch.cuh"
#include "kernels/fp8/quantize.cuh"
#include "mok/device_plan.hpp"
#include "mok/error.hpp"
#include "mok/fp8.hpp"
#include "mok/routing.hpp"
#include "mok/validate.hpp"
#include "plan_checks.hpp"

namespace mok {
namespace {

using testing::DeviceBuffer;

MoeShape shape(std::int64_t E, std::int64_t El, std::int64_t k) {
  MoeShape s;
  s.hidden = 64, s.intermediate = 64, s.num_experts = E, s.num_local_experts = El, s.top_k = k;
  return s;
}

std::vector<std::int32_t> all_ranks_routing(RoutingKind kind, std::int64_t T, std::int64_t E,
                                            std::int64_t k, std::int64_t ep, std::uint64_t seed) {
  std::vector<std::int32_t> all;
  for (std::int64_t r = 0; r < ep; ++r) {
    auto ids = make_routing(kind, T, E, k, seed + r);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  return all;
}

struct Case {
  const char* name;
  RoutingKind routing;
  std::int64_t tokens, E, El, k, block_m;
  bool int64_ids;
};

class DevicePlanCases : public ::testing::TestWithParam<Case> {};

TEST_P(DevicePlanCases, EqualsHostPlanBitwise) {
  MOK_REQUIRE_HOPPER();
  const Case c = GetParam();
  const MoeShape s = shape(c.E, c.El, c.k);
  const std::int64_t ep = s.ep_size();
  for (std::uint64_t seed : {1u, 2u, 3u}) {  // fresh routings
    const auto all = all_ranks_routing(c.routing, c.tokens, c.E, c.k, ep, 77 * seed);
    std::vector<std::int64_t> all64(all.begin(), all.end());
    DeviceBuffer<std::int32_t> ids32(all);
    DeviceBuffer<std::int64_t> ids64(all64);
    const TensorView view = c.int64_ids
        ? TensorView::contiguous(ids64.get(), DType::i64, Device::cuda(0), {ep, c.tokens, c.k})
        : TensorView::contiguous(ids32.get(), DType::i32, Device::cuda(0), {ep, c.tokens, c.k});
    for (std::int64_t rank = 0; rank < ep; ++rank) {
      DevicePlan plan(s, c.tokens, {.block_m = c.block_m});
      const Plan expected = plan_host(s, c.tokens, all, rank, {.block_m = c.block_m});
      for (int repeat = 0; repeat < 3; ++repeat) {
        plan_device(view, rank, plan, nullptr);
        const Plan got = plan.to_host(nullptr, rank);
        testing::expect_plans_equal(got, expected);
        testing::expect_plan_invariants(s, got, all);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    DevicePlan, DevicePlanCases,
    ::testing::Values(Case{"uniform", RoutingKind::uniform, 4097, 16, 16, 4, 128, false},
                      Case{"uniform_i64", RoutingKind::uniform, 1500, 64, 64, 8, 128, true},
                      Case{"skewed", RoutingKind::skewed, 2049, 8, 8, 2, 64, false},
                      Case{"one_expert_k1", RoutingKind::one_expert, 1000, 8, 8, 1, 128, false},
                      Case{"empty_experts", RoutingKind::first_half, 700, 32, 32, 4, 64, false},
                      Case{"padded", RoutingKind::padded, 333, 8, 8, 3, 128, true},
                      Case{"single_token", RoutingKind::uniform, 1, 8, 8, 2, 128, false},
                      Case{"single_local_expert", RoutingKind::uniform, 300, 4, 1, 2, 64, false},
                      Case{"ep4", RoutingKind::uniform, 900, 16, 4, 4, 64, false},
                      Case{"ep8_skewed", RoutingKind::skewed, 513, 64, 8, 8, 128, false},
                      Case{"many_experts", RoutingKind::uniform, 16384, 128, 128, 8, 128, false},
                      // scan_kernel's ranges: E_l not dividing its 1024 threads, and more
                      // local experts than threads (one range, experts looped over)
                      Case{"ep8_48_local", RoutingKind::skewed, 3000, 384, 48, 8, 128, false},
                      Case{"more_local_than_threads", RoutingKind::uniform, 2500, 1536, 1536, 6, 64, false}),
    [](const auto& info) { return std::string(info.param.name); });

// The one-GPU scatter (a warp per token, its row read once) and the gather (a warp per plan row)
// write the same bytes: every plan row its token's row, padding rows zeros, rows past the plan's
// last untouched (poisoned before), across a split into two buffers; and the FP8 row quantization
// likewise (E4M3 values, the scales' E8M0 bytes — each plan row's its token's host fp8::quantize
// exponents + 127 — and the bf16 copy; hidden sizes of 1, 2 and 9 blocks leave the scatter's group
// of four blocks part empty; blocks with a NaN, an infinity, only subnormal values, only zeros or
// only NaN). Routings with unrouted slots (-1) and k > 32
// (the scatter's rows of a token come 32 at a time), and rows of H / 8 = 16 and 144 16-byte
// vectors (the scatter's last chunk of a row spans part of the warp: d7dd9bb's loop hung there).
struct RowCopyCase {
  const char* name;
  RoutingKind routing;
  std::int64_t tokens, E, k, hidden;
};
class RowCopyCases : public ::testing::TestWithParam<RowCopyCase> {};

TEST_P(RowCopyCases, ScatterWritesTheGathersBytes) {
  MOK_REQUIRE_HOPPER();
  const RowCopyCase c = GetParam();
  MoeShape s = shape(c.E, c.E, c.k);
  s.hidden = c.hidden;
  const std::int64_t T = c.tokens, H = c.hidden, k = c.k;
  const auto ids = make_routing(c.routing, T, c.E, k, 17);
  DeviceBuffer<std::int32_t> d_ids(ids);
  DevicePlan plan(s, T);
  plan_device(TensorView::contiguous(d_ids.get(), DType::i32, Device::cuda(0), {T, k}), 0, plan, nullptr);
  const Plan host = plan.to_host(nullptr, 0);
  const std::int64_t cap = plan.capacity_rows(), rows = host.expert_offset.back(), split = 128;
  ASSERT_GT(rows, split);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(T * H));
  for (auto& v : x) {
    const float f = normal(gen);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<std::uint16_t>(bits >> 16);
  }
  // Blocks the quantization treats specially (the scatter kernels' bytes against the gather's):
  // a NaN, an infinity, only subnormal values, only zeros, only NaN.
  for (std::int64_t t = 0; t < T; t += 7) {
    std::uint16_t* row = &x[static_cast<std::size_t>(t * H)];
    const std::int64_t b = (t / 7) % (H / 128);
    switch ((t / 7) % 5) {
      case 0: row[b * 128 + 5] = 0x7fc0; break;                                        // NaN
      case 1: row[b * 128 + 17] = (t & 8) ? 0xff80 : 0x7f80; break;                    // -+infinity
      case 2: for (int c = 0; c < 128; ++c) row[b * 128 + c] = 0x0001 + c; break;      // subnormal
      case 3: for (int c = 0; c < 128; ++c) row[b * 128 + c] = 0; break;               // zeros
      default: for (int c = 0; c < 128; ++c) row[b * 128 + c] = 0x7fc0; break;        // all NaN
    }
  }
  DeviceBuffer<std::uint16_t> d_x(x);
  const DevicePlanView& v = plan.view();

  struct Out {
    std::vector<std::uint16_t> lo, hi, fp8_copy;
    std::vector<std::uint8_t> fp8;
    std::vector<std::uint8_t> exps;
  };
  auto copy = [&](bool scatter) -> Out {
    DeviceBuffer<std::uint16_t> lo(static_cast<std::size_t>(split * H)), hi(static_cast<std::size_t>((cap - split) * H));
    DeviceBuffer<std::uint16_t> fp8_copy(static_cast<std::size_t>(cap * H));
    DeviceBuffer<std::uint8_t> fp8(static_cast<std::size_t>(cap * H));
    DeviceBuffer<std::uint8_t> exps(static_cast<std::size_t>(H / 128 * cap));
    for (void* p : {static_cast<void*>(lo.get()), static_cast<void*>(hi.get()), static_cast<void*>(fp8_copy.get())})
      EXPECT_EQ(cudaSuccess, cudaMemset(p, 0xab, (p == lo.get() ? split : p == hi.get() ? cap - split : cap) * H * 2));
    EXPECT_EQ(cudaSuccess, cudaMemset(fp8.get(), 0xab, cap * H));
    EXPECT_EQ(cudaSuccess, cudaMemset(exps.get(), 0xab, H / 128 * cap));
    kernels::DispatchParams dp{};
    dp.x[0] = d_x.get();
    dp.x_routed = lo.get(), dp.x_routed_hi = hi.get(), dp.split = split;
    dp.row_pair = v.row_pair, dp.pair_row = scatter ? v.pair_row : nullptr;
    dp.expert_offset = v.expert_offset, dp.plan_status = v.status, dp.capacity = cap;
    dp.pairs_per_rank = static_cast<std::int32_t>(T * k);
    dp.hidden = static_cast<int>(H), dp.top_k = static_cast<int>(k), dp.num_local_experts = static_cast<int>(c.E);
    kernels::launch_dispatch(dp, 8, nullptr);  // (few CTAs: each warp takes several tokens)
    kernels::QuantizeRowsParams qp{};
    qp.x[0] = d_x.get(), qp.pairs_per_rank = T * k, qp.values = fp8.get(), qp.exps = exps.get();
    qp.row_pair = v.row_pair, qp.expert_offset = v.expert_offset, qp.plan_status = v.status, qp.capacity = cap;
    qp.hidden = static_cast<int>(H), qp.top_k = static_cast<int>(k), qp.num_local_experts = static_cast<int>(c.E);
    if (scatter) qp.pair_row = v.pair_row, qp.pairs = T * k;
    qp.rows_bf16 = fp8_copy.get(), qp.rows_bf16_hi = fp8_copy.get() + split * H, qp.split = split;
    kernels::launch_quantize_rows(qp, 8, nullptr);
    EXPECT_EQ(cudaSuccess, cudaGetLastError());
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    return Out{lo.download(), hi.download(), fp8_copy.download(), fp8.download(), exps.download()};
  };
  const Out gather = copy(false), scatter = copy(true);
  EXPECT_EQ(scatter.lo, gather.lo);
  EXPECT_EQ(scatter.hi, gather.hi);
  EXPECT_EQ(scatter.fp8_copy, gather.fp8_copy);
  EXPECT_EQ(scatter.fp8, gather.fp8);
  EXPECT_EQ(scatter.exps, gather.exps);
  // Each plan row's scale bytes (what the FP8 kernels' stages carry): its token's row quantized on the
  // host, exponent + 127 (E8M0); padding rows' 127 (scale 1); past the plan's rows, the poison.
  std::vector<std::vector<int>> token_exponents(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<float> row(static_cast<std::size_t>(H));
    for (std::int64_t h = 0; h < H; ++h) {
      const std::uint32_t bits = static_cast<std::uint32_t>(x[static_cast<std::size_t>(t * H + h)]) << 16;
      std::memcpy(&row[static_cast<std::size_t>(h)], &bits, 4);
    }
    token_exponents[static_cast<std::size_t>(t)] = fp8::quantize(row.data(), 1, static_cast<int>(H), 1, 128).exponents;
  }
  std::int64_t bad_exps = 0;
  for (std::int64_t b = 0; b < H / 128; ++b)
    for (std::int64_t r = 0; r < cap; ++r) {
      const std::int32_t pair = r < rows ? host.row_pair[r] : -2;
      const int want = pair >= 0 ? token_exponents[static_cast<std::size_t>(pair / k)][static_cast<std::size_t>(b)] + 127
                       : pair == -1 ? 127
                                    : 0xab;
      bad_exps += scatter.exps[b * cap + r] != want;
    }
  EXPECT_EQ(bad_exps, 0);
  // The rows themselves: the token's row, zeros, or the poison past the plan's rows.
  std::int64_t bad = 0, padding = 0;
  for (std::int64_t r = 0; r < cap; ++r) {
    const std::uint16_t* got = r < split ? &scatter.lo[r * H] : &scatter.hi[(r - split) * H];
    const std::int32_t pair = r < rows ? host.row_pair[r] : -2;
    padding += pair == -1;
    for (std::int64_t h = 0; h < H; ++h) {
      const std::uint16_t want = pair >= 0 ? x[pair / k * H + h] : pair == -1 ? 0 : 0xabab;
      bad += got[h] != want || scatter.fp8_copy[r * H + h] != want;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(padding, 0);  // (the case has padding rows to zero)
}

INSTANTIATE_TEST_SUITE_P(
    Dispatch, RowCopyCases,
    ::testing::Values(RowCopyCase{"padded_k3", RoutingKind::padded, 1000, 8, 3, 256},
                      RowCopyCase{"uniform_k8", RoutingKind::uniform, 777, 32, 8, 1152},
                      RowCopyCase{"skewed_k34", RoutingKind::skewed, 300, 48, 34, 128}),
    [](const auto& info) { return std::string(info.param.name); });

// The FP8 weight gradients' transposing quantization (kernels::launch_quantize_columns): the
// plan's rows — gathered from a [T, C] tensor by the plan, or a [capacity, C] tensor's plan
// rows — as E4M3 rows of their transpose, equal byte for byte to the host's fp8::quantize of
// that transpose with 1 x 128 blocks (a scale per column and 128 rows) or 128 x 128 blocks,
// the scales' E8M0 bytes and the exponents where Fp8WgradParams reads them; tiles past the plan's untouched. The
// gathers visiting the tiles in the rank order (launch_tile_order, a permutation of the plan's
// tiles) write the same bytes (13 column tiles: a CTA's strips of 4, 4, 4 and 1). Scale bytes and
// exponents of tiles past the plan's stay untouched too. Some columns hold NaN (ignored by the largest magnitude, as the
// host's), infinities, negative zeros or only subnormal values.
TEST(Fp8Quantize, TransposedColumnsAreTheHostsQuantizationOfTheTranspose) {
  MOK_REQUIRE_HOPPER();
  const std::int64_t T = 700, E = 8, k = 3, C = 1664;
  MoeShape s = shape(E, E, k);
  s.hidden = C;
  const auto ids = make_routing(RoutingKind::padded, T, E, k, 23);
  DeviceBuffer<std::int32_t> d_ids(ids);
  DevicePlan plan(s, T, {.block_m = 128});
  plan_device(TensorView::contiguous(d_ids.get(), DType::i32, Device::cuda(0), {T, k}), 0, plan, nullptr);
  const Plan host = plan.to_host(nullptr, 0);
  const std::int64_t cap = plan.capacity_rows(), rows = host.expert_offset.back(), stride = cap / 128 + 1;
  ASSERT_EQ(rows % 128, 0);
  ASSERT_LT(rows, cap);  // (a tile past the plan's stays untouched)
  std::mt19937 gen(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random_bf16 = [&](std::int64_t n) {
    std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {  // (a few channels much larger: the blocks' scales differ)
      const std::int64_t c = i % C, r = i / C;
      const float f = normal(gen) * (c % 97 == 3 ? 300.f : c % 97 == 5 ? 1e-39f : 1.f);  // (5: subnormal)
      std::uint32_t bits;
      std::memcpy(&bits, &f, 4);
      std::uint16_t b = static_cast<std::uint16_t>(bits >> 16);
      if (c == 10 && r % 50 == 3) b = 0x7fc0;  // NaN
      if (c == 140 && r % 300 == 7) b = r % 600 == 7 ? 0x7f80 : 0xff80;  // +-infinity
      if (c == 300) b = 0x8000;  // -0 everywhere
      v[static_cast<std::size_t>(i)] = b;
    }
    return v;
  };
  auto value = [](std::uint16_t b) {
    const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  const DevicePlanView& v = plan.view();
  DeviceBuffer<std::int32_t> order(static_cast<std::size_t>(cap / 128));
  EXPECT_EQ(cudaSuccess, cudaMemset(order.get(), 0xff, cap / 128 * 4));
  kernels::launch_tile_order(v.expert_offset, v.tile_expert, v.tile_row, v.num_tiles, v.status, static_cast<int>(E),
                             cap / 128, order.get(), nullptr);
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  {
    const auto o = order.download();
    std::vector<int> seen(static_cast<std::size_t>(rows / 128), 0);
    for (std::int64_t p = 0; p < rows / 128; ++p)
      if (o[p] >= 0 && o[p] < rows / 128) ++seen[static_cast<std::size_t>(o[p])];
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << "not a permutation of the tiles";
  }
  for (bool gather : {true, false}) {
    const auto src = random_bf16(gather ? T * C : cap * C);
    DeviceBuffer<std::uint16_t> d_src(src);
    // The host's transpose of the plan's rows [0, rows): [C, rows].
    std::vector<float> t(static_cast<std::size_t>(C * rows), 0.f);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t pair = host.row_pair[r];
      if (gather && pair < 0) continue;  // (padding: zeros)
      const std::uint16_t* row = &src[static_cast<std::size_t>((gather ? pair / k : r) * C)];
      for (std::int64_t c = 0; c < C; ++c) t[static_cast<std::size_t>(c * rows + r)] = value(row[c]);
    }
    for (int variant = 0; variant < (gather ? 4 : 2); ++variant) {
      const bool blocks = variant % 2 == 1, ordered = variant >= 2;
      DeviceBuffer<std::uint8_t> values(static_cast<std::size_t>(C * cap));
      DeviceBuffer<std::uint8_t> scale_bytes(static_cast<std::size_t>(cap / 128 * C));
      DeviceBuffer<std::int32_t> exponents(static_cast<std::size_t>(C / 128 * stride));
      EXPECT_EQ(cudaSuccess, cudaMemset(values.get(), 0xab, C * cap));
      EXPECT_EQ(cudaSuccess, cudaMemset(scale_bytes.get(), 0xab, cap / 128 * C));
      EXPECT_EQ(cudaSuccess, cudaMemset(exponents.get(), 0xab, C / 128 * stride * 4));
      kernels::QuantizeColumnsParams q{};
      q.src = d_src.get(), q.row_stride = C, q.row_pair = gather ? v.row_pair : nullptr, q.top_k = static_cast<int>(k);
      q.values = values.get();
      q.col_exps = blocks ? nullptr : scale_bytes.get();
      q.block_exponents = blocks ? exponents.get() : nullptr;
      q.exponent_stride = stride;
      q.num_tiles = v.num_tiles, q.plan_status = v.status, q.capacity = cap, q.columns = static_cast<int>(C);
      q.tile_order = ordered ? order.get() : nullptr;
      kernels::launch_quantize_columns(q, nullptr);
      EXPECT_EQ(cudaSuccess, cudaGetLastError());
      EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
      const fp8::Blockwise want = fp8::quantize(t.data(), static_cast<int>(C), static_cast<int>(rows), blocks ? 128 : 1, 128);
      const auto got = values.download();
      const auto got_exponents = exponents.download();
      const auto got_bytes = scale_bytes.download();
      std::int64_t bad = 0, untouched = 0, bad_scales = 0, touched_scales = 0;
      for (std::int64_t c = 0; c < C; ++c) {
        for (std::int64_t r = 0; r < rows; ++r)
          bad += got[static_cast<std::size_t>(c * cap + r)] != want.values[static_cast<std::size_t>(c * rows + r)];
        for (std::int64_t r = rows; r < cap; ++r) untouched += got[static_cast<std::size_t>(c * cap + r)] == 0xab;
      }
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t b = 0; b < rows / 128; ++b) {
          const int e = want.exponent_of(static_cast<int>(c), static_cast<int>(b * 128));
          if (blocks) {
            if (c % 128 == 0) bad_scales += got_exponents[static_cast<std::size_t>(c / 128 * stride + b)] != e;
          } else {
            bad_scales += got_bytes[static_cast<std::size_t>(b * C + c)] != e + 127;  // (E8M0: e >= -127)
          }
        }
      auto poisoned = [](const auto& value) {  // (the memset's 0xab bytes)
        std::uint32_t bits;
        std::memcpy(&bits, &value, 4);
        return bits == 0xababababu;
      };
      for (std::int64_t b = rows / 128; b < cap / 128; ++b)
        for (std::int64_t c = 0; c < C; ++c)
          touched_scales += got_bytes[static_cast<std::size_t>(b * C + c)] != 0xab;
      for (std::int64_t cb = 0; cb < C / 128; ++cb)
        for (std::int64_t b = rows / 128; b < stride; ++b)
          touched_scales += !poisoned(got_exponents[static_cast<std::size_t>(cb * stride + b)]);
      EXPECT_EQ(bad, 0) << "gather " << gather << ", blocks " << blocks << ", ordered " << ordered;
      EXPECT_EQ(untouched, C * (cap - rows)) << "gather " << gather << ", blocks " << blocks << ", ordered " << ordered;
      EXPECT_EQ(bad_scales, 0) << "gather " << gather << ", blocks " << blocks << ", ordered " << ordered;
      EXPECT_EQ(touched_scales, 0) << "gather " << gather << ", blocks " << blocks << ", ordered " << ordered;
    }
  }
}

TEST(DevicePlan, BadExpertIdIsReportedWithPosition) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape(8, 8, 2);
  auto ids = make_routing(RoutingKind::uniform, 3000, 8, 2, 9);
  ids[2 * 1234 + 1] = 8;
  ids[2 * 2000] = -5;  // a later bad id: the first one is reported
  DeviceBuffer<std::int32_t> d(ids);
  DevicePlan plan(s, 3000);
  plan_device(TensorView::contiguous(d.get(), DType::i32, Device::cuda(0), {3000, 2}), 0, plan, nullptr);
  try {
    plan.check(nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert id must be in [-1, 8), got 8 at rank 0, token 1234, slot 1"),
              std::string::npos) << e.what();
  }
}

TEST(DevicePlan, CapacityExceededIsReported) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape(8, 8, 2);
  const auto ids = make_routing(RoutingKind::uniform, 3000, 8, 2, 9);
  DeviceBuffer<std::int32_t> d(ids);
  DevicePlan plan(s, 3000, {.block_m = 128, .capacity_rows = 1024});
  plan_device(TensorView::contiguous(d.get(), DType::i32, Device::cuda(0), {3000, 2}), 0, plan, nullptr);
  try {
    plan.check(nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity exceeded"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("capacity is 1024"), std::string::npos) << e.what();
  }
}

// Captured once, replayed with new routings written into the same input buffer.
TEST(DevicePlan, SurvivesGraphCaptureAndReplay) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape(32, 32, 4);
  const std::int64_t T = 2500;
  DeviceBuffer<std::int32_t> d(static_cast<std::size_t>(T * 4));
  DevicePlan plan(s, T);
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const testing::CapturedGraph graph(
      stream, [&] { plan_device(TensorView::contiguous(d.get(), DType::i32, Device::cuda(0), {T, 4}), 0, plan, stream); });
  MOK_CUDA_OK(graph.error());
  for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::skewed, RoutingKind::padded, RoutingKind::first_half}) {
    const auto ids = make_routing(kind, T, 32, 4, 5);
    d.upload(ids, stream);
    MOK_CUDA_OK(graph.launch(stream));
    testing::expect_plans_equal(plan.to_host(stream, 0), plan_host(s, T, ids, 0));
  }
  cudaStreamDestroy(stream);
}

TEST(PointerLocation, HostPointerDeclaredOnGpu) {
  MOK_REQUIRE_HOPPER();
  alignas(16) static char host[64];
  try {
    check_pointer_location("mok::forward", "x", TensorView::contiguous(host, DType::bf16, Device::cuda(0), {32}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'x': is declared on cuda:0 but its pointer is host memory"),
              std::string::npos) << e.what();
  }
  DeviceBuffer<std::uint16_t> d(32);
  EXPECT_NO_THROW(check_pointer_location("mok::forward", "x", TensorView::contiguous(d.get(), DType::bf16, Device::cuda(0), {32})));
  // Passed once on cuda:0 (and remembered), the pointer is still refused on another device...
  try {
    check_pointer_location("mok::forward", "w", TensorView::contiguous(d.get(), DType::bf16, Device::cuda(1), {32}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'w': is declared on cuda:1 but its pointer lives on cuda:0"),
              std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(check_pointer_location("mok::forward", "x", TensorView::contiguous(d.get(), DType::bf16, Device::cuda(0), {32})));
  // ...and as cpu memory.
  try {
    check_pointer_location("mok::forward", "y", TensorView::contiguous(d.get(), DType::bf16, Device::cpu(), {32}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'y': is declared on cpu but its pointer is memory of cuda:0"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mok
