// A HostProblem uploaded to GPU 0 as the ForwardArgs of one rank (EP = 1).
#pragma once

#include <cmath>
#include <initializer_list>
#include <ostream>
#include <vector>

#include "gpu_support.hpp"
#include "mok/bf16.hpp"
#include "mok/problem.hpp"
#include "mok/routing.hpp"
#include "mok/validate.hpp"

namespace mok::testing {

// One test case of the layer: sizes, shared expert (I_s, 0 = none), clamp and routing.
struct Case {
  const char* name;
  std::int64_t tokens, hidden, inter, experts, top_k, shared;
  float limit;  // 0: none
  RoutingKind routing;
};

// GoogleTest prints a parameter by its name instead of its bytes.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

inline MoeShape shape_of(const Case& c) {
  MoeShape s;
  s.hidden = c.hidden, s.intermediate = c.inter, s.num_experts = s.num_local_experts = c.experts, s.top_k = c.top_k;
  s.shared_intermediate = c.shared;
  if (c.limit > 0) s.swiglu_limit = c.limit;
  return s;
}

// The routing cases every layer pass is tested on (docs/design.md §6): uniform, skewed, all
// tokens on one expert with k = 1, experts with zero tokens, -1 padding, ragged T and
// sizes, E_l = 1, shared expert, clamp. Each test adds its own cases (e.g. T = 1).
inline std::vector<Case> routing_cases(std::initializer_list<Case> extra) {
  std::vector<Case> cases{
      Case{"uniform", 700, 512, 256, 8, 2, 0, 0, RoutingKind::uniform},
      Case{"skewed", 900, 256, 384, 8, 2, 0, 0, RoutingKind::skewed},
      Case{"one_expert_k1", 500, 256, 256, 4, 1, 0, 0, RoutingKind::one_expert},
      Case{"empty_experts", 400, 256, 256, 16, 2, 0, 0, RoutingKind::first_half},
      Case{"padded", 333, 256, 256, 8, 4, 0, 0, RoutingKind::padded},
      Case{"ragged_k1", 129, 320, 192, 8, 1, 0, 0, RoutingKind::uniform},
      Case{"single_expert", 257, 256, 256, 1, 1, 0, 0, RoutingKind::uniform},
      Case{"shared", 300, 256, 256, 8, 2, 384, 0, RoutingKind::uniform},
      Case{"shared_padded_clamp", 301, 256, 256, 8, 2, 192, 0.75f, RoutingKind::padded},
      Case{"clamp", 400, 512, 256, 8, 2, 0, 0.5f, RoutingKind::uniform}};
  cases.insert(cases.end(), extra);
  return cases;
}

struct GpuProblem {
  const HostProblem& host;
  DeviceBuffer<bf16> x, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, y;
  DeviceBuffer<std::int32_t> ids;
  DeviceBuffer<float> weights;

  explicit GpuProblem(const HostProblem& p)
      : host(p), x(p.x), w_gate(p.w_gate), w_up(p.w_up), w_down(p.w_down), shared_gate(p.shared_gate),
        shared_up(p.shared_up), shared_down(p.shared_down), y(p.x.size()), ids(p.topk_ids), weights(p.topk_weights) {}

  ForwardArgs args() const {
    const MoeShape& s = host.shape;
    const Device d = Device::cuda(0);
    const std::int64_t T = host.tokens, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k;
    const std::int64_t Is = s.shared_intermediate;
    ForwardArgs a;
    a.x = TensorView::contiguous(x.get(), DType::bf16, d, {T, H});
    a.topk_ids = TensorView::contiguous(ids.get(), DType::i32, d, {T, k});
    a.topk_weights = TensorView::contiguous(weights.get(), DType::f32, d, {T, k});
    a.w_gate = TensorView::contiguous(w_gate.get(), DType::bf16, d, {E, I, H});
    a.w_up = TensorView::contiguous(w_up.get(), DType::bf16, d, {E, I, H});
    a.w_down = TensorView::contiguous(w_down.get(), DType::bf16, d, {E, H, I});
    if (s.has_shared()) {
      a.shared_gate = TensorView::contiguous(shared_gate.get(), DType::bf16, d, {Is, H});
      a.shared_up = TensorView::contiguous(shared_up.get(), DType::bf16, d, {Is, H});
      a.shared_down = TensorView::contiguous(shared_down.get(), DType::bf16, d, {H, Is});
    }
    a.y = TensorView::contiguous(y.get(), DType::bf16, d, {T, H});
    return a;
  }

  // Fills y with NaN so that a row the kernel never writes cannot pass.
  void poison_output(cudaStream_t stream = nullptr) const {
    cudaMemsetAsync(y.get(), 0xff, y.size() * sizeof(bf16), stream);
    cudaStreamSynchronize(stream);
  }

  std::vector<double> output() const { return reference::to_double(y.download()); }
};

struct Comparison {
  double rel_error;
  std::int64_t non_finite;
};

inline Comparison compare(const std::vector<double>& got, const std::vector<double>& ref) {
  std::int64_t bad = 0;
  for (double v : got) bad += !std::isfinite(v);
  return {reference::relative_error(got, ref), bad};
}

// New tokens and routing for `first`'s experts (graph replays with new data, same weights).
inline HostProblem same_experts(const HostProblem& first, RoutingKind kind, std::uint64_t seed) {
  HostProblem next = make_problem(first.shape, first.tokens, kind, seed);
  next.w_gate = first.w_gate, next.w_up = first.w_up, next.w_down = first.w_down;
  next.shared_gate = first.shared_gate, next.shared_up = first.shared_up, next.shared_down = first.shared_down;
  return next;
}

}  // namespace mok::testing
