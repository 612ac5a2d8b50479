// Expert parallelism with virtual ranks on one GPU, backward: every rank's gradients match
// the fp64 reference and are bitwise equal to one GPU's, for any N, SM count, training mode
// and ring; a ring too small for an expert stops every rank with a clear error; a CUDA graph
// of forward and backward replays with new routing.
#include <gtest/gtest.h>

#include "ep_problem.hpp"

namespace mok {
namespace {

using namespace testing;  // (mok::testing: the test support)

class EpBackwardCases : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpBackwardCases, MatchesReferenceAndOneGpuBitwise) {
  MOK_REQUIRE_HOPPER();
  const EpCase c = GetParam();
  const EpProblem p(c, 31 * 1000 + c.ep);
  const auto dy = testing::random_bf16(p.host.x.size(), 77 + c.ep);
  const EpGrads g(p, dy);
  const TrainRun got = train_group(p, g, Training::save);

  const auto ref = reference::backward(p.host.shape, p.host.tokens, p.host.reference_x(), p.host.reference_routing(),
                                       p.host.reference_weights(), reference::to_double(dy));
  testing::expect_close("dx", reference::to_double(got.dx), ref.x, c.name);
  testing::expect_close("d_topk_weights", reference::to_double(got.dtw), ref.topk_weights, c.name);
  testing::expect_close("d_w_gate", reference::to_double(got.gate), ref.w.gate, c.name);
  testing::expect_close("d_w_up", reference::to_double(got.up), ref.w.up, c.name);
  testing::expect_close("d_w_down", reference::to_double(got.down), ref.w.down, c.name);
  if (p.shape.has_shared()) {
    testing::expect_close("d_shared_gate (sum over ranks)", got.sgate, ref.w.shared_gate, c.name);
    testing::expect_close("d_shared_up (sum over ranks)", got.sup, ref.w.shared_up, c.name);
    testing::expect_close("d_shared_down (sum over ranks)", got.sdown, ref.w.shared_down, c.name);
  }

  // One GPU over all tokens and experts: the same bits for everything but the shared
  // expert's gradients (split over ranks there).
  testing::GpuProblem one(p.host);
  testing::GpuGrads one_g(one, dy, false);
  Workspace ws(p.host.shape, p.host.tokens, {}, Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  const auto saved_view = TensorView::contiguous(saved.get(), DType::bf16, Device::cuda(0), {ws.saved_elements()});
  forward(one.args(), ws, nullptr, saved_view);
  backward(one.args(), one_g.args(), ws, nullptr, saved_view);
  ws.check(nullptr);
  auto download_bf16 = [](const DeviceBuffer<std::uint8_t>& b) {
    const auto bytes = b.download();
    std::vector<bf16> out(bytes.size() / 2);
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  };
  EXPECT_TRUE(same_bits(got.dx, one_g.dx.download())) << c.name << ": dx";
  EXPECT_TRUE(same_bits(got.dtw, one_g.d_weights.download())) << c.name << ": d_topk_weights";
  EXPECT_TRUE(same_bits(got.gate, download_bf16(one_g.d_gate))) << c.name << ": d_w_gate";
  EXPECT_TRUE(same_bits(got.up, download_bf16(one_g.d_up))) << c.name << ": d_w_up";
  EXPECT_TRUE(same_bits(got.down, download_bf16(one_g.d_down))) << c.name << ": d_w_down";

  // Recompute mode: the same bits.
  const TrainRun again = train_group(p, g, Training::recompute);
  EXPECT_TRUE(same_grads(again, got)) << c.name << ": recompute differs from save";
}

INSTANTIATE_TEST_SUITE_P(
    Ep, EpBackwardCases,
    ::testing::Values(EpCase{"ep1_uniform", 1, 300, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
                      EpCase{"ep2_uniform", 2, 300, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
                      EpCase{"ep4_skewed", 4, 400, 256, 256, 8, 2, 0, 0, RoutingKind::skewed},
                      EpCase{"ep4_idle_ranks", 4, 300, 256, 256, 16, 2, 0, 0, RoutingKind::first_half},
                      EpCase{"ep8_padded_shared_clamp", 8, 150, 256, 256, 16, 4, 192, 0.75f, RoutingKind::padded},
                      EpCase{"ep8_one_expert_per_rank_k1", 8, 129, 320, 192, 8, 1, 0, 0, RoutingKind::uniform}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(EpBackward, BitwiseEqualAcrossRunsAndSmCounts) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 4, 300, 256, 256, 16, 4, 128, 0, RoutingKind::skewed};
  const EpProblem p(c, 17);
  const auto dy = testing::random_bf16(p.host.x.size(), 18);
  const EpGrads g(p, dy);
  const TrainRun first = train_group(p, g, Training::save);
  for (int sms : {0, 4, 12, 60}) {
    Config config;
    config.compute_sms = sms;
    const TrainRun run = train_group(p, g, Training::save, config);
    EXPECT_TRUE(same_grads(run, first)) << sms << " SMs";
  }
}

// The backward's rings: dy and x rows stream through two rings, a minibatch at a time,
// pulled by comm SMs; the tightest ring that holds the largest expert's minibatches wraps
// on the busiest rank (skewed routing: one rank receives most rows; EP = 1: 16 experts
// through a ring of the largest one's rows). The
// gradients must be bitwise those without a ring (which equal one GPU's, above) for every
// comm-SM count, minibatch and ring size, in save and recompute modes.
TEST(EpBackward, RingWrapsAndGradientsDoNotDependOnCommSmsMinibatchOrRingSize) {
  MOK_REQUIRE_HOPPER();
  for (int ep : {1, 4, 8}) {
    const EpCase c{"", ep, 600, 256, 256, 16, 4, 128, 0.75f, RoutingKind::skewed};
    const EpProblem p(c, 141 + ep);
    const EpGrads g(p, testing::random_bf16(p.host.x.size(), 142 + ep));
    const TrainRun plain = train_group(p, g, Training::save);
    const RingNeeds need = ring_needs(p);
    struct Ring {
      int comm_sms;
      std::int64_t minibatch_rows, extra_minibatches;  // ring: the tight one + extra minibatches; -1: 0 (every row)
    };
    for (const Ring r : {Ring{1, 128, 0}, Ring{2, 256, 0}, Ring{3, 128, 1}, Ring{1, 512, 0}, Ring{2, 128, -1}}) {
      Config config;
      config.comm_sms = r.comm_sms;
      config.minibatch_rows = r.minibatch_rows;
      config.ring_rows =
          r.extra_minibatches < 0 ? 0 : tight_ring(need.expert_rows, r.minibatch_rows) + r.extra_minibatches * r.minibatch_rows;
      const std::string what = "EP " + std::to_string(ep) + ", comm_sms " + std::to_string(r.comm_sms) + ", minibatch " +
                               std::to_string(r.minibatch_rows) + ", ring " + std::to_string(config.ring_rows);
      if (r.extra_minibatches == 0 && r.minibatch_rows == 128)  // the busiest rank's rows wrap around the ring
        EXPECT_GT(need.rank_rows, config.ring_rows) << what << ": the ring does not wrap";
      EXPECT_TRUE(same_grads(train_group(p, g, Training::save, config), plain)) << what;
      if (r.comm_sms == 1 && r.minibatch_rows == 128)
        EXPECT_TRUE(same_grads(train_group(p, g, Training::recompute, config), plain)) << what << ", recompute";
    }
  }
}

// Many experts per rank: the tightest ring holds one expert's minibatches and the busiest
// rank's rows go round it three times or more (EP = 2, 4, 8; uniform and padded routing).
TEST(EpBackward, RingWrapsSeveralTimes) {
  MOK_REQUIRE_HOPPER();
  for (const EpCase c : {EpCase{"", 2, 600, 256, 256, 16, 4, 0, 0, RoutingKind::uniform},
                         EpCase{"", 4, 600, 256, 256, 32, 4, 128, 0.75f, RoutingKind::uniform},
                         EpCase{"", 8, 600, 256, 256, 64, 4, 0, 0, RoutingKind::uniform},
                         EpCase{"", 8, 600, 256, 256, 32, 4, 128, 0, RoutingKind::padded}}) {
    const EpProblem p(c, 171 + c.ep);
    const EpGrads g(p, testing::random_bf16(p.host.x.size(), 172 + c.ep));
    const RingNeeds need = ring_needs(p);
    const TrainRun plain = train_group(p, g, Training::save);
    for (int comm_sms : {1, 2}) {
      Config config;
      config.comm_sms = comm_sms, config.minibatch_rows = 128, config.ring_rows = tight_ring(need.expert_rows, 128);
      const std::string what = "EP " + std::to_string(c.ep) + ", E " + std::to_string(c.experts) + ", comm_sms " +
                               std::to_string(comm_sms) + ", ring " + std::to_string(config.ring_rows) + ", rank rows " +
                               std::to_string(need.rank_rows);
      EXPECT_GE(need.rank_rows, 3 * config.ring_rows) << what;
      EXPECT_TRUE(same_grads(train_group(p, g, Training::save, config), plain)) << what;
    }
  }
}

// A small backward ring case for compute-sanitizer (scripts/gpu_check.sh): two ranks, one
// comm SM each, 128-row minibatches through the tightest ring, padding and a shared expert.
TEST(EpBackward, SmallRingWrapsBitwiseLikeNoRing) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 2, 150, 256, 256, 8, 2, 128, 0, RoutingKind::padded};
  const EpProblem p(c, 161);
  const EpGrads g(p, testing::random_bf16(p.host.x.size(), 162));
  Config config;
  config.comm_sms = 1, config.minibatch_rows = 128, config.ring_rows = tight_ring(ring_needs(p).expert_rows, 128);
  EXPECT_TRUE(same_grads(train_group(p, g, Training::save, config), train_group(p, g, Training::save)));
}

// A ring that cannot hold some expert's rows at once: the planner flags it before any rank
// starts, every rank stops (NaN outputs, no hang) and the error names the expert, its rows
// and the ring.
TEST(EpBackward, RingTooSmallForAnExpertStopsEveryRankWithAClearError) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 4, 400, 256, 256, 16, 2, 0, 0, RoutingKind::skewed};
  const EpProblem p(c, 151);
  const EpGrads g(p, testing::random_bf16(p.host.x.size(), 152));
  const RingNeeds need = ring_needs(p);
  ASSERT_GE(need.expert_rows, 512);
  Config config;
  config.comm_sms = 1, config.minibatch_rows = 128, config.ring_rows = need.expert_rows - 256;
  VirtualRanks group(p.shape, p.T, config, Training::recompute);
  const auto fa = p.args();
  const auto ba = g.args();
  group.forward(fa, nullptr);  // (the forward's ring holds any minibatch)
  group.check(nullptr);
  for (const auto& dx : g.dx) cudaMemset(dx->get(), 0, dx->size() * sizeof(bf16));  // not NaN: the kernel must write NaN
  group.backward(fa, ba, nullptr);
  try {
    group.check(nullptr);
    FAIL() << "no error reported";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ring token buffer is too small: local expert"), std::string::npos) << what;
    EXPECT_NE(what.find("has " + std::to_string(need.expert_rows) + " padded rows and the ring holds " +
                        std::to_string(config.ring_rows) + " rows"),
              std::string::npos)
        << what;
  }
  for (const bf16 v : EpGrads::concat(g.dx)) ASSERT_TRUE(std::isnan(v.to_float())) << "a rank ran on a bad plan";
}

// A CUDA graph of every rank's forward and backward, replayed with new routing and new
// data of the same shapes: nothing in the EP path may depend on the host seeing a count.
// Saving the pre-activations, and recomputing them (the recompute's launch captured too).
TEST(EpBackward, GraphReplayOfForwardAndBackward) {
  MOK_REQUIRE_HOPPER();
  for (const Training mode : {Training::save, Training::recompute}) {
  SCOPED_TRACE(mode == Training::save ? "save" : "recompute");
  const EpCase c{"", 4, 256, 256, 256, 16, 2, 128, 0, RoutingKind::uniform};
  EpProblem p(c, 51);
  const EpGrads g(p, testing::random_bf16(p.host.x.size(), 52));
  Config config;
  // A ring of 128-row minibatches that holds any one expert's rows (at most ep * T * k =
  // 2048; the backward needs that) and wraps when a rank receives more (skewed routing).
  config.minibatch_rows = 128, config.ring_rows = 2048;
  VirtualRanks group(p.shape, p.T, config, mode);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> saved;
  std::vector<TensorView> views;
  for (int r = 0; r < p.ep && mode == Training::save; ++r) {
    saved.push_back(std::make_unique<DeviceBuffer<bf16>>(group.saved_elements()));
    views.push_back(TensorView::contiguous(saved.back()->get(), DType::bf16, Device::cuda(0), {group.saved_elements()}));
  }
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto fa = p.args();
  const auto ba = g.args();
  auto step = [&] {
    group.forward(fa, stream, views);
    group.backward(fa, ba, stream, views);
  };
  step();  // warm-up outside capture (kernel attributes)
  group.check(stream);
  const testing::CapturedGraph graph(stream, step);
  MOK_CUDA_OK(graph.error());
  for (RoutingKind kind : {RoutingKind::skewed, RoutingKind::padded, RoutingKind::first_half}) {
    const HostProblem next = testing::same_experts(p.host, kind, 60 + static_cast<int>(kind));
    const auto dy = testing::random_bf16(next.x.size(), 70 + static_cast<int>(kind));
    p.upload_tokens(next, stream);
    for (int r = 0; r < p.ep; ++r)
      g.dy[r]->upload(std::vector<bf16>(dy.begin() + r * p.T * p.shape.hidden, dy.begin() + (r + 1) * p.T * p.shape.hidden),
                      stream);
    p.poison_outputs();
    g.poison();
    MOK_CUDA_OK(graph.launch(stream));
    group.check(stream);
    const auto y_ref = reference::forward(next.shape, next.tokens, next.reference_x(), next.reference_routing(),
                                          next.reference_weights());
    const auto cmp = testing::compare(reference::to_double(p.outputs()), y_ref);
    EXPECT_EQ(cmp.non_finite, 0) << routing_kind_name(kind);
    EXPECT_LE(cmp.rel_error, 1e-2) << routing_kind_name(kind);
    const auto ref = reference::backward(next.shape, next.tokens, next.reference_x(), next.reference_routing(),
                                         next.reference_weights(), reference::to_double(dy));
    const char* name = routing_kind_name(kind);
    testing::expect_close("dx", reference::to_double(EpGrads::concat(g.dx)), ref.x, name);
    testing::expect_close("d_topk_weights", reference::to_double(EpGrads::concat(g.dtw)), ref.topk_weights, name);
    testing::expect_close("d_w_gate", reference::to_double(EpGrads::concat(g.d_gate)), ref.w.gate, name);
    testing::expect_close("d_w_down", reference::to_double(EpGrads::concat(g.d_down)), ref.w.down, name);
    testing::expect_close("d_shared_up (sum over ranks)", EpGrads::summed(g.d_sup), ref.w.shared_up, name);
  }
  cudaStreamDestroy(stream);
  }
}

}  // namespace
}  // namespace mok
