// The CPU reference is the oracle: its forward is checked against a naive independent
// formula, and its gradients against central finite differences of its own forward.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "mok/error.hpp"
#include "mok/problem.hpp"
#include "mok/reference.hpp"

namespace mok {
namespace {

MoeShape small_shape(std::int64_t shared, std::optional<float> limit) {
  MoeShape s;
  s.hidden = 64, s.intermediate = 64, s.num_experts = 4, s.num_local_experts = 4, s.top_k = 2;
  s.shared_intermediate = shared;
  s.swiglu_limit = limit;
  return s;
}

// Straight from docs/design.md §2, one scalar at a time, no shared code with the reference.
std::vector<double> naive_forward(const MoeShape& s, std::int64_t T, const std::vector<double>& x,
                                  const reference::Routing& r, const reference::Weights& w) {
  const std::int64_t H = s.hidden;
  std::vector<double> y(T * H, 0.0);
  auto expert = [&](std::int64_t t, const double* g, const double* u, const double* d, std::int64_t I,
                    double weight) {
    std::vector<double> hid(I);
    for (std::int64_t i = 0; i < I; ++i) {
      double a = 0, b = 0;
      for (std::int64_t h = 0; h < H; ++h) a += g[i * H + h] * x[t * H + h], b += u[i * H + h] * x[t * H + h];
      if (s.swiglu_limit) a = std::min<double>(a, *s.swiglu_limit), b = std::clamp<double>(b, -*s.swiglu_limit, *s.swiglu_limit);
      hid[i] = a / (1 + std::exp(-a)) * b;
    }
    for (std::int64_t h = 0; h < H; ++h) {
      double o = 0;
      for (std::int64_t i = 0; i < I; ++i) o += d[h * I + i] * hid[i];
      y[t * H + h] += weight * o;
    }
  };
  const std::int64_t I = s.intermediate, Is = s.shared_intermediate;
  for (std::int64_t t = 0; t < T; ++t) {
    if (Is) expert(t, w.shared_gate.data(), w.shared_up.data(), w.shared_down.data(), Is, 1.0);
    for (std::int64_t j = 0; j < s.top_k; ++j) {
      const int e = r.ids[t * s.top_k + j];
      if (e < 0) continue;
      expert(t, &w.gate[e * I * H], &w.up[e * I * H], &w.down[e * H * I], I, r.weights[t * s.top_k + j]);
    }
  }
  return y;
}

TEST(Reference, ForwardMatchesNaiveFormula) {
  for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::padded, RoutingKind::skewed}) {
    MoeShape s = small_shape(64, 1.5f);
    HostProblem p = make_problem(s, 7, kind, 11);
    const auto x = p.reference_x();
    const auto y = reference::forward(s, p.tokens, x, p.reference_routing(), p.reference_weights());
    const auto y0 = naive_forward(s, p.tokens, x, p.reference_routing(), p.reference_weights());
    ASSERT_EQ(y.size(), y0.size());
    for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], y0[i], 1e-12) << "element " << i;
  }
}

TEST(Reference, PaddedTokenGetsOnlySharedExpert) {
  MoeShape s = small_shape(64, std::nullopt);
  HostProblem p = make_problem(s, 3, RoutingKind::uniform, 5);
  std::fill(p.topk_ids.begin() + 2, p.topk_ids.begin() + 4, -1);  // token 1: no routed expert
  auto w = p.reference_weights();
  const auto x = p.reference_x();
  const auto y = reference::forward(s, p.tokens, x, p.reference_routing(), w);
  MoeShape no_routed = s;
  auto routing = p.reference_routing();
  std::fill(routing.ids.begin(), routing.ids.end(), -1);
  const auto y_shared = reference::forward(no_routed, p.tokens, x, routing, w);
  for (std::int64_t h = 0; h < s.hidden; ++h) EXPECT_EQ(y[1 * s.hidden + h], y_shared[1 * s.hidden + h]);
  const auto g = reference::backward(s, p.tokens, x, p.reference_routing(), w, std::vector<double>(3 * 64, 1.0));
  EXPECT_EQ(g.topk_weights[2], 0.0);
  EXPECT_EQ(g.topk_weights[3], 0.0);
}

TEST(Reference, EmptyBatch) {
  MoeShape s = small_shape(0, std::nullopt);
  HostProblem p = make_problem(s, 0, RoutingKind::uniform, 1);
  const auto y = reference::forward(s, 0, {}, p.reference_routing(), p.reference_weights());
  EXPECT_TRUE(y.empty());
  const auto g = reference::backward(s, 0, {}, p.reference_routing(), p.reference_weights(), {});
  for (double v : g.w.gate) ASSERT_EQ(v, 0.0);
}

TEST(Reference, RejectsExpertOutOfRange) {
  MoeShape s = small_shape(0, std::nullopt);
  HostProblem p = make_problem(s, 2, RoutingKind::uniform, 1);
  auto r = p.reference_routing();
  r.ids[3] = 4;
  try {
    reference::forward(s, 2, p.reference_x(), r, p.reference_weights());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert id must be in [-1, 4), got 4 at token 1, slot 1"), std::string::npos) << e.what();
  }
}

struct FdCase {
  const char* name;
  std::int64_t shared;
  std::optional<float> limit;
  RoutingKind routing;
  std::uint64_t seed;
};

class FiniteDifferences : public ::testing::TestWithParam<FdCase> {};

// loss = sum(y * dy); each sampled input element is moved by +-eps and the central
// difference compared with the analytic gradient.
TEST_P(FiniteDifferences, GradientsMatch) {
  const FdCase c = GetParam();
  const MoeShape s = small_shape(c.shared, c.limit);
  const std::int64_t T = 6;
  HostProblem p = make_problem(s, T, c.routing, c.seed);
  auto x = p.reference_x();
  auto routing = p.reference_routing();
  auto w = p.reference_weights();
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> normal;
  std::vector<double> dy(T * s.hidden);
  for (double& v : dy) v = normal(rng);

  const auto grads = reference::backward(s, T, x, routing, w, dy);
  auto loss = [&] {
    const auto y = reference::forward(s, T, x, routing, w);
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
    return l;
  };

  auto check = [&](const char* name, std::vector<double>& values, const std::vector<double>& analytic,
                   int samples) {
    ASSERT_EQ(values.size(), analytic.size()) << name;
    if (values.empty()) return;
    std::uniform_int_distribution<std::size_t> pick(0, values.size() - 1);
    for (int n = 0; n < samples; ++n) {
      const std::size_t i = pick(rng);
      const double saved = values[i], eps = 1e-5 * std::max(1.0, std::abs(saved));
      values[i] = saved + eps;
      const double up = loss();
      values[i] = saved - eps;
      const double down = loss();
      values[i] = saved;
      const double fd = (up - down) / (2 * eps);
      EXPECT_NEAR(analytic[i], fd, 1e-6 * (1.0 + std::abs(fd))) << name << "[" << i << "]";
    }
  };
  check("x", x, grads.x, 60);
  check("topk_weights", routing.weights, grads.topk_weights, 12);
  check("w_gate", w.gate, grads.w.gate, 60);
  check("w_up", w.up, grads.w.up, 60);
  check("w_down", w.down, grads.w.down, 60);
  check("shared_gate", w.shared_gate, grads.w.shared_gate, 40);
  check("shared_up", w.shared_up, grads.w.shared_up, 40);
  check("shared_down", w.shared_down, grads.w.shared_down, 40);
  // Padding slots must have a zero weight gradient (nothing flows through them).
  for (std::size_t i = 0; i < routing.ids.size(); ++i)
    if (routing.ids[i] < 0) EXPECT_EQ(grads.topk_weights[i], 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Reference, FiniteDifferences,
    ::testing::Values(FdCase{"shared_plain", 64, std::nullopt, RoutingKind::uniform, 101},
                      FdCase{"clamp_padded", 0, 0.7f, RoutingKind::padded, 202},
                      FdCase{"shared_clamp_padded", 128, 0.9f, RoutingKind::padded, 303},
                      FdCase{"shared_clamp_skewed", 64, 1.2f, RoutingKind::skewed, 404}),
    [](const auto& info) { return std::string(info.param.name); });

// The clamp must really be active in the clamp cases, or the test above proves nothing about it.
TEST(Reference, ClampIsExercised) {
  const MoeShape s = small_shape(0, 0.7f);
  HostProblem p = make_problem(s, 6, RoutingKind::uniform, 202);
  const auto y_clamped = reference::forward(s, 6, p.reference_x(), p.reference_routing(), p.reference_weights());
  MoeShape plain = s;
  plain.swiglu_limit.reset();
  const auto y_plain = reference::forward(plain, 6, p.reference_x(), p.reference_routing(), p.reference_weights());
  EXPECT_GT(reference::relative_error(y_clamped, y_plain), 0.05);
}

TEST(Reference, RelativeErrorCatchesNaN) {
  std::vector<double> a{1.0, NAN}, b{1.0, 2.0};
  EXPECT_TRUE(std::isinf(reference::relative_error(a, b)));
  EXPECT_EQ(reference::relative_error(b, b), 0.0);
}

}  // namespace
}  // namespace mok
