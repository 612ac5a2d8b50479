// mok_bench's problem: one preset's inputs on the device, and the fp64 reference of a few
// of its tokens (the fused layer's sampled-token check).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "mok/mok.hpp"
#include "mok/testing.hpp"
#include "mok_bench/support.cuh"

namespace mok_bench {

// One preset's inputs on the device: x, the weights (+ shared expert), dy, the routing.
struct Problem {
  mok::MoeShape s;
  std::int64_t T = 0;
  Arena arena;
  std::uint16_t *x = nullptr, *gate = nullptr, *up = nullptr, *down = nullptr, *dy = nullptr;
  std::uint16_t *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
  std::int32_t* ids = nullptr;
  float* weights = nullptr;
  std::vector<std::int32_t> host_ids;
  std::vector<float> host_weights;

  Problem(const mok::Preset& p, std::uint32_t seed, std::vector<std::int32_t> ids_, std::vector<float> weights_,
          cudaStream_t stream)
      : s(p.shape), T(p.tokens), host_ids(std::move(ids_)), host_weights(std::move(weights_)) {
    const std::int64_t H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k, Is = s.shared_intermediate;
    if (static_cast<std::int64_t>(host_ids.size()) != T * k || static_cast<std::int64_t>(host_weights.size()) != T * k)
      throw mok::Error("mok_bench: routing of preset " + p.name + " needs " + std::to_string(T * k) + " ids and weights, got " +
                       std::to_string(host_ids.size()) + " and " + std::to_string(host_weights.size()));
    auto filled = [&](std::size_t n, Tensor t) {
      auto* ptr = arena.alloc<std::uint16_t>(n);
      fill(ptr, n, tensor_seed(seed, t), stream);
      return ptr;
    };
    x = filled(T * H, Tensor::x);
    gate = filled(E * I * H, Tensor::gate);
    up = filled(E * I * H, Tensor::up);
    down = filled(E * H * I, Tensor::down);
    dy = filled(T * H, Tensor::dy);
    if (s.has_shared()) {
      shared_gate = filled(Is * H, Tensor::shared_gate);
      shared_up = filled(Is * H, Tensor::shared_up);
      shared_down = filled(H * Is, Tensor::shared_down);
    }
    ids = arena.alloc<std::int32_t>(T * k);
    weights = arena.alloc<float>(T * k);
    CUDA_OK(cudaMemcpyAsync(ids, host_ids.data(), T * k * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(weights, host_weights.data(), T * k * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
  }
};

mok::TensorView bf16_view(const void* p, std::initializer_list<std::int64_t> shape) {
  return mok::TensorView::contiguous(p, mok::DType::bf16, mok::Device::cuda(0), shape);
}

// The fp64 reference of a few tokens: their experts' weights are copied back and
// renumbered into a small problem. fp8: the FP8 recipe's reference (reference::forward_fp8:
// per-token and per-expert-block quantization, so the sample's is the full problem's).
double check_sampled_tokens(const Problem& pr, const std::uint16_t* d_y, bool fp8 = false) {
  const mok::MoeShape& s = pr.s;
  const std::int64_t H = s.hidden, I = s.intermediate, k = s.top_k, Is = s.shared_intermediate, T = pr.T;
  const std::vector<std::int64_t> tokens{0, T / 3, T / 2, T - 1};
  mok::MoeShape small = s;
  std::vector<std::int32_t> experts;
  mok::reference::Routing r;
  std::vector<double> x, y_gpu;
  auto fetch = [](const std::uint16_t* src, std::int64_t offset, std::int64_t n) {
    std::vector<mok::bf16> host(n);
    CUDA_OK(cudaMemcpy(host.data(), src + offset, n * 2, cudaMemcpyDeviceToHost));
    return mok::reference::to_double(host);
  };
  mok::reference::Weights w;
  if (s.has_shared())
    w.shared_gate = fetch(pr.shared_gate, 0, Is * H), w.shared_up = fetch(pr.shared_up, 0, Is * H),
    w.shared_down = fetch(pr.shared_down, 0, H * Is);
  for (std::int64_t t : tokens) {
    auto xr = fetch(pr.x, t * H, H), yr = fetch(d_y, t * H, H);
    x.insert(x.end(), xr.begin(), xr.end());
    y_gpu.insert(y_gpu.end(), yr.begin(), yr.end());
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = pr.host_ids[t * k + j];
      auto at = std::find(experts.begin(), experts.end(), e);
      if (e >= 0 && at == experts.end()) {
        experts.push_back(e);
        auto g = fetch(pr.gate, e * I * H, I * H), u = fetch(pr.up, e * I * H, I * H), d = fetch(pr.down, e * H * I, H * I);
        w.gate.insert(w.gate.end(), g.begin(), g.end());
        w.up.insert(w.up.end(), u.begin(), u.end());
        w.down.insert(w.down.end(), d.begin(), d.end());
        at = experts.end() - 1;
      }
      r.ids.push_back(e < 0 ? -1 : static_cast<std::int32_t>(at - experts.begin()));
      r.weights.push_back(pr.host_weights[t * k + j]);
    }
  }
  // The sampled tokens' experts, renumbered; at least k of them so that top_k <= E holds
  // (unused extra experts get zero weights).
  small.num_experts = small.num_local_experts = std::max<std::int64_t>(k, static_cast<std::int64_t>(experts.size()));
  w.gate.resize(small.num_experts * I * H), w.up.resize(small.num_experts * I * H), w.down.resize(small.num_experts * H * I);
  const std::int64_t n = static_cast<std::int64_t>(tokens.size());
  const auto ref = fp8 ? mok::reference::forward_fp8(small, n, x, r, w) : mok::reference::forward(small, n, x, r, w);
  return mok::reference::relative_error(y_gpu, ref);
}

}  // namespace mok_bench
