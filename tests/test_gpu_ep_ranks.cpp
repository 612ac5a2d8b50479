// Expert parallelism as separate launches: every rank an EpRank on its own stream, meeting
// its peers only through symmetric regions, bitwise equal to one GPU and to virtual ranks;
// a stalled rank makes its peers time out with an error naming rank, peer, phase, counters.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "ep_problem.hpp"

namespace mok {
namespace {

using namespace testing;  // (mok::testing: the test support)

// Three calls with different routing and data queued back to back, with no check between
// them and one rank's stream held back on the host: the ranks progress at different
// speeds and must still meet call by call.
TEST(EpRanks, SeparateLaunchesMatchOneGpuBitwiseAcrossQueuedCalls) {
  MOK_REQUIRE_HOPPER();
  for (int ep : {2, 4}) {
    std::vector<std::unique_ptr<EpProblem>> calls;
    std::vector<std::vector<bf16>> expected;
    int seed = 81;
    for (RoutingKind kind : {RoutingKind::skewed, RoutingKind::padded, RoutingKind::uniform}) {
      calls.push_back(std::make_unique<EpProblem>(EpCase{"", ep, 300, 256, 256, 16, 2, 128, 0, kind}, seed++ + ep));
      expected.push_back(run_one_gpu(calls.back()->host));
      calls.back()->poison_outputs();
    }
    Config ring;
    ring.minibatch_rows = 128, ring.ring_rows = 256;  // the ring wraps
    Config once;  // each peer token pulled once, then gathered locally
    once.pull_tokens_once = true;
    // (Training::save ranks called without saved tensors: the evaluation forward of ranks that
    // train, saving nothing — mok.ep runs a forward without autograd on them; added 2026-12-06,
    // not yet run on a GPU)
    for (Training mode : {Training::off, Training::save})
    for (const Config& config : {ring, once}) {
    SCOPED_TRACE(std::string(config.pull_tokens_once ? "tokens pulled once" : "ring") +
                 (mode == Training::save ? ", training ranks" : ""));
    for (auto& call : calls) call->poison_outputs();
    SeparateRanks group(*calls[0], mode, config);
    for (std::size_t c = 0; c < calls.size(); ++c) {
      if (c == 1)  // rank 0 falls behind by 50 ms
        cudaLaunchHostFunc(
            group.streams[0], [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }, nullptr);
      const auto args = calls[c]->args();
      for (int r = 0; r < ep; ++r) group.ranks[r]->forward(args[r], group.streams[r]);
    }
    group.check();
    for (std::size_t c = 0; c < calls.size(); ++c)
      EXPECT_TRUE(same_bits(calls[c]->outputs(), expected[c])) << "EP " << ep << ", call " << c;
    }
  }
}

// Saving the pre-activations or recomputing them (Training::recompute). (One rank too: it has
// no peer to push to and keeps its dx rows local.)
TEST(EpRanks, SeparateLaunchesTrainBitwiseLikeVirtualRanks) {
  MOK_REQUIRE_HOPPER();
  for (int ep : {4, 1}) {
  SCOPED_TRACE("EP " + std::to_string(ep));
  const EpCase c{"", ep, 200, 256, 256, 16, 4, 128, 0.75f, RoutingKind::padded};
  const EpProblem p(c, 91);
  const auto dy = testing::random_bf16(p.host.x.size(), 92);
  const EpGrads g(p, dy);
  const TrainRun expected = train_group(p, g, Training::save);
  Config ring;  // the second pass: the backward's rows through rings that wrap
  ring.comm_sms = 2, ring.minibatch_rows = 128, ring.ring_rows = tight_ring(ring_needs(p).expert_rows, 128);
  Config once;  // the rows pulled before the kernels, each peer token once
  once.pull_tokens_once = true;
  Config spread = once;  // and the forward's GEMM2 tiles (their pushes) interleaved with GEMM1's
  spread.interleave_rows = 128;
  for (const Config& config : {Config{}, ring, once, spread}) {
  // Training::recompute: no saved tensor; each rank's backward runs its GEMM1 again first.
  for (const Training mode : {Training::save, Training::recompute}) {
  SCOPED_TRACE(std::string(config.comm_sms > 0               ? "ring"
                           : config.interleave_rows > 0      ? "tokens pulled once, interleaved"
                           : config.pull_tokens_once         ? "tokens pulled once"
                                                             : "no ring") +
               (mode == Training::recompute ? ", recompute" : ""));
  SeparateRanks group(p, mode, config);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> saved;
  std::vector<std::optional<TensorView>> views(p.ep);
  for (int r = 0; r < p.ep && mode == Training::save; ++r) {
    saved.push_back(std::make_unique<DeviceBuffer<bf16>>(group.ranks[r]->saved_elements()));
    views[r] = TensorView::contiguous(saved[r]->get(), DType::bf16, Device::cuda(0), {group.ranks[r]->saved_elements()});
  }
  const auto fa = p.args();
  const auto ba = g.args();
  p.poison_outputs();
  g.poison();
  for (int r = 0; r < p.ep; ++r) group.ranks[r]->forward(fa[r], group.streams[r], views[r]);
  for (int r = 0; r < p.ep; ++r) group.ranks[r]->backward(fa[r], ba[r], group.streams[r], views[r]);
  group.check();
  EXPECT_TRUE(same_bits(EpGrads::concat(g.dx), expected.dx));
  EXPECT_TRUE(same_bits(EpGrads::concat(g.dtw), expected.dtw));
  EXPECT_TRUE(same_bits(EpGrads::concat(g.d_gate), expected.gate));
  EXPECT_TRUE(same_bits(EpGrads::concat(g.d_up), expected.up));
  EXPECT_TRUE(same_bits(EpGrads::concat(g.d_down), expected.down));
  EXPECT_EQ(EpGrads::summed(g.d_sdown), expected.sdown);
  }
  }
  }
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
