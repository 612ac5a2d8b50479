// Expert parallelism in FP8 (Config::precision = Precision::fp8): an EP group's FP8 forward —
// the routed rows pulled from the ranks that own their tokens and quantized per 1 x 128 before
// the launch, GEMM2's rows pushed back — must be bitwise equal to one GPU's FP8 forward over
// all tokens and experts (a row's E4M3 values and scales are its token's alone; every sum has
// one order), for any group size, SM count, run, and for virtual ranks and separate launches
// alike. Training: the group's backward runs in bf16 on the FP8 forward's saved activations, or,
// in separate launches (EpRank), with the FP8 dgrad and bf16 or FP8 weight gradients — each
// bitwise equal to one GPU's (the FP8 dgrad in virtual ranks and the ring with fp8 are refused).
#include <gtest/gtest.h>

#include <cmath>

#include "ep_problem.hpp"
#include "gpu_fp8.hpp"
#include "mok/fp8.hpp"

namespace mok {
namespace {

using namespace testing;  // (mok::testing: the test support)

// Every rank's routed weights quantized on the GPU (its E_l experts: the same blocks as the
// group's experts quantized together).
struct RankFp8Weights {
  std::vector<std::unique_ptr<DeviceBuffer<std::uint8_t>>> values;     // gate, up, down per rank
  std::vector<std::unique_ptr<DeviceBuffer<std::int32_t>>> exponents;  // (the same)
  std::vector<Fp8Weights> views;
  std::vector<Fp8DgradWeights> dgrad;  // the FP8 dgrad's transposed weights

  explicit RankFp8Weights(const EpProblem& p) {
    const std::int64_t El = p.shape.num_local_experts, H = p.shape.hidden, I = p.shape.intermediate;
    const std::int64_t Hb = H / 128, Ib = I / 128;
    const Device d = Device::cuda(0);
    const auto args = p.args();
    for (int r = 0; r < p.ep; ++r) {
      auto u8 = [&](std::initializer_list<std::int64_t> shape) {
        std::int64_t n = 1;
        for (std::int64_t v : shape) n *= v;
        values.push_back(std::make_unique<DeviceBuffer<std::uint8_t>>(static_cast<std::size_t>(n)));
        return TensorView::contiguous(values.back()->get(), DType::u8, d, shape);
      };
      auto i32 = [&](std::initializer_list<std::int64_t> shape) {
        std::int64_t n = 1;
        for (std::int64_t v : shape) n *= v;
        exponents.push_back(std::make_unique<DeviceBuffer<std::int32_t>>(static_cast<std::size_t>(n)));
        return TensorView::contiguous(exponents.back()->get(), DType::i32, d, shape);
      };
      Fp8Weights w;
      w.gate = u8({El, I, H}), w.gate_exponents = i32({El, Ib, Hb});
      w.up = u8({El, I, H}), w.up_exponents = i32({El, Ib, Hb});
      w.down = u8({El, H, I}), w.down_exponents = i32({El, Hb, Ib});
      fp8::quantize_weights(args[r].w_gate, w.gate, w.gate_exponents, nullptr);
      fp8::quantize_weights(args[r].w_up, w.up, w.up_exponents, nullptr);
      fp8::quantize_weights(args[r].w_down, w.down, w.down_exponents, nullptr);
      views.push_back(w);
      Fp8DgradWeights t;
      t.down_t = u8({El, I, H}), t.down_t_exponents = i32({El, Ib, Hb});
      t.gate_up_t = u8({El, H, 2 * I}), t.gate_up_t_exponents = i32({El, Hb, 2 * Ib});
      fp8::quantize_dgrad_weights(args[r].w_gate, args[r].w_up, args[r].w_down, t, nullptr);
      dgrad.push_back(t);
    }
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  }

  std::vector<ForwardArgs> args(const EpProblem& p) const {
    auto a = p.args();
    for (int r = 0; r < p.ep; ++r) a[r].fp8 = views[r];
    return a;
  }
};

std::vector<bf16> run_group_fp8(const EpProblem& p, const RankFp8Weights& w, const Config& config = fp8_config()) {
  VirtualRanks group(p.shape, p.T, config);
  p.poison_outputs();
  group.forward(w.args(p), nullptr);
  group.check(nullptr);
  return p.outputs();
}

// One GPU, all tokens and all experts, FP8: what every group must reproduce bit for bit.
std::vector<bf16> run_one_gpu_fp8(const HostProblem& host) {
  GpuProblem gpu(host);
  const QuantizedWeights q(gpu);
  Workspace ws(host.shape, host.tokens, fp8_config());
  return run_fp8(gpu, q, ws);
}

bool all_finite(const std::vector<bf16>& v) {
  for (const bf16 x : v)
    if (!std::isfinite(x.to_float())) return false;
  return true;
}

bool all_finite(const std::vector<float>& v) {
  for (const float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

// One saved tensor per rank of `elements` bf16 values, and its view.
struct RankSaved {
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> buffers;
  std::vector<TensorView> views;
  RankSaved(int ranks, std::int64_t elements) {
    for (int r = 0; r < ranks; ++r) {
      buffers.push_back(std::make_unique<DeviceBuffer<bf16>>(elements));
      views.push_back(saved_view(*buffers.back()));
    }
  }
};

// One GPU's FP8 training step over every token and expert (the forward, then the backward in bf16,
// or with the FP8 dgrad and, wgrad, FP8 weight gradients): what every group's must equal.
struct OneGpuFp8Step {
  std::vector<bf16> y, dx, gate, up, down;
  std::vector<float> dtw;
  std::vector<double> sgate, sup, sdown;
};

OneGpuFp8Step one_gpu_fp8_step(const HostProblem& host, const std::vector<bf16>& dy, bool dgrad, bool wgrad) {
  GpuProblem one(host);
  const QuantizedWeights q(one);
  GpuGrads g(one, dy, false);
  Workspace ws(host.shape, host.tokens, fp8_config(), Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  one.poison_output();
  g.poison();
  forward(fp8_args(one, q), ws, nullptr, saved_view(saved));
  BackwardArgs b = g.args();
  if (dgrad) b.fp8 = q.dgrad, b.fp8_weight_gradients = wgrad;
  backward(fp8_args(one, q), b, ws, nullptr, saved_view(saved));
  ws.check(nullptr);
  auto as_bf16 = [](const DeviceBuffer<std::uint8_t>& buffer) {
    const auto bytes = buffer.download();
    std::vector<bf16> out(bytes.size() / 2);
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  };
  return {one.y.download(),
          g.dx.download(),
          as_bf16(g.d_gate),
          as_bf16(g.d_up),
          as_bf16(g.d_down),
          g.d_weights.download(),
          GpuGrads::as_double(g.d_sgate, false),
          GpuGrads::as_double(g.d_sup, false),
          GpuGrads::as_double(g.d_sdown, false)};
}

// The group's y and gradients against one GPU's: bitwise, but the shared expert's (each rank's
// share is its tokens': their sum against one GPU's in fp64). Both sides' outputs start poisoned
// with the same NaN bytes, so each is also checked finite: a region neither side writes would
// otherwise compare equal.
void expect_same_as_one_gpu(const EpProblem& p, const EpGrads& g, const OneGpuFp8Step& one) {
  const auto y = p.outputs(), dx = EpGrads::concat(g.dx), gate = EpGrads::concat(g.d_gate), up = EpGrads::concat(g.d_up),
             down = EpGrads::concat(g.d_down);
  const auto dtw = EpGrads::concat(g.dtw);
  EXPECT_TRUE(same_bits(y, one.y)) << "y";
  EXPECT_TRUE(same_bits(dx, one.dx)) << "dx";
  EXPECT_TRUE(same_bits(dtw, one.dtw)) << "d_topk_weights";
  EXPECT_TRUE(same_bits(gate, one.gate)) << "d_w_gate";
  EXPECT_TRUE(same_bits(up, one.up)) << "d_w_up";
  EXPECT_TRUE(same_bits(down, one.down)) << "d_w_down";
  for (const auto& [name, v] : {std::pair{"y", &y}, {"dx", &dx}, {"d_w_gate", &gate}, {"d_w_up", &up}, {"d_w_down", &down}})
    EXPECT_TRUE(all_finite(*v)) << name << ": unwritten or non-finite values";
  EXPECT_TRUE(all_finite(dtw)) << "d_topk_weights: unwritten or non-finite values";
  if (p.shape.has_shared()) {
    testing::expect_close("d_shared_gate (sum over ranks)", EpGrads::summed(g.d_sgate), one.sgate, "shared");
    testing::expect_close("d_shared_up (sum over ranks)", EpGrads::summed(g.d_sup), one.sup, "shared");
    testing::expect_close("d_shared_down (sum over ranks)", EpGrads::summed(g.d_sdown), one.sdown, "shared");
  }
}

class EpFp8Cases : public ::testing::TestWithParam<EpCase> {};

// (Both pulls: bf16 rows quantized by the puller, and E4M3 rows quantized once by their owner:
// Config::pull_fp8_rows.)
TEST_P(EpFp8Cases, ForwardBitwiseEqualsOneGpuFp8) {
  MOK_REQUIRE_HOPPER();
  const EpCase c = GetParam();
  for (std::uint64_t seed : {51u, 52u}) {
    const EpProblem p(c, seed * 1000 + c.ep);
    const RankFp8Weights w(p);
    const auto one = run_one_gpu_fp8(p.host);
    for (const bool e4m3 : {false, true}) {
      Config config = fp8_config();
      config.pull_fp8_rows = e4m3;
      const auto got = run_group_fp8(p, w, config);
      const std::string how = std::string(c.name) + " seed " + std::to_string(seed) + (e4m3 ? ", E4M3 rows pulled" : "");
      EXPECT_TRUE(all_finite(got)) << how << ": unwritten or non-finite outputs";
      EXPECT_TRUE(same_bits(got, one)) << how << ": EP = " << c.ep << " differs from one GPU's FP8 forward";
    }
  }
}

// (the EP forward suite's cases whose sizes are multiples of FP8's 128-blocks)
INSTANTIATE_TEST_SUITE_P(
    EpFp8, EpFp8Cases, ::testing::ValuesIn(ep_forward_cases(/*fp8=*/true)),
    [](const auto& info) { return std::string(info.param.name); });

TEST(EpFp8, BitwiseEqualAcrossRunsAndSmCounts) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 4, 500, 512, 256, 16, 4, 256, 0, RoutingKind::skewed};
  const EpProblem p(c, 57);
  const RankFp8Weights w(p);
  const auto first = run_group_fp8(p, w);
  ASSERT_TRUE(same_bits(first, run_one_gpu_fp8(p.host)));
  VirtualRanks group(p.shape, p.T, fp8_config());
  const auto args = w.args(p);
  for (int run = 0; run < 5; ++run) {
    p.poison_outputs();
    group.forward(args, nullptr);
    group.check(nullptr);
    ASSERT_TRUE(same_bits(p.outputs(), first)) << "run " << run;
  }
  for (int sms : {4, 12, 60}) {
    Config config = fp8_config(sms);
    EXPECT_TRUE(same_bits(run_group_fp8(p, w, config), first)) << sms << " SMs";
    config.pull_fp8_rows = true;
    EXPECT_TRUE(same_bits(run_group_fp8(p, w, config), first)) << sms << " SMs, E4M3 rows pulled";
  }
}

// Training: the group's FP8 forward saves the pre-activations, its backward (bf16, as
// mok::backward without BackwardArgs::fp8) reads them; every gradient bitwise equal to one
// GPU's FP8 forward + bf16 backward (the shared expert's summed over ranks, exactly).
TEST(EpFp8, TrainsBitwiseLikeOneGpu) {
  MOK_REQUIRE_HOPPER();
  for (const EpCase& c : {EpCase{"", 4, 300, 256, 256, 16, 4, 128, 0.75f, RoutingKind::padded},
                          EpCase{"", 2, 200, 512, 256, 8, 2, 0, 0, RoutingKind::skewed}}) {
    SCOPED_TRACE("EP " + std::to_string(c.ep));
    const EpProblem p(c, 61 + c.ep);
    const RankFp8Weights w(p);
    const auto dy = random_bf16(p.host.x.size(), 62 + c.ep);
    const EpGrads g(p, dy);

    VirtualRanks group(p.shape, p.T, fp8_config(), Training::save);
    const RankSaved saved(p.ep, group.saved_elements());
    p.poison_outputs();
    g.poison();
    const auto fa = w.args(p);
    group.forward(fa, nullptr, saved.views);
    group.backward(fa, g.args(), nullptr, saved.views);
    group.check(nullptr);
    expect_same_as_one_gpu(p, g, one_gpu_fp8_step(p.host, dy, false, false));
  }
}

// Separate launches (EpRank), the FP8 forward's bf16 backward (no BackwardArgs::fp8: what a rank
// runs for experts below mok.fp8.dgrad_pays), with either pull: every gradient bitwise equal to one
// GPU's FP8 forward + bf16 backward.
TEST(EpFp8, SeparateLaunchesTrainWithTheBf16BackwardBitwiseLikeOneGpu) {
  MOK_REQUIRE_HOPPER();
  for (const EpCase& c : {EpCase{"", 4, 300, 256, 256, 16, 4, 128, 0.75f, RoutingKind::padded},
                          EpCase{"", 2, 200, 512, 256, 8, 2, 0, 0, RoutingKind::skewed}})
  for (const bool e4m3 : {false, true}) {
    SCOPED_TRACE("EP " + std::to_string(c.ep) + (e4m3 ? ", E4M3 rows pulled" : ", bf16 rows pulled"));
    const EpProblem p(c, 65 + c.ep);
    const RankFp8Weights w(p);
    const auto dy = random_bf16(p.host.x.size(), 66 + c.ep);
    const EpGrads g(p, dy);
    Config config = fp8_config();
    config.pull_fp8_rows = e4m3;
    SeparateRanks group(p, Training::save, config);
    const RankSaved saved(p.ep, group.ranks[0]->saved_elements());
    const auto fa = w.args(p);
    const auto ba = g.args();
    p.poison_outputs();
    g.poison();
    for (int r = 0; r < p.ep; ++r) group.ranks[r]->forward(fa[r], group.streams[r], saved.views[r]);
    for (int r = 0; r < p.ep; ++r) group.ranks[r]->backward(fa[r], ba[r], group.streams[r], saved.views[r]);
    group.check();
    expect_same_as_one_gpu(p, g, one_gpu_fp8_step(p.host, dy, false, false));
  }
}

// The FP8 dgrad in a group of separate launches (EpRank): the dy rows pulled once into E4M3 rows
// (dh) and bf16 ones (weight gradients), dgate|dup quantized in the dh epilogue, the dx rows
// pushed; the weight gradients in bf16, or in E4M3 after the launch (the four operands transposed
// from the rank's own rows); every gradient bitwise equal to one GPU's FP8 forward and backward
// with the same choices. The forward pulls bf16 rows in some cases and E4M3 rows in the others,
// with either weight gradients. (The last case: I > H, where w h^T misses the E4M3 dy rows' room.)
TEST(EpFp8, SeparateLaunchesTrainWithTheFp8DgradBitwiseLikeOneGpu) {
  MOK_REQUIRE_HOPPER();
  const EpCase cases[] = {EpCase{"", 4, 300, 256, 256, 16, 4, 128, 0.75f, RoutingKind::padded},
                          EpCase{"", 2, 200, 512, 384, 8, 2, 0, 0, RoutingKind::skewed},
                          EpCase{"", 1, 200, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
                          EpCase{"", 2, 150, 128, 384, 4, 2, 0, 0, RoutingKind::uniform}};
  for (const bool wgrad : {false, true})
  for (int i = 0; i < 4; ++i) {
    const EpCase& c = cases[i];
    const bool e4m3 = wgrad != (i % 2 == 1);  // (each weight-gradient choice with both pulls)
    SCOPED_TRACE("EP " + std::to_string(c.ep) + (wgrad ? ", FP8 weight gradients" : ", bf16 weight gradients") +
                 (e4m3 ? ", E4M3 rows pulled" : ", bf16 rows pulled"));
    EpProblem p(c, 71 + c.ep);  // (not const: the first of two steps uploads other tokens)
    const RankFp8Weights w(p);
    const auto dy = random_bf16(p.host.x.size(), 72 + c.ep);
    const EpGrads g(p, dy);
    // (a first step on other tokens, routing and dy: rows or scales it left stale in the ranks'
    // buffers would show in the second step's results)
    const HostProblem other_host = make_problem(global_shape(c), c.tokens_per_rank * c.ep, c.routing, 91 + c.ep);
    const EpGrads other(p, random_bf16(p.host.x.size(), 92 + c.ep));

    const OneGpuFp8Step one = one_gpu_fp8_step(p.host, dy, true, wgrad);

    Config config = fp8_config();
    config.fp8_dgrad = true;  // (the ranks hold the FP8 dgrad's rows)
    config.pull_fp8_rows = e4m3;
    for (int call = 0; call < 2; ++call) {  // (the second group runs two steps: its rows reused)
      SCOPED_TRACE("call " + std::to_string(call));
      SeparateRanks group(p, Training::save, config);
      const RankSaved saved(p.ep, group.ranks[0]->saved_elements());
      const auto fa = w.args(p);
      for (int pass = 0; pass <= call; ++pass) {
        const bool first_of_two = pass < call;
        p.upload_tokens(first_of_two ? other_host : p.host, nullptr);
        ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
        const EpGrads& gp = first_of_two ? other : g;
        auto ba = gp.args();
        for (int r = 0; r < p.ep; ++r) ba[r].fp8 = w.dgrad[r], ba[r].fp8_weight_gradients = wgrad;
        p.poison_outputs();
        gp.poison();
        for (int r = 0; r < p.ep; ++r) group.ranks[r]->forward(fa[r], group.streams[r], saved.views[r]);
        for (int r = 0; r < p.ep; ++r) group.ranks[r]->backward(fa[r], ba[r], group.streams[r], saved.views[r]);
        group.check();
      }
      expect_same_as_one_gpu(p, g, one);
    }
  }
}

// One EpRank step small enough for compute-sanitizer (scripts/gpu_check.sh --part epfp8): the
// rank path's own buffers — the FP8 dgrad rows held from construction, the weight gradients'
// operands in the rank's dead rooms, E4M3 rows from the exchange — with one rank, so no kernel
// waits for a peer's (the sanitizers may run kernels one at a time).
TEST(EpFp8, OneRankFp8TrainingStepSmall) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 1, 64, 256, 128, 8, 2, 128, 0.75f, RoutingKind::padded};
  const EpProblem p(c, 95);
  const RankFp8Weights w(p);
  const auto dy = random_bf16(p.host.x.size(), 96);
  const EpGrads g(p, dy);
  Config config = fp8_config();
  config.fp8_dgrad = true;
  config.pull_fp8_rows = true;
  SeparateRanks group(p, Training::save, config);
  const RankSaved saved(1, group.ranks[0]->saved_elements());
  const auto fa = w.args(p);
  auto ba = g.args();
  ba[0].fp8 = w.dgrad[0], ba[0].fp8_weight_gradients = true;
  p.poison_outputs();
  g.poison();
  group.ranks[0]->forward(fa[0], group.streams[0], saved.views[0]);
  group.ranks[0]->backward(fa[0], ba[0], group.streams[0], saved.views[0]);
  group.check();
  expect_same_as_one_gpu(p, g, one_gpu_fp8_step(p.host, dy, true, true));
}

// Separate launches (EpRank on streams of this GPU), with the rows pulled once per pair, each peer
// token pulled once, or E4M3 rows pulled (quantized by their owner's exchange): the same bits as
// one GPU.
TEST(EpFp8, SeparateLaunchesMatchOneGpuBitwise) {
  MOK_REQUIRE_HOPPER();
  for (int ep : {2, 4}) {
    const EpProblem p(EpCase{"", ep, 300, 256, 256, 16, 2, 128, 0, RoutingKind::skewed}, 71 + ep);
    const RankFp8Weights w(p);
    const auto expected = run_one_gpu_fp8(p.host);
    Config once = fp8_config();
    once.pull_tokens_once = true;
    Config e4m3 = fp8_config();  // (the exchange quantizes each rank's tokens; peers pull E4M3 rows)
    e4m3.pull_fp8_rows = true;
    for (const Config& config : {fp8_config(), once, e4m3}) {
      SCOPED_TRACE(std::string("EP ") + std::to_string(ep) + (config.pull_tokens_once ? ", tokens pulled once" : "") +
                   (config.pull_fp8_rows ? ", E4M3 rows pulled" : ""));
      SeparateRanks group(p, Training::off, config);
      p.poison_outputs();
      const auto args = w.args(p);
      for (int r = 0; r < ep; ++r) group.ranks[r]->forward(args[r], group.streams[r]);
      group.check();
      EXPECT_TRUE(same_bits(p.outputs(), expected));
    }
  }
}

TEST(EpFp8, RejectsMisuse) {
  MOK_REQUIRE_HOPPER();
  const EpProblem p(EpCase{"", 2, 64, 256, 256, 8, 2, 0, 0, RoutingKind::uniform}, 81);
  const RankFp8Weights w(p);
  auto expect_error = [](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Config ring = fp8_config();
  ring.comm_sms = 1;
  expect_error([&] { VirtualRanks(p.shape, p.T, ring); }, "'config.comm_sms'");
  Config ring_rows = fp8_config();
  ring_rows.ring_rows = 4096;
  expect_error([&] { VirtualRanks(p.shape, p.T, ring_rows); }, "'config.ring_rows'");
  {  // an fp8 group without the quantized weights, a bf16 group given them
    VirtualRanks fp8_group(p.shape, p.T, fp8_config());
    expect_error([&] { fp8_group.forward(p.args(), nullptr); }, "argument 'fp8': is required");
    VirtualRanks bf16_group(p.shape, p.T);
    expect_error([&] { bf16_group.forward(w.args(p), nullptr); }, "argument 'fp8': was given, but the workspace's precision is bf16");
  }
  const EpGrads g(p, random_bf16(p.host.x.size(), 82));
  {  // the FP8 dgrad in virtual ranks (EpRank runs it)
    VirtualRanks group(p.shape, p.T, fp8_config(), Training::save);
    const RankSaved saved(p.ep, group.saved_elements());
    const auto fa = w.args(p);
    group.forward(fa, nullptr, saved.views);
    auto ba = g.args();
    ba[0].fp8 = w.dgrad[0];
    expect_error([&] { group.backward(fa, ba, nullptr, saved.views); },
                 "the FP8 dgrad of an EP group runs in mok::EpRank");
    group.check(nullptr);
  }
  {  // the FP8 dgrad in EpRanks made without its rows (Config::fp8_dgrad)
    SeparateRanks group(p, Training::save, fp8_config());
    const RankSaved saved(p.ep, group.ranks[0]->saved_elements());
    const auto fa = w.args(p);
    for (int r = 0; r < p.ep; ++r) group.ranks[r]->forward(fa[r], group.streams[r], saved.views[r]);
    group.check();
    auto ba = g.args();
    ba[0].fp8 = w.dgrad[0];
    expect_error([&] { group.ranks[0]->backward(fa[0], ba[0], group.streams[0], saved.views[0]); },
                 "argument 'fp8': was given, but the rank holds no FP8 dgrad rows: make it with Config::fp8_dgrad");
  }

}

}  // namespace
}  // namespace mok
