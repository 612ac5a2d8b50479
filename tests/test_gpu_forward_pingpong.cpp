// The forward with ping-pong consumers (Config::pingpong): against the fp64 CPU reference on
// fresh random inputs with the output poisoned first, and bitwise against the cooperative
// kernel (each output element is the same K-ordered sum), across SM counts, task orders and
// token counts; training: the backward's gradients are the cooperative kernel's bits, in save
// and recompute mode.
#include <gtest/gtest.h>

#include "gpu_grads.hpp"
#include "gpu_problem.hpp"
#include "mok/backward.hpp"
#include "mok/error.hpp"
#include "mok/forward.hpp"

namespace mok {
namespace {

using testing::Case;
using testing::DeviceBuffer;
using testing::GpuGrads;
using testing::GpuProblem;
using testing::random_bf16;
using testing::same_bits;
using testing::saved_view;
using testing::shape_of;

Config pingpong_config(int sms = 0, std::int64_t interleave_rows = 0) {
  Config config;
  config.pingpong = true;
  config.compute_sms = sms;
  config.interleave_rows = interleave_rows;
  return config;
}

std::vector<bf16> forward_y(const HostProblem& host, GpuProblem& gpu, const Config& config) {
  Workspace ws(host.shape, host.tokens, config);
  gpu.poison_output();
  forward(gpu.args(), ws, nullptr);
  ws.check(nullptr);
  return gpu.y.download();
}

class PingPongCases : public ::testing::TestWithParam<Case> {};

TEST_P(PingPongCases, MatchesReferenceAndTheCooperativeBits) {
  MOK_REQUIRE_HOPPER();
  const Case c = GetParam();
  const MoeShape s = shape_of(c);
  for (std::uint64_t seed : {21u, 22u}) {  // fresh inputs each time
    const HostProblem host = make_problem(s, c.tokens, c.routing, seed * 1000 + c.tokens);
    GpuProblem gpu(host);
    const auto cooperative = forward_y(host, gpu, Config{});
    const auto pingpong = forward_y(host, gpu, pingpong_config());
    const auto ref = reference::forward(s, c.tokens, host.reference_x(), host.reference_routing(), host.reference_weights());
    const auto cmp = testing::compare(gpu.output(), ref);
    EXPECT_EQ(cmp.non_finite, 0) << "unwritten or non-finite outputs";
    EXPECT_LE(cmp.rel_error, 1e-2) << c.name << " seed " << seed;
    EXPECT_TRUE(same_bits(pingpong, cooperative)) << c.name << " seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(
    PingPong, PingPongCases,
    ::testing::ValuesIn(testing::routing_cases({
        Case{"uniform_large", 2048, 1024, 512, 16, 4, 0, 0, RoutingKind::uniform},
        Case{"single_token", 1, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
        Case{"partial_tiles", 250, 320, 192, 4, 2, 0, 0, RoutingKind::uniform},
        Case{"shared_odd_widths", 333, 448, 320, 8, 2, 192, 0, RoutingKind::skewed},
        Case{"shared_single_token", 1, 256, 128, 4, 2, 256, 1.0f, RoutingKind::uniform}})),
    [](const auto& info) { return std::string(info.param.name); });

TEST(PingPong, BitwiseAcrossRunsSmCountsTaskOrdersAndTokenCounts) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 1024, 512, 16, 4, 256, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 1500, RoutingKind::skewed, 99);
  GpuProblem gpu(host);
  const auto first = forward_y(host, gpu, Config{});
  Workspace ws(s, host.tokens, pingpong_config());
  for (int run = 0; run < 10; ++run) {
    gpu.poison_output();
    forward(gpu.args(), ws, nullptr);
    ws.check(nullptr);
    ASSERT_TRUE(same_bits(gpu.y.download(), first)) << "run " << run;
  }
  for (int sms : {1, 2, 7, 37, 100}) EXPECT_TRUE(same_bits(forward_y(host, gpu, pingpong_config(sms)), first)) << sms << " SMs";
  for (std::int64_t rows : {128, 384, 1 << 20})
    for (int sms : {0, 9})
      EXPECT_TRUE(same_bits(forward_y(host, gpu, pingpong_config(sms, rows)), first)) << "interleave " << rows << ", " << sms;
  // One workspace, every T up to its max_tokens (a small T after a large one).
  Workspace big(s, 1500, pingpong_config());
  for (std::int64_t T : {1500, 1, 700, 129, 3}) {
    const HostProblem h = make_problem(s, T, RoutingKind::skewed, 500 + T);
    GpuProblem g(h);
    const auto exact = forward_y(h, g, Config{});
    g.poison_output();
    forward(g.args(), big, nullptr);
    big.check(nullptr);
    EXPECT_TRUE(same_bits(g.y.download(), exact)) << "T = " << T;
  }
}

// Every GEMM2 tile's slot rows overwrite its M-tile's routed x rows (Workspace::rows_in_slots)
// while other CTAs' GEMM1 tiles of that M-tile may still read them: the ping-pong kernel counts
// h_ready in whole tasks, and the wait must still cover them.
TEST(PingPong, SlotRowsOverwriteRoutedRowsOnlyAfterGemm1HasReadThem) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 1024, 256, 2, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 2048, RoutingKind::uniform, 2024);
  GpuProblem gpu(host);
  const auto first = forward_y(host, gpu, Config{});
  for (int sms : {2, 9, 33, 132}) EXPECT_TRUE(same_bits(forward_y(host, gpu, pingpong_config(sms)), first)) << sms << " SMs";
  for (int sms : {2, 33, 132})
    EXPECT_TRUE(same_bits(forward_y(host, gpu, pingpong_config(sms, 256)), first)) << sms << " SMs, interleave 256";
}

// Training: with the forward's saved pre-activations (save mode) and with the backward's
// recompute (the ping-pong kernel's GEMM1 only), the gradients and y are the cooperative
// kernel's bits.
TEST(PingPong, TrainingGivesTheCooperativeGradients) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 320, 8, 2, 192, 0.75f, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 700, RoutingKind::padded, 61);
  GpuProblem gpu(host);
  const auto dy = random_bf16(host.x.size(), 62);
  GpuGrads grads(gpu, dy, false);
  auto run = [&](const Config& config, Training mode) {
    Workspace ws(s, host.tokens, config, mode);
    DeviceBuffer<bf16> saved(mode == Training::save ? ws.saved_elements() : 0);
    gpu.poison_output();
    if (mode == Training::save) forward(gpu.args(), ws, nullptr, saved_view(saved));
    grads.poison();
    if (mode == Training::save) backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved));
    else backward(gpu.args(), grads.args(), ws, nullptr);
    ws.check(nullptr);
    std::vector<std::uint8_t> bytes = grads.snapshot();
    if (mode == Training::save) {  // y of the training forward too (the gradients read every saved value)
      const auto y = gpu.y.download();
      bytes.insert(bytes.end(), reinterpret_cast<const std::uint8_t*>(y.data()),
                   reinterpret_cast<const std::uint8_t*>(y.data() + y.size()));
    }
    return bytes;
  };
  const auto cooperative = run(Config{}, Training::save);
  testing::check_gradients(host, grads, dy, "cooperative");
  EXPECT_TRUE(run(pingpong_config(), Training::save) == cooperative) << "save mode";
  EXPECT_TRUE(run(pingpong_config(7), Training::save) == cooperative) << "save mode, 7 SMs";
  EXPECT_TRUE(run(pingpong_config(), Training::recompute) == run(Config{}, Training::recompute)) << "recompute mode";
}

TEST(PingPong, TheRingIsRefused) {
  Config config = pingpong_config();
  config.comm_sms = 4;
  try {
    validate(config);
    FAIL() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'pingpong'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mok
