// A downstream program: plans a routing and runs the CPU reference through the installed package.
#include <mok/mok.hpp>
#include <mok/testing.hpp>

#include <cstdio>

int main() {
  mok::MoeShape shape;
  shape.hidden = 64, shape.intermediate = 64, shape.num_experts = 4, shape.num_local_experts = 4, shape.top_k = 2;
  const mok::HostProblem p = mok::make_problem(shape, 16, mok::RoutingKind::uniform, 1);
  const mok::Plan plan = mok::plan_host(shape, p.tokens, p.topk_ids, 0);
  const auto y = mok::reference::forward(shape, p.tokens, p.reference_x(), p.reference_routing(), p.reference_weights());
  if (plan.routed_rows() != 32 || y.size() != 16 * 64) return 1;
  std::printf("downstream ok: mok %s, %lld routed rows\n", mok::kVersion, static_cast<long long>(plan.routed_rows()));
  return 0;
}
