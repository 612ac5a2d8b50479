// The FP8 dgrad (Precision::fp8 with BackwardArgs::fp8): the routed dh and dx GEMMs in E4M3; and
// with BackwardArgs::fp8_weight_gradients the routed weight gradients' GEMMs too (Fp8Wgrad*).
// Every gradient against the fp64 reference of its recipe (reference::backward_fp8: the same
// quantized operands, exact sums) on fresh random inputs with the outputs poisoned first; the
// transposed weights against the forward's quantization; bitwise determinism across runs and
// SM counts. (Its accuracy against the exact layer: test_gpu_forward_fp8.cpp; its argument
// errors: test_validate.cpp and Fp8Backward.RejectsMisuse.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include <string>
#include <vector>

#include "gpu_fp8.hpp"
#include "gpu_grads.hpp"
#include "gpu_problem.hpp"
#include "mok/backward.hpp"
#include "mok/error.hpp"
#include "mok/forward.hpp"
#include "mok/fp8.hpp"

namespace mok {
namespace {

using testing::Case;
using testing::DeviceBuffer;
using testing::fp8_args;
using testing::fp8_config;
using testing::GpuProblem;
using testing::QuantizedWeights;
using testing::shape_of;

// One FP8 training step (forward with Training::save, then the backward with the FP8 dgrad, and
// wgrad: its weight gradients in E4M3 too) into grads (poisoned first).
void train_step(const GpuProblem& gpu, const QuantizedWeights& q, const testing::GpuGrads& grads, Workspace& ws,
                bool wgrad = false) {
  DeviceBuffer<bf16> saved(ws.saved_elements());
  gpu.poison_output();
  forward(fp8_args(gpu, q), ws, nullptr, testing::saved_view(saved));
  grads.poison();
  BackwardArgs b = grads.args();
  b.fp8 = q.dgrad;
  b.fp8_weight_gradients = wgrad;
  backward(fp8_args(gpu, q), b, ws, nullptr, testing::saved_view(saved));
  ws.check(nullptr);
}

// The recipe's fp64 gradients differ from the kernel's in the sums (the tensor cores' inside a
// 128-K block, fp32 promotion, dh's products before the SwiGLU backward) and in the E4M3
// roundings of dgate|dup that those move across a boundary (one E4M3 step is 6-12 % of a
// value); dx carries them, and the weight gradients dh's sums. Measured on an H200 before the
// reference rounded dgate|dup to bf16 first as the kernel does: dx 1.0-1.8 % (cosine >= 0.99984),
// d_w_up 1.1 % with the clamp, the rest <= 1 %. A wrong scale, row or block is far above.
constexpr testing::Bars kDxVsRecipe{2.5e-2, 0.9997}, kVsRecipe{1.5e-2, 0.9999};
// With the FP8 weight gradients the routed ones read those E4M3 dgate|dup values as an operand
// (per channel and 128 rows), as dx does (per row): the same crossings, so dx's bars. Measured on
// an H200 (580ab80, 2026-12-05): d_w_gate 1.77 % (cosine 0.99984) with the clamp, where the
// forward's pre-activations one bf16 step either side of the limit switch dgate between 0 and
// a full value; the other cases within kVsRecipe. (Against the exact layer: the accuracy table.)
constexpr testing::Bars kWgradVsRecipe = kDxVsRecipe;

// One FP8 training step of case c (gradients poisoned first; f32 ones zeroed, as they are accumulated
// into) against the recipe's fp64 reference: with the FP8 dgrad, and wgrad: the FP8 weight
// gradients too. seed: the problem's (dy's is seed - 54); dy_exponent: dy times 2^dy_exponent.
void expect_recipe(const Case& c, bool f32, bool wgrad, std::uint64_t seed, int dy_exponent = 0) {
  const MoeShape s = shape_of(c);
  const HostProblem host = make_problem(s, c.tokens, c.routing, seed);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  auto dy = testing::random_bf16(host.x.size(), seed - 54);
  for (bf16& v : dy) v = bf16::from_float(std::ldexp(v.to_float(), dy_exponent));
  testing::GpuGrads grads(gpu, dy, f32);
  Workspace ws(s, c.tokens, fp8_config(), Training::save);
  std::vector<std::vector<double>> base;  // (f32 gradients are accumulated into: zero them)
  if (f32)
    for (auto* g : {&grads.d_gate, &grads.d_up, &grads.d_down, &grads.d_sgate, &grads.d_sup, &grads.d_sdown}) {
      cudaMemset(g->get(), 0, g->size());
      base.emplace_back(g->size() / 4, 0.0);
    }
  train_step(gpu, q, grads, ws, wgrad);
  const auto x = host.reference_x();
  const auto ref = reference::backward_fp8(s, c.tokens, x, host.reference_routing(), host.reference_weights(),
                                           reference::to_double(dy), /*fp8_dgrad=*/true, wgrad);
  testing::expect_gradients(ref, grads, c.name, base, kDxVsRecipe, kVsRecipe,
                            wgrad ? std::optional{kWgradVsRecipe} : std::nullopt);
}

// The recipe cases (the case, whether its weight gradients are f32): plain, shared + padded +
// clamp, I = H = 384 skewed, H 512 / I 128 with f32 gradients. The FP8 weight gradients take one
// more, with empty experts.
const std::vector<std::pair<Case, bool>> kRecipeCases{
    {Case{"plain", 500, 256, 256, 8, 2, 0, 0, RoutingKind::uniform}, false},
    {Case{"shared_padded_clamp", 301, 256, 256, 8, 2, 128, 0.75f, RoutingKind::padded}, false},
    {Case{"i384_h384_skewed", 400, 384, 384, 8, 2, 0, 0, RoutingKind::skewed}, false},
    {Case{"h512_i128_f32", 333, 512, 128, 4, 2, 128, 0, RoutingKind::uniform}, true}};

std::vector<std::pair<Case, bool>> wgrad_cases() {
  std::vector<std::pair<Case, bool>> cases = kRecipeCases;
  cases.push_back({Case{"empty_experts", 40, 256, 384, 16, 1, 0, 0, RoutingKind::skewed}, false});
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<std::pair<Case, bool>>& info) {
  return info.param.first.name;
}

class Fp8BackwardCases : public ::testing::TestWithParam<std::pair<Case, bool>> {};

TEST_P(Fp8BackwardCases, MatchesTheRecipeReference) {
  MOK_REQUIRE_HOPPER();
  const auto [c, f32] = GetParam();
  expect_recipe(c, f32, /*wgrad=*/false, 71 + c.tokens);
}

INSTANTIATE_TEST_SUITE_P(Fp8Backward, Fp8BackwardCases, ::testing::ValuesIn(kRecipeCases), case_name);

// Row scales at the recipe's floor, 2^-127, in the FP8 dgrad (blocks whose largest |value| is below
// 1.75 2^-119): dy times 2^-121 puts every dy block there and most of dgate|dup's (the floor applied by
// quantize_dgu_rows as by the host), whose stages then carry E8M0 byte 0 (as the forward's:
// test_gpu_forward_fp8.cpp); against the recipe as above, with f32 weight gradients (the tiny values
// keep their precision there).
TEST(Fp8Backward, SubnormalRowScalesAreReadExactly) {
  MOK_REQUIRE_HOPPER();
  expect_recipe(Case{"subnormal_row_scales", 333, 512, 256, 4, 2, 0, 0, RoutingKind::uniform}, /*f32=*/true,
                /*wgrad=*/false, 91, /*dy_exponent=*/-121);
}

// W_down^T and [W_gate^T | W_up^T] from quantize_dgrad_weights are the forward's quantized
// blocks transposed: the same bytes and exponents.
TEST(Fp8Backward, DgradWeightsAreTheForwardBlocksTransposed) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 384, 256, 3, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 10, RoutingKind::uniform, 3);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  const std::int64_t E = s.num_local_experts, H = s.hidden, I = s.intermediate, Hb = H / 128, Ib = I / 128;
  const auto down = q.down.download(), down_t = q.down_t.download(), gate = q.gate.download(), up = q.up.download();
  const auto gate_up_t = q.gate_up_t.download();
  const auto down_x = q.down_exponents.download(), down_t_x = q.down_t_exponents.download();
  const auto gate_x = q.gate_exponents.download(), up_x = q.up_exponents.download();
  const auto gate_up_t_x = q.gate_up_t_exponents.download();
  std::int64_t bad = 0;
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < I; ++i) {
        bad += down_t[(e * I + i) * H + h] != down[(e * H + h) * I + i];
        bad += gate_up_t[(e * H + h) * 2 * I + i] != gate[(e * I + i) * H + h];
        bad += gate_up_t[(e * H + h) * 2 * I + I + i] != up[(e * I + i) * H + h];
      }
  EXPECT_EQ(bad, 0) << "values differing from the forward's quantization";
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t hb = 0; hb < Hb; ++hb)
      for (std::int64_t ib = 0; ib < Ib; ++ib) {
        EXPECT_EQ(down_t_x[(e * Ib + ib) * Hb + hb], down_x[(e * Hb + hb) * Ib + ib]);
        EXPECT_EQ(gate_up_t_x[(e * Hb + hb) * 2 * Ib + ib], gate_x[(e * Ib + ib) * Hb + hb]);
        EXPECT_EQ(gate_up_t_x[(e * Hb + hb) * 2 * Ib + Ib + ib], up_x[(e * Ib + ib) * Hb + hb]);
      }
}

// fp8::quantize_experts with the dgrad operands (W and W^T from one read, three kernels) writes
// the bytes of the separate quantizations (quantize_weights, quantize_dgrad_weights: six), every
// buffer poisoned before; without them, the forward's bytes and the dgrad buffers untouched.
TEST(Fp8Backward, QuantizeExpertsFromOneReadWritesTheSeparateQuantizationsBytes) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 384, 256, 3, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 10, RoutingKind::uniform, 4);
  GpuProblem gpu(host);
  using By = QuantizedWeights::By;
  const QuantizedWeights separate(gpu), one_read(gpu, By::one_read), forward_only(gpu, By::forward_only);
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  // (the forward's six buffers of q against the separate quantization's)
  const auto expect_forward_bytes = [&](const QuantizedWeights& q, const char* by) {
    EXPECT_EQ(q.gate.download(), separate.gate.download()) << by;
    EXPECT_EQ(q.up.download(), separate.up.download()) << by;
    EXPECT_EQ(q.down.download(), separate.down.download()) << by;
    EXPECT_EQ(q.gate_exponents.download(), separate.gate_exponents.download()) << by;
    EXPECT_EQ(q.up_exponents.download(), separate.up_exponents.download()) << by;
    EXPECT_EQ(q.down_exponents.download(), separate.down_exponents.download()) << by;
  };
  expect_forward_bytes(forward_only, "forward only");
  for (const auto& b : {forward_only.down_t.download(), forward_only.gate_up_t.download()})
    EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](std::uint8_t v) { return v == 0xa5; })) << "a dgrad buffer written";
  for (const auto& b : {forward_only.down_t_exponents.download(), forward_only.gate_up_t_exponents.download()})
    EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](std::int32_t v) { return v == 0x5a5a5a5a; })) << "a dgrad buffer written";
  expect_forward_bytes(one_read, "one read");
  EXPECT_EQ(one_read.down_t.download(), separate.down_t.download());
  EXPECT_EQ(one_read.gate_up_t.download(), separate.gate_up_t.download());
  EXPECT_EQ(one_read.down_t_exponents.download(), separate.down_t_exponents.download());
  EXPECT_EQ(one_read.gate_up_t_exponents.download(), separate.gate_up_t_exponents.download());
}

// The FP8 weight gradients (BackwardArgs::fp8_weight_gradients) against the recipe's reference
// with them (reference::backward_fp8(..., fp8_wgrad = true): the same E4M3 operands — dy and
// dgate|dup per channel and 128 rows, x and w h per 128 x 128 — exact sums). The kernel's
// differ in the sums (the tensor cores' inside a 128-row block, fp32 promotion) and in the E4M3
// roundings that dgate|dup and w h, moved by the dgrad's own sums, cross: the routed weight
// gradients have dx's bars (kWgradVsRecipe), the rest the FP8 dgrad's (a wrong scale, block or row
// is far above).
class Fp8WgradCases : public ::testing::TestWithParam<std::pair<Case, bool>> {};

TEST_P(Fp8WgradCases, MatchesTheRecipeReference) {
  MOK_REQUIRE_HOPPER();
  const auto [c, f32] = GetParam();
  expect_recipe(c, f32, /*wgrad=*/true, 81 + c.tokens);
}

INSTANTIATE_TEST_SUITE_P(Fp8Wgrad, Fp8WgradCases, ::testing::ValuesIn(wgrad_cases()), case_name);

// The bars hold over seeds, with the clamp (its flips: kWgradVsRecipe) and without.
TEST(Fp8Wgrad, MatchesTheRecipeReferenceOverSeeds) {
  MOK_REQUIRE_HOPPER();
  for (std::uint64_t seed = 1001; seed <= 1006; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int i : {0, 1}) expect_recipe(kRecipeCases[i].first, false, true, seed);  // plain, shared_padded_clamp
  }
}

// The FP8 weight gradients change nothing else: dx, d_topk_weights and the shared expert's
// gradients are bitwise those of the FP8 dgrad with bf16 weight gradients (the same dgrad
// launches, minus the routed weight-gradient tiles).
TEST(Fp8Wgrad, LeavesEveryOtherGradientBitwise) {
  MOK_REQUIRE_HOPPER();
  const Case c{"", 700, 384, 256, 8, 2, 256, 0.75f, RoutingKind::skewed};
  const MoeShape s = shape_of(c);
  const HostProblem host = make_problem(s, c.tokens, c.routing, 55);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  const auto dy = testing::random_bf16(host.x.size(), 56);
  std::vector<std::vector<std::uint8_t>> others;
  for (bool wgrad : {false, true}) {
    testing::GpuGrads grads(gpu, dy, false);
    Workspace ws(s, c.tokens, fp8_config(), Training::save);
    train_step(gpu, q, grads, ws, wgrad);
    others.push_back(grads.snapshot(/*routed_weights=*/false));
  }
  EXPECT_TRUE(others[0] == others[1]);
}

// A workspace's own scratch, made by an FP8-dgrad call, grows for the first call with the FP8
// weight gradients (with f32 gradients their operands' scales need more than the largest figure
// a workspace allocates up front) and serves both afterwards: the same bits as a fresh
// workspace's, in either order.
TEST(Fp8Wgrad, OwnScratchGrowsForIt) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 256, 8, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 400, RoutingKind::uniform, 57);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  const auto dy = testing::random_bf16(host.x.size(), 58);
  auto run = [&](Workspace& ws, bool wgrad) {
    testing::GpuGrads grads(gpu, dy, /*fp32=*/true);
    for (auto* g : {&grads.d_gate, &grads.d_up, &grads.d_down, &grads.d_sgate, &grads.d_sup, &grads.d_sdown})
      cudaMemset(g->get(), 0, g->size());  // (f32 gradients are accumulated into)
    train_step(gpu, q, grads, ws, wgrad);
    return grads.snapshot();
  };
  Workspace fresh_dgrad(s, host.tokens, fp8_config(), Training::save), fresh_wgrad(s, host.tokens, fp8_config(), Training::save);
  const auto want_dgrad = run(fresh_dgrad, false), want_wgrad = run(fresh_wgrad, true);
  Workspace shared(s, host.tokens, fp8_config(), Training::save);
  EXPECT_TRUE(run(shared, false) == want_dgrad);
  const std::int64_t before = shared.bytes();
  EXPECT_TRUE(run(shared, true) == want_wgrad);
  EXPECT_GT(shared.bytes(), before) << "the scratch did not grow";
  EXPECT_TRUE(run(shared, false) == want_dgrad);
  EXPECT_TRUE(run(shared, true) == want_wgrad);
}

TEST(Fp8Backward, BitwiseEqualAcrossRunsAndSmCounts) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 384, 8, 2, 256, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 1500, RoutingKind::skewed, 33);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  const auto dy = testing::random_bf16(host.x.size(), 34);
  std::vector<std::vector<std::uint8_t>> runs;
  // (the backward in one launch of whole x rows — the default at this H, mok::default_backward_column_blocks —
  // or asked for two column blocks of 256, or for three, which at H = 512 are the same two: the same
  // bits; Config::backward_column_blocks)
  for (bool wgrad : {false, true}) {  // (and with the FP8 weight gradients: their own bits, the same in every run)
    runs.clear();
    for (auto [sms, blocks] : {std::pair{0, 0}, {0, 0}, {7, 0}, {61, 0}, {0, 2}, {7, 3}}) {
      testing::GpuGrads grads(gpu, dy, false);
      Config config = fp8_config(sms);
      config.backward_column_blocks = blocks;
      Workspace ws(s, host.tokens, config, Training::save);
      train_step(gpu, q, grads, ws, wgrad);
      train_step(gpu, q, grads, ws, wgrad);  // (the second call of a workspace replays a graph of its launches)
      runs.push_back(grads.snapshot());
    }
    for (std::size_t i = 1; i < runs.size(); ++i) EXPECT_TRUE(runs[0] == runs[i]) << "run " << i << ", wgrad " << wgrad;
  }
}

TEST(Fp8Backward, RejectsMisuse) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 256, 4, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 64, RoutingKind::uniform, 9);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  testing::GpuGrads grads(gpu, testing::random_bf16(host.x.size(), 10), false);
  Workspace ws(s, host.tokens, Config{}, Training::save);  // bf16
  DeviceBuffer<bf16> saved(ws.saved_elements());
  forward(gpu.args(), ws, nullptr, testing::saved_view(saved));
  BackwardArgs b = grads.args();
  b.fp8 = q.dgrad;
  try {
    backward(gpu.args(), b, ws, nullptr, testing::saved_view(saved));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fp8'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("precision is bf16"), std::string::npos) << e.what();
  }
}

TEST(Fp8Backward, RejectsFp8WeightGradientsWithoutTheFp8Dgrad) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 256, 4, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 64, RoutingKind::uniform, 9);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  testing::GpuGrads grads(gpu, testing::random_bf16(host.x.size(), 10), false);
  Workspace ws(s, host.tokens, fp8_config(), Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  forward(fp8_args(gpu, q), ws, nullptr, testing::saved_view(saved));
  BackwardArgs b = grads.args();
  b.fp8_weight_gradients = true;  // (no b.fp8)
  try {
    backward(fp8_args(gpu, q), b, ws, nullptr, testing::saved_view(saved));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fp8_weight_gradients'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mok
