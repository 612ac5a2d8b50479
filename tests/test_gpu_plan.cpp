// The device planner must build exactly the host planner's plan, without host sync.
#include <gtest/gtest.h>

#include "gpu_support.hpp"
#include "mok/device_plan.hpp"
#include "mok/error.hpp"
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
