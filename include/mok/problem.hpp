// A random layer problem on the host (bf16 data, as a GPU call would see it), for tests,
// benchmarks and examples, with the conversions the fp64 reference takes.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/reference.hpp"
#include "mok/routing.hpp"
#include "mok/types.hpp"

namespace mok {

struct HostProblem {
  MoeShape shape;
  std::int64_t tokens = 0;
  std::vector<bf16> x;                  // [T, H]
  std::vector<std::int32_t> topk_ids;   // [T, k]
  std::vector<float> topk_weights;      // [T, k]
  std::vector<bf16> w_gate, w_up;       // [E, I, H]: every expert (all ranks)
  std::vector<bf16> w_down;             // [E, H, I]
  std::vector<bf16> shared_gate, shared_up, shared_down;

  reference::Weights reference_weights() const;
  reference::Routing reference_routing() const;
  std::vector<double> reference_x() const;
};

// x ~ N(0, 1); gate/up ~ N(0, 1/H); down ~ N(0, 1/I): activations of order one at any size.
HostProblem make_problem(const MoeShape& shape, std::int64_t tokens, RoutingKind routing,
                         std::uint64_t seed);

}  // namespace mok
