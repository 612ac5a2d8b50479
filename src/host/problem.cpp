#include "mok/problem.hpp"

#include <cmath>
#include <random>

#include "parallel.hpp"

namespace mok {
namespace {

// Fills in blocks with per-block seeds, so that big weights are generated in parallel
// and the result does not depend on the thread count.
std::vector<bf16> random_bf16(std::int64_t n, double stddev, std::uint64_t seed) {
  constexpr std::int64_t kBlock = 1 << 16;
  std::vector<bf16> out(n);
  detail::parallel_for((n + kBlock - 1) / kBlock, [&](std::int64_t b) {
    std::mt19937_64 rng(seed * 0x100000001b3ull + static_cast<std::uint64_t>(b));
    std::normal_distribution<float> normal(0.0f, static_cast<float>(stddev));
    for (std::int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
      out[i] = bf16::from_float(normal(rng));
  });
  return out;
}

}  // namespace

HostProblem make_problem(const MoeShape& s, std::int64_t T, RoutingKind routing, std::uint64_t seed) {
  validate(s);
  const std::int64_t H = s.hidden, I = s.intermediate, E = s.num_experts, Is = s.shared_intermediate;
  HostProblem p;
  p.shape = s;
  p.tokens = T;
  p.x = random_bf16(T * H, 1.0, seed + 1);
  p.topk_ids = make_routing(routing, T, E, s.top_k, seed + 2);
  p.topk_weights = make_routing_weights(p.topk_ids, s.top_k, seed + 3);
  p.w_gate = random_bf16(E * I * H, 1.0 / std::sqrt(double(H)), seed + 4);
  p.w_up = random_bf16(E * I * H, 1.0 / std::sqrt(double(H)), seed + 5);
  p.w_down = random_bf16(E * H * I, 1.0 / std::sqrt(double(I)), seed + 6);
  if (Is > 0) {
    p.shared_gate = random_bf16(Is * H, 1.0 / std::sqrt(double(H)), seed + 7);
    p.shared_up = random_bf16(Is * H, 1.0 / std::sqrt(double(H)), seed + 8);
    p.shared_down = random_bf16(H * Is, 1.0 / std::sqrt(double(Is)), seed + 9);
  }
  return p;
}

reference::Weights HostProblem::reference_weights() const {
  return {reference::to_double(w_gate),      reference::to_double(w_up),
          reference::to_double(w_down),      reference::to_double(shared_gate),
          reference::to_double(shared_up),   reference::to_double(shared_down)};
}

reference::Routing HostProblem::reference_routing() const {
  return {topk_ids, reference::to_double(topk_weights)};
}

std::vector<double> HostProblem::reference_x() const { return reference::to_double(x); }

}  // namespace mok
