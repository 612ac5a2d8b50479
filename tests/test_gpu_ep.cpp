// Expert parallelism with virtual ranks on one GPU: the same global problem (ep * T
// tokens, E experts) computed by an EP group of N ranks must match the fp64 reference
// and be bitwise equal to one GPU computing all tokens with all experts, for any N, SM
// count and run.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "gpu_problem.hpp"
#include "mok/ep.hpp"
#include "mok/error.hpp"

namespace mok {
namespace {

using testing::DeviceBuffer;

struct EpCase {
  const char* name;
  int ep;
  std::int64_t tokens_per_rank, hidden, inter, experts, top_k, shared;
  float limit;
  RoutingKind routing;
};
void PrintTo(const EpCase& c, std::ostream* os) { *os << c.name; }

MoeShape global_shape(const EpCase& c) {
  return testing::shape_of({c.name, c.tokens_per_rank * c.ep, c.hidden, c.inter, c.experts, c.top_k, c.shared,
                            c.limit, c.routing});
}

MoeShape rank_shape(const EpCase& c) {
  MoeShape s = global_shape(c);
  s.num_local_experts = c.experts / c.ep;
  return s;
}

// The global problem split into ranks: rank r has tokens [r T, (r + 1) T) and experts
// [r E_l, (r + 1) E_l); every rank holds the same shared expert.
struct EpProblem {
  HostProblem host;
  int ep;
  std::int64_t T;
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> x, gate, up, down, y;
  std::vector<std::unique_ptr<DeviceBuffer<std::int32_t>>> ids;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> weights;
  std::unique_ptr<DeviceBuffer<bf16>> shared_gate, shared_up, shared_down;
  MoeShape shape;

  EpProblem(const EpCase& c, std::uint64_t seed)
      : host(make_problem(global_shape(c), c.tokens_per_rank * c.ep, c.routing, seed)), ep(c.ep), T(c.tokens_per_rank),
        shape(rank_shape(c)) {
    const std::int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_local_experts, k = shape.top_k;
    auto slice = [](const auto& v, std::int64_t begin, std::int64_t n) {
      return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + begin, v.begin() + begin + n);
    };
    for (int r = 0; r < ep; ++r) {
      x.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.x, r * T * H, T * H)));
      ids.push_back(std::make_unique<DeviceBuffer<std::int32_t>>(slice(host.topk_ids, r * T * k, T * k)));
      weights.push_back(std::make_unique<DeviceBuffer<float>>(slice(host.topk_weights, r * T * k, T * k)));
      gate.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.w_gate, r * El * I * H, El * I * H)));
      up.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.w_up, r * El * I * H, El * I * H)));
      down.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.w_down, r * El * H * I, El * H * I)));
      y.push_back(std::make_unique<DeviceBuffer<bf16>>(T * H));
    }
    shared_gate = std::make_unique<DeviceBuffer<bf16>>(host.shared_gate);
    shared_up = std::make_unique<DeviceBuffer<bf16>>(host.shared_up);
    shared_down = std::make_unique<DeviceBuffer<bf16>>(host.shared_down);
  }

  std::vector<ForwardArgs> args() const {
    const Device d = Device::cuda(0);
    const std::int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_local_experts, k = shape.top_k;
    const std::int64_t Is = shape.shared_intermediate;
    std::vector<ForwardArgs> out(ep);
    for (int r = 0; r < ep; ++r) {
      ForwardArgs& a = out[r];
      a.x = TensorView::contiguous(x[r]->get(), DType::bf16, d, {T, H});
      a.topk_ids = TensorView::contiguous(ids[r]->get(), DType::i32, d, {T, k});
      a.topk_weights = TensorView::contiguous(weights[r]->get(), DType::f32, d, {T, k});
      a.w_gate = TensorView::contiguous(gate[r]->get(), DType::bf16, d, {El, I, H});
      a.w_up = TensorView::contiguous(up[r]->get(), DType::bf16, d, {El, I, H});
      a.w_down = TensorView::contiguous(down[r]->get(), DType::bf16, d, {El, H, I});
      if (shape.has_shared()) {
        a.shared_gate = TensorView::contiguous(shared_gate->get(), DType::bf16, d, {Is, H});
        a.shared_up = TensorView::contiguous(shared_up->get(), DType::bf16, d, {Is, H});
        a.shared_down = TensorView::contiguous(shared_down->get(), DType::bf16, d, {H, Is});
      }
      a.y = TensorView::contiguous(y[r]->get(), DType::bf16, d, {T, H});
    }
    return out;
  }

  void poison_outputs() const {
    for (const auto& b : y) cudaMemset(b->get(), 0xff, b->size() * sizeof(bf16));
    cudaDeviceSynchronize();
  }

  // Every rank's y, in global token order.
  std::vector<bf16> outputs() const {
    std::vector<bf16> all;
    for (const auto& b : y) {
      const auto part = b->download();
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
};

std::vector<bf16> run_group(const EpProblem& p, const Config& config = {}) {
  VirtualRanks group(p.shape, p.T, config);
  p.poison_outputs();
  const auto args = p.args();
  group.forward(args, nullptr);
  group.check(nullptr);
  return p.outputs();
}

// One GPU, all tokens and all experts: the result every EP group must reproduce bit for bit.
std::vector<bf16> run_one_gpu(const HostProblem& host) {
  testing::GpuProblem gpu(host);
  Workspace ws(host.shape, host.tokens);
  gpu.poison_output();
  forward(gpu.args(), ws, nullptr);
  ws.check(nullptr);
  return gpu.y.download();
}

bool bitwise_equal(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
}

class EpCases : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpCases, MatchesReferenceAndOneGpuBitwise) {
  MOK_REQUIRE_HOPPER();
  const EpCase c = GetParam();
  for (std::uint64_t seed : {21u, 22u}) {
    const EpProblem p(c, seed * 1000 + c.ep);
    const auto got = run_group(p);
    const auto ref = reference::forward(p.host.shape, p.host.tokens, p.host.reference_x(), p.host.reference_routing(),
                                        p.host.reference_weights());
    const auto cmp = testing::compare(reference::to_double(got), ref);
    EXPECT_EQ(cmp.non_finite, 0) << "unwritten or non-finite outputs";
    EXPECT_LE(cmp.rel_error, 1e-2) << c.name << " seed " << seed;
    EXPECT_TRUE(bitwise_equal(got, run_one_gpu(p.host))) << c.name << ": EP = " << c.ep << " differs from one GPU";
    RecordProperty("rel_error", std::to_string(cmp.rel_error));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ep, EpCases,
    ::testing::Values(EpCase{"ep1_uniform", 1, 300, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
                      EpCase{"ep2_uniform", 2, 300, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
                      EpCase{"ep4_uniform", 4, 257, 512, 256, 16, 4, 0, 0, RoutingKind::uniform},
                      EpCase{"ep8_uniform", 8, 200, 256, 384, 16, 2, 0, 0, RoutingKind::uniform},
                      EpCase{"ep4_skewed", 4, 400, 256, 256, 8, 2, 0, 0, RoutingKind::skewed},
                      EpCase{"ep4_idle_ranks", 4, 300, 256, 256, 16, 2, 0, 0, RoutingKind::first_half},
                      EpCase{"ep8_padded_shared_clamp", 8, 150, 256, 256, 16, 4, 192, 0.75f, RoutingKind::padded},
                      EpCase{"ep8_one_expert_per_rank_k1", 8, 129, 320, 192, 8, 1, 0, 0, RoutingKind::uniform},
                      EpCase{"ep2_all_to_one_expert", 2, 200, 256, 256, 4, 1, 0, 0, RoutingKind::one_expert},
                      // small enough for compute-sanitizer (scripts/gpu_check.sh)
                      EpCase{"ep4_small_shared_padded_clamp", 4, 64, 256, 128, 8, 2, 128, 0.75f, RoutingKind::padded}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Ep, BitwiseEqualAcrossRunsAndSmCounts) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 4, 500, 512, 256, 16, 4, 256, 0, RoutingKind::skewed};
  const EpProblem p(c, 7);
  const auto first = run_group(p);
  ASSERT_TRUE(bitwise_equal(first, run_one_gpu(p.host)));
  VirtualRanks group(p.shape, p.T);
  const auto args = p.args();
  for (int run = 0; run < 10; ++run) {
    p.poison_outputs();
    group.forward(args, nullptr);
    group.check(nullptr);
    ASSERT_TRUE(bitwise_equal(p.outputs(), first)) << "run " << run;
  }
  for (int sms : {4, 12, 60}) {
    Config config;
    config.compute_sms = sms;
    EXPECT_TRUE(bitwise_equal(run_group(p, config), first)) << sms << " SMs";
  }
}

TEST(Ep, BadExpertIdOnOneRankStopsEveryRank) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 4, 100, 256, 256, 8, 2, 0, 0, RoutingKind::uniform};
  EpProblem p(c, 5);
  std::vector<std::int32_t> ids(p.host.topk_ids.begin() + 2 * p.T * 2, p.host.topk_ids.begin() + 3 * p.T * 2);
  ids[7] = 8;  // E = 8: out of range, on rank 2
  p.ids[2]->upload(ids);
  VirtualRanks group(p.shape, p.T);
  p.poison_outputs();
  const auto args = p.args();
  group.forward(args, nullptr);
  try {
    group.check(nullptr);
    FAIL() << "no error reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("got 8 at rank 2, token 3, slot 1"), std::string::npos) << e.what();
  }
  for (const bf16 v : p.outputs()) ASSERT_TRUE(std::isnan(v.to_float())) << "a rank wrote output from a bad plan";
}

TEST(Ep, ArgumentsAreChecked) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 2, 64, 256, 256, 8, 2, 0, 0, RoutingKind::uniform};
  const EpProblem p(c, 3);
  VirtualRanks group(p.shape, p.T);
  auto args = p.args();
  args.pop_back();
  EXPECT_THROW(group.forward(args, nullptr), Error);
  MoeShape too_many = p.shape;
  too_many.num_experts = 32, too_many.num_local_experts = 2;  // 16 ranks
  EXPECT_THROW(VirtualRanks(too_many, 64), Error);
}

// A rank that never pushes its rows: its peers' combines must stop within the timeout and
// the error must name the waiting rank, the stalled peer, the phase and the counters. The
// timeout ends the kernel with a trap (the CUDA context is lost), so the check runs in a
// child process.
void run_with_stalled_rank() {
  const EpCase c{"", 4, 200, 256, 256, 8, 2, 0, 0, RoutingKind::uniform};
  const EpProblem p(c, 9);
  Config config;
  config.timeout_seconds = 0.5;
  VirtualRanks group(p.shape, p.T, config);
  group.stall_rank_for_testing(2);
  const auto args = p.args();
  const auto start = std::chrono::steady_clock::now();
  try {
    group.forward(args, nullptr);
    group.check(nullptr);
  } catch (const Error& e) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "%s [after %.2f s]\n", e.what(), seconds);
    std::exit(seconds < 0.5 + 5.0 ? 42 : 43);
  }
  std::exit(0);
}

TEST(EpDeathTest, StalledRankTimesOutNamingRankPeerPhaseAndCounters) {
  MOK_REQUIRE_HOPPER();
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: CUDA does not survive fork
  EXPECT_EXIT(run_with_stalled_rank(), ::testing::ExitedWithCode(42),
              "timeout after 0.5 s on rank [013] .*pushes into this rank's combine slots.* from peer rank 2; "
              "expected [0-9]+, observed 0");
}

}  // namespace
}  // namespace mok
