// The FP8 forward (Precision::fp8) against the fp64 reference of its recipe
// (reference::forward_fp8: the same quantized operands, exact sums) and against the exact
// layer, on fresh random inputs with the output poisoned first; then bitwise determinism
// across runs and SM counts, one workspace for several token counts, bad routing, and
// CUDA-graph replay. (Its argument errors: test_validate.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "gpu_fp8.hpp"
#include "gpu_grads.hpp"
#include "gpu_problem.hpp"
#include "kernels/forward/forward.cuh"
#include "mok/backward.hpp"
#include "mok/error.hpp"
#include "mok/forward.hpp"
#include "mok/fp8.hpp"

namespace mok {
namespace {

using testing::Case;
using testing::cosine;
using testing::DeviceBuffer;
using testing::fp8_args;
using testing::fp8_config;
using testing::QuantizedWeights;
using testing::run_fp8;
using testing::GpuProblem;
using testing::same_bits;
using testing::shape_of;

// y against reference::forward_fp8 (the recipe's operands exactly): what remains is the tensor
// cores' sums inside a scale block (not fp64's), fp32 promotion, the bf16 output, and the
// E4M3 roundings of h that those move across a rounding boundary (one step of E4M3 is
// 6-12 %): measured on an H200, 0.2-0.5 % of y over these cases. A wrong scale, row or
// block is far above 1 %.
constexpr double kVsRecipe = 1e-2;

// One FP8 forward of `host` (output poisoned first) against the recipe and the exact layer.
void expect_matches_the_recipe(const MoeShape& s, const HostProblem& host, const std::string& what) {
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  Workspace ws(s, host.tokens, fp8_config());
  gpu.poison_output();
  forward(fp8_args(gpu, q), ws, nullptr);
  ws.check(nullptr);
  const auto got = gpu.output();
  const auto x = host.reference_x();
  const auto recipe = reference::forward_fp8(s, host.tokens, x, host.reference_routing(), host.reference_weights());
  const auto exact = reference::forward(s, host.tokens, x, host.reference_routing(), host.reference_weights());
  const auto cmp = testing::compare(got, recipe);
  EXPECT_EQ(cmp.non_finite, 0) << what << ": unwritten or non-finite outputs";
  // (kVsRecipe: the recipe's operands exactly, the sums not.)
  EXPECT_LE(cmp.rel_error, kVsRecipe) << what;
  // ... and no further from the exact layer than the recipe itself is.
  const double err_gpu = reference::relative_error(got, exact), err_recipe = reference::relative_error(recipe, exact);
  EXPECT_LE(err_gpu, 1.02 * err_recipe) << what << ": FP8 vs the exact layer, recipe " << err_recipe;
  const double cos_exact = cosine(got, exact);
  EXPECT_GE(cos_exact, 0.995) << what << ": FP8 vs the exact layer (test_fp8.cpp: the recipe's own bar)";
  ::testing::Test::RecordProperty("rel_error_vs_recipe", std::to_string(cmp.rel_error));
  ::testing::Test::RecordProperty("rel_error_vs_exact", std::to_string(err_gpu));
  ::testing::Test::RecordProperty("recipe_rel_error_vs_exact", std::to_string(err_recipe));
  ::testing::Test::RecordProperty("cosine_vs_exact", std::to_string(cos_exact));
}

class Fp8ForwardCases : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8ForwardCases, MatchesTheRecipeReference) {
  MOK_REQUIRE_HOPPER();
  const Case c = GetParam();
  const MoeShape s = shape_of(c);
  for (std::uint64_t seed : {21u, 22u})  // fresh inputs each time
    expect_matches_the_recipe(s, make_problem(s, c.tokens, c.routing, seed * 1000 + c.tokens),
                              std::string(c.name) + " seed " + std::to_string(seed));
}

// Row scales at the recipe's floor, 2^-127 (blocks whose largest |value| is below 1.75 2^-119): a
// stage carries its rows' scales as E8M0 bytes, 0 for this one (a subnormal float). x times 2^-121
// puts every x block there, gate and up times 2^60 put h near 2^-122 (its blocks there too: the
// floor applied by GEMM1's epilogue as by the host), down times 2^100 brings y to about 2^-24: against
// the recipe as above, which byte 0 read as 0 (y = 0) or as any other power of two misses.
TEST(Fp8Forward, SubnormalRowScalesAreReadExactly) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 0, 0, RoutingKind::uniform});
  HostProblem host = make_problem(s, 600, RoutingKind::uniform, 41);
  auto times_2_to = [](std::vector<bf16>& v, int e) {
    for (bf16& b : v) b = bf16::from_float(std::ldexp(b.to_float(), e));
  };
  times_2_to(host.x, -121), times_2_to(host.w_gate, 60), times_2_to(host.w_up, 60), times_2_to(host.w_down, 100);
  expect_matches_the_recipe(s, host, "subnormal row scales");
}

INSTANTIATE_TEST_SUITE_P(
    Fp8Forward, Fp8ForwardCases,
    ::testing::Values(Case{"uniform", 700, 512, 256, 8, 2, 0, 0, RoutingKind::uniform},
                      Case{"skewed", 900, 256, 384, 8, 2, 0, 0, RoutingKind::skewed},
                      Case{"one_expert_k1", 500, 256, 256, 4, 1, 0, 0, RoutingKind::one_expert},
                      Case{"empty_experts", 400, 256, 256, 16, 2, 0, 0, RoutingKind::first_half},
                      Case{"padded", 333, 256, 256, 8, 4, 0, 0, RoutingKind::padded},
                      Case{"ragged_k1", 129, 384, 128, 8, 1, 0, 0, RoutingKind::uniform},
                      Case{"single_expert", 257, 256, 256, 1, 1, 0, 0, RoutingKind::uniform},
                      Case{"single_token", 1, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
                      Case{"shared", 300, 256, 256, 8, 2, 384, 0, RoutingKind::uniform},
                      Case{"shared_padded_clamp", 301, 256, 256, 8, 2, 192, 0.75f, RoutingKind::padded},
                      Case{"clamp", 400, 512, 256, 8, 2, 0, 0.5f, RoutingKind::uniform},
                      Case{"large", 2048, 1024, 512, 16, 4, 0, 0, RoutingKind::uniform}),
    [](const auto& info) { return std::string(info.param.name); });

// Training::save: the FP8 forward saves its GEMM1's pre-activations as the BF16 forward does,
// and the BF16 backward runs on them: every gradient against reference::backward_fp8 with
// bf16 dgrad (the FP8 forward's activations, exact dgrad products), y against the recipe.
TEST(Fp8Forward, TrainingBackwardRunsOnTheFp8Activations) {
  MOK_REQUIRE_HOPPER();
  for (const Case c : {Case{"plain", 500, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
                       Case{"shared_padded_clamp", 301, 256, 256, 8, 2, 128, 0.75f, RoutingKind::padded}}) {
    const MoeShape s = shape_of(c);
    const HostProblem host = make_problem(s, c.tokens, c.routing, 61 + c.tokens);
    GpuProblem gpu(host);
    const QuantizedWeights q(gpu);
    const auto dy = testing::random_bf16(host.x.size(), 7 + c.tokens);
    testing::GpuGrads grads(gpu, dy, false);
    Workspace ws(s, c.tokens, fp8_config(), Training::save);
    DeviceBuffer<bf16> saved(ws.saved_elements());
    gpu.poison_output();
    forward(fp8_args(gpu, q), ws, nullptr, testing::saved_view(saved));
    grads.poison();
    backward(fp8_args(gpu, q), grads.args(), ws, nullptr, testing::saved_view(saved));  // (fp8 ignored)
    ws.check(nullptr);
    const auto x = host.reference_x();
    const auto y_want = reference::forward_fp8(s, c.tokens, x, host.reference_routing(), host.reference_weights());
    EXPECT_LE(testing::compare(gpu.output(), y_want).rel_error, kVsRecipe) << c.name;
    const auto ref = reference::backward_fp8(s, c.tokens, x, host.reference_routing(), host.reference_weights(),
                                             reference::to_double(dy), /*fp8_dgrad=*/false);
    testing::expect_gradients(ref, grads, c.name);
  }
}

TEST(Fp8Forward, BitwiseEqualAcrossRunsAndSmCounts) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 384, 8, 2, 256, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 1500, RoutingKind::skewed, 31);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  std::vector<std::vector<bf16>> runs;
  for (int sms : {0, 0, 7, 61}) {
    Workspace ws(s, host.tokens, fp8_config(sms));
    runs.push_back(run_fp8(gpu, q, ws));
  }
  for (std::size_t i = 1; i < runs.size(); ++i) EXPECT_TRUE(same_bits(runs[0], runs[i])) << "run " << i;
}

// The FP8 forward kernels with and without the producer's task notes (kernels::forward_task_notes())
// give the same bits, at several SM counts.
TEST(Fp8Forward, TaskNotesAndTheConsumersOwnDecodeGiveTheSameBits) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 384, 8, 2, 256, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 1500, RoutingKind::skewed, 37);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  struct Restore {
    ~Restore() { kernels::set_forward_task_notes(kernels::TaskNotes::by_shape); }
  } restore;
  kernels::set_forward_task_notes(kernels::TaskNotes::on);
  if (!kernels::forward_task_notes(kernels::ForwardParams{})) GTEST_SKIP() << "a MOK_DIAG_TASK_DECODE build: every launch decodes";
  std::vector<bf16> first;
  for (const auto mode : {kernels::TaskNotes::off, kernels::TaskNotes::on})
    for (int sms : {0, 7, 61}) {
      kernels::set_forward_task_notes(mode);
      Workspace ws(s, host.tokens, fp8_config(sms));
      const auto y = run_fp8(gpu, q, ws);
      if (first.empty()) first = y;
      else EXPECT_TRUE(same_bits(y, first)) << (mode == kernels::TaskNotes::on ? "notes, " : "decode, ") << sms << " SMs";
    }
}

// Issue 19's accuracy table: y and every gradient of one training step against the exact
// fp64 layer, as cosines, for the FP8 path with the bf16 dgrad (the FP8 forward's activations),
// with the FP8 dgrad (BackwardArgs::fp8), with the FP8 dgrad and FP8 weight gradients
// (BackwardArgs::fp8_weight_gradients), and for the BF16 path on the same problem (recorded as
// gtest properties; scripts/gpu_check.sh keeps the XML). Asserted: each FP8 path is finite and
// near the exact layer (cosine >= 0.99; the recipe's own error bounds it lower than the BF16
// path's, docs/fp8.md), the BF16 path's cosines at least each FP8 path's.
TEST(Fp8Forward, AccuracyAgainstTheExactLayerBesideBf16) {
  MOK_REQUIRE_HOPPER();
  const Case c{"h1024_i512", 256, 1024, 512, 8, 4, 256, 0, RoutingKind::uniform};
  const MoeShape s = shape_of(c);
  const HostProblem host = make_problem(s, c.tokens, c.routing, 91);
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  const auto dy = testing::random_bf16(host.x.size(), 92);
  const auto x = host.reference_x();
  const auto y_exact = reference::forward(s, c.tokens, x, host.reference_routing(), host.reference_weights());
  const auto exact = reference::backward(s, c.tokens, x, host.reference_routing(), host.reference_weights(),
                                         reference::to_double(dy));
  const char* names[] = {"y", "dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down", "d_shared_gate", "d_shared_up",
                         "d_shared_down"};
  const std::vector<const std::vector<double>*> want{&y_exact, &exact.x, &exact.topk_weights, &exact.w.gate, &exact.w.up,
                                                     &exact.w.down, &exact.w.shared_gate, &exact.w.shared_up,
                                                     &exact.w.shared_down};
  const char* paths[] = {"fp8_cosine_", "fp8_dgrad_cosine_", "fp8_wgrad_cosine_", "bf16_cosine_"};
  constexpr int kBf16 = 3;
  std::vector<double> cos[4];  // [fp8 with bf16 dgrad, fp8 dgrad, fp8 dgrad and weight gradients, bf16][tensor]
  for (int path = 0; path < 4; ++path) {
    testing::GpuGrads grads(gpu, dy, false);
    Config config;
    if (path < kBf16) config = fp8_config();
    Workspace ws(s, c.tokens, config, Training::save);
    DeviceBuffer<bf16> saved(ws.saved_elements());
    const ForwardArgs args = path < kBf16 ? fp8_args(gpu, q) : gpu.args();
    BackwardArgs b = grads.args();
    if (path == 1 || path == 2) b.fp8 = q.dgrad;
    b.fp8_weight_gradients = path == 2;
    gpu.poison_output();
    forward(args, ws, nullptr, testing::saved_view(saved));
    grads.poison();
    backward(args, b, ws, nullptr, testing::saved_view(saved));
    ws.check(nullptr);
    const std::vector<std::vector<double>> got{
        gpu.output(),
        reference::to_double(grads.dx.download()),
        reference::to_double(grads.d_weights.download()),
        testing::GpuGrads::as_double(grads.d_gate, grads.f32),
        testing::GpuGrads::as_double(grads.d_up, grads.f32),
        testing::GpuGrads::as_double(grads.d_down, grads.f32),
        testing::GpuGrads::as_double(grads.d_sgate, grads.f32),
        testing::GpuGrads::as_double(grads.d_sup, grads.f32),
        testing::GpuGrads::as_double(grads.d_sdown, grads.f32)};
    for (std::size_t i = 0; i < got.size(); ++i) {
      cos[path].push_back(cosine(got[i], *want[i]));
      RecordProperty(std::string(paths[path]) + names[i], std::to_string(cos[path][i]));
    }
  }
  for (std::size_t i = 0; i < cos[0].size(); ++i)
    for (int path = 0; path < kBf16; ++path) {
      EXPECT_GE(cos[path][i], 0.99) << names[i] << ": " << paths[path] << " against the exact layer";
      EXPECT_GE(cos[kBf16][i], cos[path][i]) << names[i] << ": the BF16 path less accurate than " << paths[path];
    }
  // Issue 19's bars for the FP8 weight gradients (y and dx >= 0.999 are the forward's and the
  // dgrad's, measured above): every weight gradient >= 0.995.
  for (std::size_t i : {3, 4, 5}) EXPECT_GE(cos[2][i], 0.995) << names[i] << ": FP8 weight gradients";
}

TEST(Fp8Forward, OneWorkspaceServesEveryTokenCountBitwise) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 256, 8, 2, 128, 0, RoutingKind::uniform});
  Workspace big(s, 1000, fp8_config());
  for (std::int64_t T : {1000, 1, 333}) {
    const HostProblem host = make_problem(s, T, RoutingKind::uniform, 40 + T);
    GpuProblem gpu(host);
    const QuantizedWeights q(gpu);
    Workspace own(s, T, fp8_config());
    const auto want = run_fp8(gpu, q, own);
    EXPECT_TRUE(same_bits(run_fp8(gpu, q, big), want)) << "T = " << T;
  }
}

TEST(Fp8Forward, BadExpertIdPoisonsOutputAndIsReported) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 128, 8, 2, 0, 0, RoutingKind::uniform});
  HostProblem host = make_problem(s, 100, RoutingKind::uniform, 5);
  host.topk_ids[2 * 42 + 1] = 8;
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  Workspace ws(s, host.tokens, fp8_config());
  forward(fp8_args(gpu, q), ws, nullptr);
  try {
    ws.check(nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("got 8 at rank 0, token 42, slot 1"), std::string::npos) << e.what();
  }
  for (double v : gpu.output()) ASSERT_TRUE(std::isnan(v)) << "a bad plan must not leave a plausible y";
}

TEST(Fp8Forward, GraphReplayWithNewRouting) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 256, 8, 2, 128, 0, RoutingKind::uniform});
  const HostProblem first = make_problem(s, 600, RoutingKind::uniform, 51);
  GpuProblem gpu(first);
  const QuantizedWeights q(gpu);
  Workspace ws(s, first.tokens, fp8_config());
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreate(&stream));
  forward(fp8_args(gpu, q), ws, stream);  // (the workspace allocates its scratch outside the capture)
  ws.check(stream);
  const testing::CapturedGraph graph(stream, [&] { forward(fp8_args(gpu, q), ws, stream); });
  MOK_CUDA_OK(graph.error());
  for (std::uint64_t seed : {52u, 53u}) {
    const HostProblem next = testing::same_experts(first, RoutingKind::skewed, seed);
    gpu.x.upload(next.x, stream);
    gpu.ids.upload(next.topk_ids, stream);
    gpu.weights.upload(next.topk_weights, stream);
    gpu.poison_output(stream);
    MOK_CUDA_OK(graph.launch(stream));
    ws.check(stream);
    const auto want = reference::forward_fp8(s, next.tokens, next.reference_x(), next.reference_routing(),
                                             next.reference_weights());
    const auto cmp = testing::compare(gpu.output(), want);
    EXPECT_EQ(cmp.non_finite, 0);
    EXPECT_LE(cmp.rel_error, kVsRecipe) << "seed " << seed;
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace mok
