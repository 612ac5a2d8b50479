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
#include <thread>

#include "gpu_grads.hpp"
#include "gpu_problem.hpp"
#include "mok/backward.hpp"
#include "mok/ep.hpp"
#include "mok/error.hpp"
#include "mok/plan.hpp"

namespace mok {
namespace {

using testing::DeviceBuffer;
using testing::same_bits;

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

  // New tokens and routing for every rank (same experts): rows of a global problem `h`.
  void upload_tokens(const HostProblem& h, cudaStream_t stream) {
    const std::int64_t H = shape.hidden, k = shape.top_k;
    for (int r = 0; r < ep; ++r) {
      x[r]->upload(std::vector<bf16>(h.x.begin() + r * T * H, h.x.begin() + (r + 1) * T * H), stream);
      ids[r]->upload(std::vector<std::int32_t>(h.topk_ids.begin() + r * T * k, h.topk_ids.begin() + (r + 1) * T * k),
                     stream);
      weights[r]->upload(
          std::vector<float>(h.topk_weights.begin() + r * T * k, h.topk_weights.begin() + (r + 1) * T * k), stream);
    }
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
    EXPECT_TRUE(same_bits(got, run_one_gpu(p.host))) << c.name << ": EP = " << c.ep << " differs from one GPU";
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
  ASSERT_TRUE(same_bits(first, run_one_gpu(p.host)));
  VirtualRanks group(p.shape, p.T);
  const auto args = p.args();
  for (int run = 0; run < 10; ++run) {
    p.poison_outputs();
    group.forward(args, nullptr);
    group.check(nullptr);
    ASSERT_TRUE(same_bits(p.outputs(), first)) << "run " << run;
  }
  for (int sms : {4, 12, 60}) {
    Config config;
    config.compute_sms = sms;
    EXPECT_TRUE(same_bits(run_group(p, config), first)) << sms << " SMs";
  }
}

// The ring token buffer: rows arrive through a ring of ring_rows rows, minibatch_rows at a
// time, copied by comm_sms CTAs per rank; a ring of one or two minibatches wraps many times
// (rank 0 receives most rows here). The result must not depend on any of the three.
TEST(Ep, RingWrapsAndResultsDoNotDependOnCommSmsMinibatchOrRingSize) {
  MOK_REQUIRE_HOPPER();
  for (int ep : {1, 4, 8}) {
    const EpCase c{"", ep, 600, 256, 256, 16, 4, 128, 0.75f, RoutingKind::skewed};
    const EpProblem p(c, 41 + ep);
    const auto one = run_one_gpu(p.host);
    struct Ring {
      int comm_sms;
      std::int64_t minibatch_rows, ring_rows;
    };
    for (const Ring r : {Ring{1, 128, 128}, Ring{1, 128, 256}, Ring{2, 256, 512}, Ring{3, 128, 0}, Ring{1, 4096, 0}}) {
      Config config;
      config.comm_sms = r.comm_sms;
      config.minibatch_rows = r.minibatch_rows;
      config.ring_rows = r.ring_rows;
      EXPECT_TRUE(same_bits(run_group(p, config), one))
          << "EP " << ep << ", comm_sms " << r.comm_sms << ", minibatch " << r.minibatch_rows << ", ring " << r.ring_rows;
    }
  }
}

// A small ring case for compute-sanitizer (scripts/gpu_check.sh): two ranks, one comm SM
// each, a ring of one 128-row minibatch that wraps, padding rows and a shared expert.
TEST(Ep, SmallRingWrapsBitwiseLikeOneGpu) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 2, 150, 256, 256, 8, 2, 128, 0, RoutingKind::padded};
  const EpProblem p(c, 61);
  Config config;
  config.comm_sms = 1, config.minibatch_rows = 128, config.ring_rows = 128;
  EXPECT_TRUE(same_bits(run_group(p, config), run_one_gpu(p.host)));
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

// ---------------------------------------------------------------------------- backward

// Per rank: dy (its tokens' rows of one global dy), and every gradient it writes (bf16).
struct EpGrads {
  const EpProblem& p;
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> dy, dx, d_gate, d_up, d_down, d_sgate, d_sup, d_sdown;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dtw;

  EpGrads(const EpProblem& problem, const std::vector<bf16>& dy_all) : p(problem) {
    const MoeShape& s = p.shape;
    const std::int64_t T = p.T, H = s.hidden, I = s.intermediate, El = s.num_local_experts, k = s.top_k;
    const std::int64_t Is = s.shared_intermediate;
    for (int r = 0; r < p.ep; ++r) {
      dy.push_back(std::make_unique<DeviceBuffer<bf16>>(
          std::vector<bf16>(dy_all.begin() + r * T * H, dy_all.begin() + (r + 1) * T * H)));
      dx.push_back(std::make_unique<DeviceBuffer<bf16>>(T * H));
      dtw.push_back(std::make_unique<DeviceBuffer<float>>(T * k));
      d_gate.push_back(std::make_unique<DeviceBuffer<bf16>>(El * I * H));
      d_up.push_back(std::make_unique<DeviceBuffer<bf16>>(El * I * H));
      d_down.push_back(std::make_unique<DeviceBuffer<bf16>>(El * H * I));
      d_sgate.push_back(std::make_unique<DeviceBuffer<bf16>>(Is * H));
      d_sup.push_back(std::make_unique<DeviceBuffer<bf16>>(Is * H));
      d_sdown.push_back(std::make_unique<DeviceBuffer<bf16>>(H * Is));
    }
  }

  std::vector<BackwardArgs> args() const {
    const MoeShape& s = p.shape;
    const Device d = Device::cuda(0);
    const std::int64_t T = p.T, H = s.hidden, I = s.intermediate, El = s.num_local_experts, k = s.top_k;
    const std::int64_t Is = s.shared_intermediate;
    std::vector<BackwardArgs> out(p.ep);
    for (int r = 0; r < p.ep; ++r) {
      BackwardArgs& b = out[r];
      b.dy = TensorView::contiguous(dy[r]->get(), DType::bf16, d, {T, H});
      b.dx = TensorView::contiguous(dx[r]->get(), DType::bf16, d, {T, H});
      b.d_topk_weights = TensorView::contiguous(dtw[r]->get(), DType::f32, d, {T, k});
      b.d_w_gate = TensorView::contiguous(d_gate[r]->get(), DType::bf16, d, {El, I, H});
      b.d_w_up = TensorView::contiguous(d_up[r]->get(), DType::bf16, d, {El, I, H});
      b.d_w_down = TensorView::contiguous(d_down[r]->get(), DType::bf16, d, {El, H, I});
      if (s.has_shared()) {
        b.d_shared_gate = TensorView::contiguous(d_sgate[r]->get(), DType::bf16, d, {Is, H});
        b.d_shared_up = TensorView::contiguous(d_sup[r]->get(), DType::bf16, d, {Is, H});
        b.d_shared_down = TensorView::contiguous(d_sdown[r]->get(), DType::bf16, d, {H, Is});
      }
    }
    return out;
  }

  void poison() const {
    for (int r = 0; r < p.ep; ++r) {
      for (auto* v : {&dx, &d_gate, &d_up, &d_down, &d_sgate, &d_sup, &d_sdown})
        cudaMemset((*v)[r]->get(), 0xff, (*v)[r]->size() * sizeof(bf16));
      cudaMemset(dtw[r]->get(), 0xff, dtw[r]->size() * sizeof(float));
    }
    cudaDeviceSynchronize();
  }

  // Every rank's buffers of one kind, concatenated in rank order (= global order).
  template <typename T>
  static std::vector<T> concat(const std::vector<std::unique_ptr<DeviceBuffer<T>>>& v) {
    std::vector<T> all;
    for (const auto& b : v) {
      const auto part = b->download();
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
  // The shared expert's gradient summed over ranks (what data parallelism all-reduces).
  static std::vector<double> summed(const std::vector<std::unique_ptr<DeviceBuffer<bf16>>>& v) {
    std::vector<double> sum;
    for (const auto& b : v) {
      const auto part = reference::to_double(b->download());
      if (sum.empty()) sum.assign(part.size(), 0.0);
      for (std::size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
    }
    return sum;
  }
};

struct TrainRun {
  std::vector<bf16> dx, gate, up, down;
  std::vector<float> dtw;
  std::vector<double> sgate, sup, sdown;
};

bool same_grads(const TrainRun& a, const TrainRun& b) {
  return same_bits(a.dx, b.dx) && same_bits(a.dtw, b.dtw) && same_bits(a.gate, b.gate) && same_bits(a.up, b.up) &&
         same_bits(a.down, b.down) && a.sgate == b.sgate && a.sup == b.sup && a.sdown == b.sdown;
}

TrainRun train_group(const EpProblem& p, const EpGrads& g, Training mode, const Config& config = {}) {
  VirtualRanks group(p.shape, p.T, config, mode);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> saved;
  std::vector<TensorView> views;
  if (mode == Training::save)
    for (int r = 0; r < p.ep; ++r) {
      saved.push_back(std::make_unique<DeviceBuffer<bf16>>(group.saved_elements()));
      views.push_back(TensorView::contiguous(saved.back()->get(), DType::bf16, Device::cuda(0), {group.saved_elements()}));
    }
  p.poison_outputs();
  g.poison();
  const auto fa = p.args();
  const auto ba = g.args();
  group.forward(fa, nullptr, views);
  group.backward(fa, ba, nullptr, views);
  group.check(nullptr);
  return {EpGrads::concat(g.dx),        EpGrads::concat(g.d_gate),      EpGrads::concat(g.d_up),
          EpGrads::concat(g.d_down),    EpGrads::concat(g.dtw),         EpGrads::summed(g.d_sgate),
          EpGrads::summed(g.d_sup),     EpGrads::summed(g.d_sdown)};
}


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

// Rows of the largest local expert (padded) and of the busiest rank, over every rank's plan.
struct RingNeeds {
  std::int64_t expert_rows = 0, rank_rows = 0;
};

RingNeeds ring_needs(const EpProblem& p) {
  RingNeeds n;
  for (int r = 0; r < p.ep; ++r) {
    const Plan plan = plan_host(p.shape, p.T, p.host.topk_ids, r);
    for (std::size_t e = 0; e + 1 < plan.expert_offset.size(); ++e)
      n.expert_rows = std::max<std::int64_t>(n.expert_rows, plan.expert_offset[e + 1] - plan.expert_offset[e]);
    n.rank_rows = std::max(n.rank_rows, plan.padded_rows());
  }
  return n;
}

// The smallest ring (a multiple of minibatch_rows) that holds an expert of `rows` rows
// wherever its rows start (128-row aligned).
std::int64_t tight_ring(std::int64_t rows, std::int64_t minibatch_rows) {
  return (rows + minibatch_rows - 128 + minibatch_rows - 1) / minibatch_rows * minibatch_rows;
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
TEST(EpBackward, GraphReplayOfForwardAndBackward) {
  MOK_REQUIRE_HOPPER();
  const EpCase c{"", 4, 256, 256, 256, 16, 2, 128, 0, RoutingKind::uniform};
  EpProblem p(c, 51);
  const EpGrads g(p, testing::random_bf16(p.host.x.size(), 52));
  Config config;
  // A ring of 128-row minibatches that holds any one expert's rows (at most ep * T * k =
  // 2048; the backward needs that) and wraps when a rank receives more (skewed routing).
  config.minibatch_rows = 128, config.ring_rows = 2048;
  VirtualRanks group(p.shape, p.T, config, Training::save);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> saved;
  std::vector<TensorView> views;
  for (int r = 0; r < p.ep; ++r) {
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

// ------------------------------------------------------ separate launches (EpRank)

// Every rank as its own EpRank on its own stream of this GPU (a share of the SMs each), as
// ranks on separate GPUs run: the ranks meet only through their symmetric regions.
struct SeparateRanks {
  std::vector<std::unique_ptr<DeviceBuffer<std::uint8_t>>> regions;
  std::vector<std::unique_ptr<EpRank>> ranks;
  std::vector<cudaStream_t> streams;

  SeparateRanks(const EpProblem& p, Training mode, Config config = {}) {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    config.compute_sms = sms / p.ep - 1;  // every rank's kernel resident at once
    std::vector<void*> bases;
    for (int r = 0; r < p.ep; ++r) {
      regions.push_back(std::make_unique<DeviceBuffer<std::uint8_t>>(EpRank::region_bytes(p.shape, p.T)));
      cudaMemset(regions.back()->get(), 0, regions.back()->size());
      bases.push_back(regions.back()->get());
    }
    cudaDeviceSynchronize();
    for (int r = 0; r < p.ep; ++r) {
      ranks.push_back(std::make_unique<EpRank>(p.shape, p.T, r, bases, config, mode, false));
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      streams.push_back(s);
    }
  }
  ~SeparateRanks() {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
  void check() {
    for (int r = 0; r < static_cast<int>(ranks.size()); ++r) ranks[r]->check(streams[r]);
  }
};

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
    Config config;
    config.minibatch_rows = 128, config.ring_rows = 256;  // the ring wraps
    SeparateRanks group(*calls[0], Training::off, config);
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

// (One rank too: it has no peer to push to and keeps its dx rows local.)
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
  for (const Config& config : {Config{}, ring}) {
  SCOPED_TRACE(config.comm_sms > 0 ? "ring" : "no ring");
  SeparateRanks group(p, Training::save, config);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> saved;
  for (int r = 0; r < p.ep; ++r) saved.push_back(std::make_unique<DeviceBuffer<bf16>>(group.ranks[r]->saved_elements()));
  const auto fa = p.args();
  const auto ba = g.args();
  p.poison_outputs();
  g.poison();
  for (int r = 0; r < p.ep; ++r) {
    const auto view = TensorView::contiguous(saved[r]->get(), DType::bf16, Device::cuda(0), {group.ranks[r]->saved_elements()});
    group.ranks[r]->forward(fa[r], group.streams[r], view);
  }
  for (int r = 0; r < p.ep; ++r) {
    const auto view = TensorView::contiguous(saved[r]->get(), DType::bf16, Device::cuda(0), {group.ranks[r]->saved_elements()});
    group.ranks[r]->backward(fa[r], ba[r], group.streams[r], view);
  }
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
