// The fused forward against the fp64 CPU reference, on fresh random inputs with the
// output poisoned first; then bitwise determinism, SM-count independence, bad input,
// and CUDA-graph replay.
#include <gtest/gtest.h>

#include <cstring>

#include "gpu_problem.hpp"
#include "kernels/forward/forward.cuh"
#include "mok/error.hpp"
#include "mok/forward.hpp"

namespace mok {
namespace {

using testing::Case;
using testing::GpuProblem;
using testing::same_bits;
using testing::shape_of;

class ForwardCases : public ::testing::TestWithParam<Case> {};

TEST_P(ForwardCases, MatchesReference) {
  MOK_REQUIRE_HOPPER();
  const Case c = GetParam();
  const MoeShape s = shape_of(c);
  for (std::uint64_t seed : {11u, 12u}) {  // fresh inputs each time
    const HostProblem host = make_problem(s, c.tokens, c.routing, seed * 1000 + c.tokens);
    GpuProblem gpu(host);
    Workspace ws(s, c.tokens);
    gpu.poison_output();
    forward(gpu.args(), ws, nullptr);
    ws.check(nullptr);
    const auto ref = reference::forward(s, c.tokens, host.reference_x(), host.reference_routing(), host.reference_weights());
    const auto cmp = testing::compare(gpu.output(), ref);
    EXPECT_EQ(cmp.non_finite, 0) << "unwritten or non-finite outputs";
    EXPECT_LE(cmp.rel_error, 1e-2) << c.name << " seed " << seed;
    RecordProperty("rel_error", std::to_string(cmp.rel_error));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Forward, ForwardCases,
    ::testing::ValuesIn(testing::routing_cases({
        Case{"uniform_large", 2048, 1024, 512, 16, 4, 0, 0, RoutingKind::uniform},
        Case{"one_expert_k3", 300, 256, 128, 4, 3, 0, 0, RoutingKind::one_expert},
        Case{"single_token", 1, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
        Case{"partial_tiles", 250, 320, 192, 4, 2, 0, 0, RoutingKind::uniform},
        Case{"shared_single_token", 1, 256, 128, 4, 2, 256, 1.0f, RoutingKind::uniform}})),
    [](const auto& info) { return std::string(info.param.name); });

std::vector<bf16> run_once(const HostProblem& host, GpuProblem& gpu, int sms, std::int64_t interleave_rows = 0) {
  Config config;
  config.compute_sms = sms;
  config.interleave_rows = interleave_rows;
  Workspace ws(host.shape, host.tokens, config);
  gpu.poison_output();
  forward(gpu.args(), ws, nullptr);
  ws.check(nullptr);
  return gpu.y.download();
}


TEST(Forward, BitwiseEqualAcrossRunsAndSmCounts) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 1024, 512, 16, 4, 256, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 1500, RoutingKind::skewed, 99);
  GpuProblem gpu(host);
  const auto first = run_once(host, gpu, 0);
  Workspace ws(s, host.tokens);
  for (int run = 0; run < 20; ++run) {
    gpu.poison_output();
    forward(gpu.args(), ws, nullptr);
    ws.check(nullptr);
    ASSERT_TRUE(same_bits(gpu.y.download(), first)) << "run " << run;
  }
  for (int sms : {1, 7, 37, 100}) EXPECT_TRUE(same_bits(run_once(host, gpu, sms), first)) << sms << " SMs";
  // Config::interleave_rows reorders the tasks (GEMM2 of a chunk after GEMM1 of the next): the same bits
  for (std::int64_t rows : {128, 384, 1 << 20})
    for (int sms : {0, 9}) EXPECT_TRUE(same_bits(run_once(host, gpu, sms, rows), first)) << "interleave " << rows;
}

// The forward kernels with and without the producer's task notes (kernels::forward_task_notes(): by
// shape, notes up to hidden 4096 and intermediate 1024, so the test shapes run the notes; the decode
// otherwise) give the same bits: runs, SM counts, the interleaved order, a shared expert.
TEST(Forward, TaskNotesAndTheConsumersOwnDecodeGiveTheSameBits) {
  struct Restore {
    ~Restore() { kernels::set_forward_task_notes(kernels::TaskNotes::by_shape); }
  } restore;
  kernels::set_forward_task_notes(kernels::TaskNotes::on);
  if (!kernels::forward_task_notes(kernels::ForwardParams{})) GTEST_SKIP() << "a MOK_DIAG_TASK_DECODE build: every launch decodes";
  kernels::set_forward_task_notes(kernels::TaskNotes::by_shape);
  kernels::ForwardParams rule{};
  rule.hidden = kernels::kTaskNotesMaxHidden;
  rule.inter = kernels::kTaskNotesMaxInter;
  EXPECT_TRUE(kernels::forward_task_notes(rule));  // (qwen3.5-397b)
  rule.hidden = 2048;
  rule.inter = 768;  // (qwen3-30b-a3b; olmoe-1b-7b at 2048 / 1024)
  EXPECT_TRUE(kernels::forward_task_notes(rule));
  rule.hidden = kernels::kTaskNotesMaxHidden + 64;
  rule.inter = kernels::kTaskNotesMaxInter;
  EXPECT_FALSE(kernels::forward_task_notes(rule));  // (just past either bound)
  rule.hidden = kernels::kTaskNotesMaxHidden;
  rule.inter = kernels::kTaskNotesMaxInter + 64;
  EXPECT_FALSE(kernels::forward_task_notes(rule));
  rule.hidden = 7168;
  rule.inter = 2048;  // (deepseek-v3, kimi-k2: the notes measured slower there)
  EXPECT_FALSE(kernels::forward_task_notes(rule));
  rule.hidden = rule.inter = 2880;  // (gpt-oss-120b: likewise)
  EXPECT_FALSE(kernels::forward_task_notes(rule));
  rule.hidden = 4096;
  rule.inter = 14336;  // (mixtral-8x7b: level)
  EXPECT_FALSE(kernels::forward_task_notes(rule));
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 1024, 512, 16, 4, 256, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 1500, RoutingKind::skewed, 5);
  GpuProblem gpu(host);
  kernels::set_forward_task_notes(kernels::TaskNotes::off);
  const auto decoded = run_once(host, gpu, 0);
  const auto ref = reference::forward(s, host.tokens, host.reference_x(), host.reference_routing(), host.reference_weights());
  const auto cmp = testing::compare(gpu.output(), ref);
  EXPECT_EQ(cmp.non_finite, 0);
  EXPECT_LE(cmp.rel_error, 1e-2);
  for (const auto mode : {kernels::TaskNotes::on, kernels::TaskNotes::off}) {
    kernels::set_forward_task_notes(mode);
    for (int sms : {0, 7, 61}) EXPECT_TRUE(same_bits(run_once(host, gpu, sms), decoded)) << sms << " SMs";
    for (std::int64_t rows : {128, 384}) EXPECT_TRUE(same_bits(run_once(host, gpu, 9, rows), decoded)) << "interleave " << rows;
  }
}

// On one GPU the routed x rows lie under the bf16 slot rows, each under its own
// (Workspace::rows_in_slots): GEMM2 tile (m, n) overwrites the x rows of M-tile m, while GEMM1
// tiles of M-tile m on other CTAs may still be reading them: the kernel must order them (its
// wait for M-tile m's h covers it; the result matches the reference and does not depend on
// the SM count).
TEST(Forward, SlotRowsOverwriteRoutedRowsOnlyAfterGemm1HasReadThem) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 1024, 256, 2, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 2048, RoutingKind::uniform, 2024);
  GpuProblem gpu(host);
  EXPECT_TRUE(Workspace(s, host.tokens).rows_in_slots());
  const auto first = run_once(host, gpu, 0);
  const auto ref = reference::forward(s, host.tokens, host.reference_x(), host.reference_routing(), host.reference_weights());
  const auto cmp = testing::compare(gpu.output(), ref);
  EXPECT_EQ(cmp.non_finite, 0);
  EXPECT_LE(cmp.rel_error, 1e-2);
  for (int sms : {2, 9, 33, 132}) EXPECT_TRUE(same_bits(run_once(host, gpu, sms), first)) << sms << " SMs";
  for (int sms : {2, 33, 132})  // interleaved: a GEMM2 tile still waits for the x rows under its slots
    EXPECT_TRUE(same_bits(run_once(host, gpu, sms, 256), first)) << sms << " SMs, interleave 256";
}

TEST(Forward, BadExpertIdPoisonsOutputAndIsReported) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 128, 8, 2, 0, 0, RoutingKind::uniform});
  HostProblem host = make_problem(s, 100, RoutingKind::uniform, 5);
  host.topk_ids[2 * 42 + 1] = 8;
  GpuProblem gpu(host);
  Workspace ws(s, host.tokens);
  forward(gpu.args(), ws, nullptr);
  try {
    ws.check(nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("got 8 at rank 0, token 42, slot 1"), std::string::npos) << e.what();
  }
  for (bf16 v : gpu.y.download()) ASSERT_TRUE(std::isnan(v.to_float()));
  // The workspace is usable again with good input.
  host.topk_ids[2 * 42 + 1] = 3;
  GpuProblem good(host);
  forward(good.args(), ws, nullptr);
  EXPECT_NO_THROW(ws.check(nullptr));
}

TEST(Forward, MoreTokensThanTheWorkspaceIsAnError) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 128, 8, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 100, RoutingKind::uniform, 5);
  GpuProblem gpu(host);
  Workspace ws(s, 99);
  try {
    forward(gpu.args(), ws, nullptr);
    FAIL() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'x': has 100 tokens, more than the workspace's max_tokens = 99"),
              std::string::npos) << e.what();
  }
}

// A workspace serves every T up to its max_tokens: each call plans T tokens into its first
// rows and counters. Its results are bitwise those of a workspace made for exactly T, in any
// order of token counts (a small T after a large one finds no stale plan or counter).
TEST(Forward, OneWorkspaceServesEveryTokenCountBitwise) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 256, 0.8f, RoutingKind::uniform});
  Workspace big(s, 1500);
  for (std::int64_t T : {1500, 1, 700, 128, 129, 1499, 3}) {
    const HostProblem host = make_problem(s, T, RoutingKind::skewed, 500 + T);
    GpuProblem gpu(host);
    const auto exact = run_once(host, gpu, 0);
    gpu.poison_output();
    forward(gpu.args(), big, nullptr);
    big.check(nullptr);
    EXPECT_TRUE(same_bits(gpu.y.download(), exact)) << "T = " << T;
  }
}

// Config::replay_launches: a call seen before is captured into a graph on its second call and
// replayed from it after that. Every call gives the bits of a workspace that launches directly;
// a call with other buffers or another T is not served by another call's graph, and a replay
// reads the values its buffers hold when it runs.
TEST(Forward, ReplayedLaunchesGiveTheBitsOfDirectOnes) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 128, 0, RoutingKind::uniform});
  Config direct_config;
  direct_config.replay_launches = false;
  Workspace direct(s, 700, direct_config), replaying(s, 700);
  for (std::int64_t T : {700, 300}) {
    const HostProblem host = make_problem(s, T, RoutingKind::skewed, 40 + T);
    GpuProblem a(host), b(host);  // the same values in two sets of buffers
    forward(a.args(), direct, nullptr);
    direct.check(nullptr);
    const auto expected = a.y.download();
    for (int call = 0; call < 4; ++call)
      for (GpuProblem* g : {&a, &b}) {
        g->poison_output();
        forward(g->args(), replaying, nullptr);
        replaying.check(nullptr);
        EXPECT_TRUE(same_bits(g->y.download(), expected)) << "T = " << T << ", call " << call;
      }
    // New routing and activations in a's buffers: the replay runs on them.
    const HostProblem next = testing::same_experts(host, RoutingKind::first_half, 90 + T);
    a.x.upload(next.x);
    a.ids.upload(next.topk_ids);
    a.weights.upload(next.topk_weights);
    a.poison_output();
    forward(a.args(), direct, nullptr);
    direct.check(nullptr);
    const auto expected_next = a.y.download();
    a.poison_output();
    forward(a.args(), replaying, nullptr);
    replaying.check(nullptr);
    EXPECT_TRUE(same_bits(a.y.download(), expected_next)) << "T = " << T << ", new values";
  }
  EXPECT_EQ(replaying.captured_calls(), 4);   // (a, b) x two token counts, each at its second call
  EXPECT_EQ(replaying.replayed_calls(), 10);  // calls 3 and 4 of each, and the new values' calls
  EXPECT_EQ(direct.replayed_calls(), 0);
  EXPECT_EQ(direct.captured_calls(), 0);
}

// The forward in two enqueues (forward_rows, then forward with rows_enqueued, as the PyTorch
// op's eager path calls it): the bits of one forward() call, launched, captured and replayed.
// A forward that names other rows than the last forward_rows(), or follows another call on the
// workspace, is refused, and so is a forward_rows() with a bad x.
TEST(Forward, RowsEnqueuedFirstGiveTheBitsOfOneCall) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 128, 0.8f, RoutingKind::uniform});
  Workspace one(s, 700), two(s, 700);
  for (std::int64_t T : {700, 129}) {
    const HostProblem host = make_problem(s, T, RoutingKind::skewed, 60 + T);
    GpuProblem g(host);
    forward(g.args(), one, nullptr);
    one.check(nullptr);
    const auto expected = g.y.download();
    for (int call = 0; call < 3; ++call) {  // launched, captured, replayed
      g.poison_output();
      forward_rows(g.args().x, g.args().topk_ids, two, nullptr);
      forward(g.args(), two, nullptr, std::nullopt, std::nullopt, true);
      two.check(nullptr);
      EXPECT_TRUE(same_bits(g.y.download(), expected)) << "T = " << T << ", call " << call;
    }
  }
  EXPECT_EQ(two.captured_calls(), 4);  // (rows, rest) x two token counts
  EXPECT_EQ(two.replayed_calls(), 4);

  const HostProblem host = make_problem(s, 300, RoutingKind::uniform, 7);
  GpuProblem a(host), b(host);
  const auto refused = [&](const ForwardArgs& args, const char* text) {
    try {
      forward(args, two, nullptr, std::nullopt, std::nullopt, true);
      ADD_FAILURE() << "no error (" << text << ")";
    } catch (const ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  refused(a.args(), "forward_rows() was not called on this workspace just before");  // (the last call: a forward)
  forward_rows(a.args().x, a.args().topk_ids, two, nullptr);
  refused(b.args(), "was for other x, topk_ids, scratch or stream");
  forward_rows(a.args().x, a.args().topk_ids, two, nullptr);
  forward(a.args(), two, nullptr);  // a call in between forgets the rows
  refused(a.args(), "forward_rows() was not called on this workspace just before");
  TensorView short_ids = a.args().topk_ids;
  short_ids.shape[0] = 299;
  try {
    forward_rows(a.args().x, short_ids, two, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'topk_ids': must have 300 rows like 'x', got 299"), std::string::npos)
        << e.what();
  }
  two.check(nullptr);
}

// Captured once; replayed with new routing and new activations written into the same buffers.
TEST(Forward, GraphReplayWithNewRouting) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 128, 0, RoutingKind::uniform});
  const std::int64_t T = 640;
  const HostProblem first = make_problem(s, T, RoutingKind::uniform, 1);
  GpuProblem gpu(first);
  Workspace ws(s, T);
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  forward(gpu.args(), ws, stream);  // warm-up outside capture (kernel attributes)
  ws.check(stream);
  const testing::CapturedGraph graph(stream, [&] { forward(gpu.args(), ws, stream); });
  MOK_CUDA_OK(graph.error());
  for (RoutingKind kind : {RoutingKind::skewed, RoutingKind::padded, RoutingKind::first_half}) {
    const HostProblem next = testing::same_experts(first, kind, 7 + static_cast<int>(kind));
    gpu.x.upload(next.x, stream);
    gpu.ids.upload(next.topk_ids, stream);
    gpu.weights.upload(next.topk_weights, stream);
    gpu.poison_output(stream);
    MOK_CUDA_OK(graph.launch(stream));
    ws.check(stream);
    const auto ref = reference::forward(s, T, next.reference_x(), next.reference_routing(), next.reference_weights());
    const auto cmp = testing::compare(gpu.output(), ref);
    EXPECT_EQ(cmp.non_finite, 0);
    EXPECT_LE(cmp.rel_error, 1e-2) << routing_kind_name(kind);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace mok
