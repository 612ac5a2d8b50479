// The fused backward against the fp64 CPU reference (every gradient: relative error and
// cosine similarity), with outputs poisoned first; then bitwise determinism across runs,
// SM counts and the save / recompute modes, f32 accumulation, bad input, and a CUDA graph
// of forward + backward replayed with new routing and data.
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <cstring>
#include <random>

#include "gpu_grads.hpp"
#include "gpu_problem.hpp"
#include "mok/backward.hpp"
#include "mok/error.hpp"
#include "mok/forward.hpp"
#include "host/layer_launch.hpp"

namespace mok {
namespace {

using testing::DeviceBuffer;
using testing::Case;
using testing::GpuProblem;
using testing::shape_of;
using testing::GpuGrads;
using testing::expect_close;
using testing::random_bf16;
using testing::check_gradients;
using testing::saved_view;

// One training call in either mode: the forward into `saved` (Training::save; a recompute saves
// nothing and its backward runs GEMM1 again), poisoned gradients, the backward, the status check.
void train_call(const GpuProblem& gpu, GpuGrads& grads, Workspace& ws, Training mode, const DeviceBuffer<bf16>& saved) {
  if (mode == Training::save) forward(gpu.args(), ws, nullptr, saved_view(saved));
  grads.poison();
  if (mode == Training::save) backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved));
  else backward(gpu.args(), grads.args(), ws, nullptr);
  ws.check(nullptr);
}

class BackwardCases : public ::testing::TestWithParam<Case> {};

TEST_P(BackwardCases, MatchesReference) {
  MOK_REQUIRE_HOPPER();
  const Case c = GetParam();
  const MoeShape s = shape_of(c);
  const HostProblem host = make_problem(s, c.tokens, c.routing, 77 + c.tokens);
  GpuProblem gpu(host);
  const auto dy = random_bf16(host.x.size(), 5 + c.tokens);
  GpuGrads grads(gpu, dy, false);
  Workspace ws(s, c.tokens, {}, Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  forward(gpu.args(), ws, nullptr, saved_view(saved));
  grads.poison();
  backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved));
  ws.check(nullptr);
  check_gradients(host, grads, dy, c.name);
}

INSTANTIATE_TEST_SUITE_P(
    Backward, BackwardCases,
    ::testing::ValuesIn(testing::routing_cases({
        // T = 1 with k = 8: d_topk_weights of one token with k = 2 is two numbers, and their
        // relative error (bf16-saved activations: ~0.3% of a typical value) measures
        // whether one of them happens to be near zero rather than the kernel.
        Case{"single_token", 1, 256, 256, 8, 8, 0, 0, RoutingKind::uniform},
        Case{"shared_single_token", 1, 256, 128, 4, 4, 256, 1.0f, RoutingKind::uniform}})),
    [](const auto& info) { return std::string(info.param.name); });

// The same call under every configuration that must not change a bit: 20 repeats, SM
// counts, recompute instead of save.
TEST(Backward, BitwiseEqualAcrossRunsSmCountsAndModes) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 256, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 900, RoutingKind::skewed, 31);
  GpuProblem gpu(host);
  const auto dy = random_bf16(host.x.size(), 32);
  GpuGrads grads(gpu, dy, false);
  auto run = [&](int sms, Training mode, int repeats, bool replay = true) {
    Config config;
    config.compute_sms = sms;
    config.replay_launches = replay;
    Workspace ws(s, host.tokens, config, mode);
    DeviceBuffer<bf16> saved(mode == Training::save ? ws.saved_elements() : 0);
    std::vector<std::uint8_t> first;
    for (int r = 0; r < repeats; ++r) {
      train_call(gpu, grads, ws, mode, saved);
      auto bytes = grads.snapshot();
      if (r == 0) first = bytes;
      else EXPECT_TRUE(bytes == first) << "repeat " << r << " differs";
    }
    // (Config::replay_launches: the forward's and the backward's calls after their second are
    // replays of the graph captured at the second; the first is launched directly.)
    const int passes = mode == Training::save ? 2 : 1;
    EXPECT_EQ(ws.replayed_calls(), replay ? passes * std::max(0, repeats - 2) : 0);
    return first;
  };
  const auto reference_bytes = run(0, Training::save, 20);
  check_gradients(host, grads, dy, "determinism");
  for (int sms : {1, 7, 37, 100}) EXPECT_TRUE(run(sms, Training::save, 1) == reference_bytes) << sms << " SMs";
  EXPECT_TRUE(run(0, Training::recompute, 2) == reference_bytes) << "recompute mode";
  EXPECT_TRUE(run(0, Training::recompute, 4) == reference_bytes) << "recompute mode, replayed";
  EXPECT_TRUE(run(0, Training::save, 3, false) == reference_bytes) << "launched directly every call";
}

TEST(Backward, AccumulatesIntoF32Gradients) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 192, 4, 2, 128, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 300, RoutingKind::first_half, 41);
  GpuProblem gpu(host);
  const auto dy = random_bf16(host.x.size(), 42);
  GpuGrads grads(gpu, dy, true);
  // Start every f32 gradient from a known value.
  std::vector<std::vector<double>> base;
  std::uint64_t seed = 50;
  for (auto* b : {&grads.d_gate, &grads.d_up, &grads.d_down, &grads.d_sgate, &grads.d_sup, &grads.d_sdown}) {
    std::vector<float> init(b->size() / 4);
    std::mt19937_64 rng(seed++);
    std::normal_distribution<float> dist(0.0f, 0.01f);
    for (auto& v : init) v = dist(rng);
    if (!init.empty()) cudaMemcpy(b->get(), init.data(), b->size(), cudaMemcpyHostToDevice);
    base.emplace_back(init.begin(), init.end());
  }
  Workspace ws(s, host.tokens, {}, Training::recompute);
  backward(gpu.args(), grads.args(), ws, nullptr);
  ws.check(nullptr);
  check_gradients(host, grads, dy, "f32", base);
}

TEST(Backward, RejectsMisuse) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 128, 8, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 100, RoutingKind::uniform, 5);
  GpuProblem gpu(host);
  GpuGrads grads(gpu, random_bf16(host.x.size(), 6), false);
  Workspace inference(s, host.tokens);
  EXPECT_THROW(backward(gpu.args(), grads.args(), inference, nullptr), Error);
  Workspace save(s, host.tokens, {}, Training::save);
  EXPECT_THROW(backward(gpu.args(), grads.args(), save, nullptr), Error);  // saved tensor missing
  DeviceBuffer<bf16> small(save.saved_elements() - 1);
  EXPECT_THROW(forward(gpu.args(), save, nullptr, saved_view(small)), Error);
  DeviceBuffer<bf16> roomy(save.saved_elements() + 8);  // (its data from the second element on: 2 bytes off)
  const TensorView misaligned =
      TensorView::contiguous(roomy.get() + 1, DType::bf16, Device::cuda(0), {save.saved_elements()});
  try {
    backward(gpu.args(), grads.args(), save, nullptr, misaligned);
    ADD_FAILURE() << "a misaligned saved tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'saved': data pointer must be 16-byte aligned"), std::string::npos)
        << e.what();
  }

  // With a shared expert dx must not overlap x or dy: its tasks read them while dx is written.
  const MoeShape ss = shape_of({"", 0, 256, 128, 8, 2, 128, 0, RoutingKind::uniform});
  const HostProblem sh = make_problem(ss, 100, RoutingKind::uniform, 7);
  GpuProblem sgpu(sh);
  GpuGrads sgrads(sgpu, random_bf16(sh.x.size(), 8), false);
  Workspace sws(ss, sh.tokens, {}, Training::save);
  DeviceBuffer<bf16> saved(sws.saved_elements());
  for (const char* over : {"x", "dy"}) {
    forward(sgpu.args(), sws, nullptr, saved_view(saved));
    BackwardArgs b = sgrads.args();
    b.dx.data = over[0] == 'x' ? sgpu.args().x.data : b.dy.data;
    try {
      backward(sgpu.args(), b, sws, nullptr, saved_view(saved));
      ADD_FAILURE() << "dx over " << over << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("argument 'dx': must not overlap '") + over + "'"), std::string::npos)
          << e.what();
    }
  }
}

// The backward overwrites the saved pre-activations with their gradients: a second
// backward from the same saved tensor (or one no forward filled) must fail loudly.
TEST(Backward, ConsumedSavedTensorIsAnError) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 128, 8, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 100, RoutingKind::uniform, 5);
  GpuProblem gpu(host);
  const auto dy = random_bf16(host.x.size(), 6);
  GpuGrads grads(gpu, dy, false);
  Workspace ws(s, host.tokens, {}, Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  cudaMemset(saved.get(), 0, saved.size() * 2);
  backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved));  // never filled
  EXPECT_THROW(ws.check(nullptr), Error);
  forward(gpu.args(), ws, nullptr, saved_view(saved));
  backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved));
  EXPECT_NO_THROW(ws.check(nullptr));
  check_gradients(host, grads, dy, "first backward");
  backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved));  // consumed
  try {
    ws.check(nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("consumed"), std::string::npos) << e.what();
  }
  for (bf16 v : grads.dx.download()) ASSERT_TRUE(std::isnan(v.to_float()));
}

TEST(Backward, BadExpertIdPoisonsGradientsAndIsReported) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 128, 8, 2, 0, 0, RoutingKind::uniform});
  HostProblem host = make_problem(s, 100, RoutingKind::uniform, 5);
  host.topk_ids[2 * 17] = 9;
  GpuProblem gpu(host);
  GpuGrads grads(gpu, random_bf16(host.x.size(), 6), false);
  Workspace ws(s, host.tokens, {}, Training::recompute);
  backward(gpu.args(), grads.args(), ws, nullptr);
  EXPECT_THROW(ws.check(nullptr), Error);
  for (bf16 v : grads.dx.download()) ASSERT_TRUE(std::isnan(v.to_float()));
}

TensorView scratch_view(const DeviceBuffer<std::uint8_t>& scratch) {
  return TensorView::contiguous(scratch.get(), DType::u8, Device::cuda(0), {static_cast<std::int64_t>(scratch.size())});
}

// Scratch given per call (exactly the bytes asked for, poisoned first) gives the bits of
// the workspace's own; with bf16 gradients the backward keeps its dy rows and w h in the
// W_gate / W_up gradient buffers where they fit (both, dy rows only, w h only, neither).
TEST(Backward, CallerScratchAndRowsInGradientsMatchOwnScratchBitwise) {
  MOK_REQUIRE_HOPPER();
  struct Fit {
    Case c;
    bool dy_fits, hw_fits;  // capacity <= E I (dy rows in d_w_gate), capacity <= E H (w h in d_w_up)
  };
  for (const Fit& f : {Fit{{"both", 300, 256, 512, 8, 2, 128, 0, RoutingKind::skewed}, true, true},
                       Fit{{"dy_only", 400, 128, 512, 8, 2, 0, 0, RoutingKind::uniform}, true, false},
                       Fit{{"hw_only", 900, 512, 256, 8, 2, 256, 0, RoutingKind::skewed}, false, true},
                       Fit{{"neither", 700, 128, 128, 4, 4, 0, 0, RoutingKind::padded}, false, false}}) {
    SCOPED_TRACE(f.c.name);
    const MoeShape s = shape_of(f.c);
    const HostProblem host = make_problem(s, f.c.tokens, f.c.routing, 60);
    GpuProblem gpu(host);
    const auto dy = random_bf16(host.x.size(), 61);
    GpuGrads grads(gpu, dy, false);
    Workspace ws(s, host.tokens, {}, Training::save);
    const std::int64_t cap = ws.plan().capacity_rows(), E = s.num_experts, H = s.hidden, I = s.intermediate;
    ASSERT_EQ(f.dy_fits, cap <= E * I);
    ASSERT_EQ(f.hw_fits, cap <= E * H);
    const std::int64_t bf16_bytes = ws.backward_scratch_bytes(DType::bf16), f32_bytes = ws.backward_scratch_bytes(DType::f32);
    EXPECT_EQ(f32_bytes - bf16_bytes, (f.dy_fits ? 2 * cap * H : 0) + (f.hw_fits ? 2 * cap * I : 0));
    DeviceBuffer<bf16> saved(ws.saved_elements());
    forward(gpu.args(), ws, nullptr, saved_view(saved));
    grads.poison();
    backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved));
    ws.check(nullptr);
    check_gradients(host, grads, dy, f.c.name);
    const auto own = grads.snapshot();
    const std::int64_t own_bytes = ws.bytes();

    Workspace lean(s, host.tokens, {}, Training::save);
    DeviceBuffer<std::uint8_t> fwd_scratch(lean.forward_scratch_bytes()), bwd_scratch(bf16_bytes);
    cudaMemset(fwd_scratch.get(), 0xff, fwd_scratch.size());
    cudaMemset(bwd_scratch.get(), 0xff, bwd_scratch.size());
    forward(gpu.args(), lean, nullptr, saved_view(saved), scratch_view(fwd_scratch));
    grads.poison();
    backward(gpu.args(), grads.args(), lean, nullptr, saved_view(saved), scratch_view(bwd_scratch));
    lean.check(nullptr);
    EXPECT_TRUE(grads.snapshot() == own) << "caller scratch changed the gradients";
    EXPECT_LT(lean.bytes(), own_bytes) << "given scratch, the workspace allocated its own";

    // Training::recompute keeps its rows in the gradients as save does (its GEMM1 runs before
    // the dy rows are gathered there): the same room saved, the same bits, in a poisoned scratch.
    Workspace rec(s, host.tokens, {}, Training::recompute);
    const std::int64_t rec_bf16 = rec.backward_scratch_bytes(DType::bf16);
    EXPECT_EQ(rec.backward_scratch_bytes(DType::f32) - rec_bf16, f32_bytes - bf16_bytes);
    DeviceBuffer<std::uint8_t> rec_scratch(rec_bf16);
    cudaMemset(rec_scratch.get(), 0xff, rec_scratch.size());
    grads.poison();
    backward(gpu.args(), grads.args(), rec, nullptr, std::nullopt, scratch_view(rec_scratch));
    rec.check(nullptr);
    EXPECT_TRUE(grads.snapshot() == own) << "recompute, rows in the gradients: the gradients differ";
  }
}

TEST(Backward, RejectsBadScratch) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 128, 8, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 100, RoutingKind::uniform, 5);
  GpuProblem gpu(host);
  GpuGrads grads(gpu, random_bf16(host.x.size(), 6), false);
  Workspace ws(s, host.tokens, {}, Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  DeviceBuffer<std::uint8_t> small(ws.forward_scratch_bytes() - 1);
  auto expect_error = [](auto&& call, const char* needle) {
    try {
      call();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { forward(gpu.args(), ws, nullptr, saved_view(saved), scratch_view(small)); }, "scratch");
  const TensorView as_bf16 = TensorView::contiguous(small.get(), DType::bf16, Device::cuda(0), {4});
  expect_error([&] { forward(gpu.args(), ws, nullptr, saved_view(saved), as_bf16); }, "u8");
  forward(gpu.args(), ws, nullptr, saved_view(saved));
  // (the figure of these gradients and dx: two allocations that happen to abut are one block)
  const bool adjacent = grads.d_up.get() == grads.d_gate.get() + grads.d_gate.size();
  DeviceBuffer<std::uint8_t> bwd_small(ws.backward_scratch_bytes(DType::bf16, host.tokens, adjacent, true) - 1);
  expect_error([&] { backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved), scratch_view(bwd_small)); },
               "backward_scratch_bytes");
}

// Where the routed dy rows miss the W_gate / W_up gradient block they continue in dx, which
// only the combine writes, last. The figure with dx apart is smaller; the gradients match the
// reference and are bitwise equal with dx below the block, above it, and in a backward whose dx
// is dy's own storage (dx then holds no rows: they stay in the scratch; no shared expert reads dy).
TEST(Backward, DyRowsContinuedInDxGiveTheBitsOfDyRowsInScratch) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 256, 256, 8, 2, 0, 0, RoutingKind::uniform});
  const HostProblem host = make_problem(s, 2048, RoutingKind::skewed, 71);
  GpuProblem gpu(host);
  const auto dy = random_bf16(host.x.size(), 72);
  GpuGrads grads(gpu, dy, false);
  Workspace ws(s, host.tokens, {}, Training::save);
  const std::int64_t T = host.tokens, H = s.hidden, I = s.intermediate, E = s.num_local_experts;
  const std::int64_t kept = ws.backward_scratch_bytes(DType::bf16, T, true);
  const std::int64_t in_dx = ws.backward_scratch_bytes(DType::bf16, T, true, true);
  ASSERT_LT(in_dx, kept) << "this shape's dy rows were meant to continue in dx";
  DeviceBuffer<bf16> saved(ws.saved_elements());
  // The gradient block and dx in one allocation, either order, 64 rows apart (not abutting).
  const std::int64_t block_elems = 2 * E * I * H, gap = 64 * H;
  DeviceBuffer<bf16> both(block_elems + gap + T * H);
  DeviceBuffer<std::uint8_t> scratch(kept);
  const Device d = Device::cuda(0);
  auto run = [&](bf16* block, bf16* dx, bf16* dy_at, std::int64_t scratch_bytes) {
    forward(gpu.args(), ws, nullptr, saved_view(saved));
    grads.poison();
    cudaMemset(both.get(), 0xff, both.size() * 2);
    if (dy_at != grads.dy.get()) cudaMemcpy(dy_at, grads.dy.get(), T * H * 2, cudaMemcpyDeviceToDevice);
    cudaMemset(scratch.get(), 0xff, scratch.size());
    BackwardArgs b = grads.args();
    b.d_w_gate = TensorView::contiguous(block, DType::bf16, d, {E, I, H});
    b.d_w_up = TensorView::contiguous(block + E * I * H, DType::bf16, d, {E, I, H});
    b.dx = TensorView::contiguous(dx, DType::bf16, d, {T, H});
    b.dy = TensorView::contiguous(dy_at, DType::bf16, d, {T, H});
    backward(gpu.args(), b, ws, nullptr, saved_view(saved),
             TensorView::contiguous(scratch.get(), DType::u8, d, {scratch_bytes}));
    ws.check(nullptr);
    // (into grads' own buffers, for the reference check and the snapshot)
    cudaMemcpy(grads.dx.get(), dx, T * H * 2, cudaMemcpyDeviceToDevice);
    cudaMemcpy(grads.d_gate.get(), block, grads.d_gate.size(), cudaMemcpyDeviceToDevice);
    cudaMemcpy(grads.d_up.get(), block + E * I * H, grads.d_up.size(), cudaMemcpyDeviceToDevice);
    return grads.snapshot();
  };
  bf16* lo = both.get();
  const auto dx_above = run(lo, lo + block_elems + gap, grads.dy.get(), in_dx);
  check_gradients(host, grads, dy, "dy rows continued in dx");
  const auto dx_below = run(lo + T * H + gap, lo, grads.dy.get(), in_dx);
  EXPECT_TRUE(dx_below == dx_above) << "dx below the gradient block changed the gradients";
  const auto aliased = run(lo, lo + block_elems + gap, lo + block_elems + gap, kept);  // dx = dy's storage
  EXPECT_TRUE(aliased == dx_above) << "dy rows in dx changed the gradients";
  // (with dx apart the call needs only the smaller figure; with dx over dy it refuses it)
  try {
    run(lo, lo + block_elems + gap, lo + block_elems + gap, in_dx);
    ADD_FAILURE() << "a backward whose dx holds dy took the smaller scratch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scratch"), std::string::npos) << e.what();
  }
}

// The backward in column blocks (Config::backward_column_blocks: x's rows one block of H's
// columns at a time, a launch each, the counters carried on from launch to launch) gives the
// bits of whole rows, and its scratch is smaller by exactly the x rows' other columns (in
// Training::recompute the same bits at the same scratch, one block by default where I <= H, as here). H = 320:
// a last block of 64 columns, with a shared expert (its dx rows in dx); H = 768: three tiles in
// blocks of two and one, or one each, with the dy rows in the gradients.
TEST(Backward, ColumnBlocksGiveTheBitsOfWholeRows) {
  MOK_REQUIRE_HOPPER();
  for (const Case& c : {Case{"h320_shared", 500, 320, 256, 8, 2, 128, 0, RoutingKind::skewed},
                        Case{"h768", 700, 768, 128, 8, 2, 0, 0, RoutingKind::padded}}) {
    SCOPED_TRACE(c.name);
    const MoeShape s = shape_of(c);
    const HostProblem host = make_problem(s, c.tokens, c.routing, 91);
    GpuProblem gpu(host);
    const auto dy = random_bf16(host.x.size(), 92);
    GpuGrads grads(gpu, dy, false);
    const std::int64_t H = s.hidden;
    // (calls > 2: the later ones replay the launches captured at the second, Config::replay_launches;
    // each call's gradients must be the first's)
    auto run = [&](int blocks, std::int64_t& scratch_bytes, std::int64_t& capacity, Training mode = Training::save,
                   int calls = 1) {
      Config config;
      config.backward_column_blocks = blocks;
      Workspace ws(s, host.tokens, config, mode);
      DeviceBuffer<bf16> saved(mode == Training::save ? ws.saved_elements() : 0);
      std::vector<std::uint8_t> first;
      for (int call = 0; call < calls; ++call) {
        train_call(gpu, grads, ws, mode, saved);
        if (call == 0) first = grads.snapshot();
        else EXPECT_TRUE(grads.snapshot() == first) << blocks << " blocks, call " << call << " differs from the first";
      }
      // (the blocks this workspace runs: whole 256-column tiles, the first the widest; recompute's
      // default two where I > H, else one)
      const int n = blocks > 0 ? blocks : mode == Training::save || s.intermediate > H ? 2 : 1;
      EXPECT_EQ(detail::scratch_shape(ws).block_columns, std::min(H, ((H + 255) / 256 + n - 1) / n * 256))
          << blocks << " blocks";
      scratch_bytes = ws.backward_scratch_bytes(DType::bf16, host.tokens, true, true);
      capacity = ws.plan().capacity_rows();
      return grads.snapshot();
    };
    const auto width = [&](std::int64_t blocks) {  // (whole 256-column tiles, the first blocks the widest)
      const std::int64_t tiles = (H + 255) / 256;
      return std::min(H, (tiles + blocks - 1) / blocks * 256);
    };
    std::int64_t whole_bytes = 0, cap = 0, bytes = 0;
    const auto whole = run(1, whole_bytes, cap);
    check_gradients(host, grads, dy, "whole rows");
    const auto by_default = run(0, bytes, cap);
    check_gradients(host, grads, dy, "column blocks");
    EXPECT_TRUE(by_default == whole) << "the default's two column blocks changed the gradients";
    EXPECT_EQ(whole_bytes - bytes, 2 * cap * (H - width(2))) << "the default (two blocks)";
    for (int blocks : {2, 3, 8}) {
      EXPECT_TRUE(run(blocks, bytes, cap) == whole) << blocks << " column blocks changed the gradients";
      EXPECT_EQ(whole_bytes - bytes, 2 * cap * (H - width(blocks))) << blocks << " blocks";
    }
    // Training::recompute: one block by default here (I <= H); more when asked (its GEMM1 on whole rows first,
    // then the first block's columns gathered over them), the same bits and the same scratch.
    std::int64_t recompute_bytes = 0;
    EXPECT_TRUE(run(0, recompute_bytes, cap, Training::recompute) == whole) << "recompute, by default";
    for (int blocks : {2, 3}) {
      EXPECT_TRUE(run(blocks, bytes, cap, Training::recompute, 4) == whole) << "recompute in " << blocks << " column blocks";
      EXPECT_EQ(bytes, recompute_bytes) << "recompute in " << blocks << " column blocks";
    }
  }
}

// Forward + backward captured once, replayed with new routing, activations and dy.
TEST(Backward, GraphReplayOfForwardAndBackward) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 128, 0, RoutingKind::uniform});
  const std::int64_t T = 640;
  const HostProblem first = make_problem(s, T, RoutingKind::uniform, 1);
  GpuProblem gpu(first);
  GpuGrads grads(gpu, random_bf16(first.x.size(), 2), false);
  Workspace ws(s, T, {}, Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&] {
    forward(gpu.args(), ws, stream, saved_view(saved));
    backward(gpu.args(), grads.args(), ws, stream, saved_view(saved));
  };
  step();  // warm-up outside capture (kernel attributes)
  ws.check(stream);
  const testing::CapturedGraph graph(stream, step);
  MOK_CUDA_OK(graph.error());
  for (RoutingKind kind : {RoutingKind::skewed, RoutingKind::padded, RoutingKind::first_half}) {
    const HostProblem next = testing::same_experts(first, kind, 7 + static_cast<int>(kind));
    const auto dy = random_bf16(next.x.size(), 100 + static_cast<int>(kind));
    gpu.x.upload(next.x, stream);
    gpu.ids.upload(next.topk_ids, stream);
    gpu.weights.upload(next.topk_weights, stream);
    grads.dy.upload(dy, stream);
    grads.poison();
    MOK_CUDA_OK(graph.launch(stream));
    ws.check(stream);
    check_gradients(next, grads, dy, routing_kind_name(kind));
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace mok
