// Gradient buffers of a GpuProblem and the comparisons the backward tests make.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gpu_problem.hpp"
#include "mok/bf16.hpp"
#include "mok/reference.hpp"
#include "mok/validate.hpp"

namespace mok::testing {

inline std::vector<bf16> random_bf16(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16::from_float(dist(rng));
  return v;
}

// Gradient buffers of one problem; weight gradients in bf16 or f32.
struct GpuGrads {
  const GpuProblem& gpu;
  bool f32;
  DeviceBuffer<bf16> dy, dx;
  DeviceBuffer<float> d_weights;
  DeviceBuffer<std::uint8_t> d_gate, d_up, d_down, d_sgate, d_sup, d_sdown;

  GpuGrads(const GpuProblem& g, const std::vector<bf16>& dy_host, bool fp32)
      : gpu(g), f32(fp32), dy(dy_host), dx(dy_host.size()), d_weights(g.host.topk_weights.size()),
        d_gate(g.host.w_gate.size() * elem()), d_up(g.host.w_up.size() * elem()), d_down(g.host.w_down.size() * elem()),
        d_sgate(g.host.shared_gate.size() * elem()), d_sup(g.host.shared_up.size() * elem()),
        d_sdown(g.host.shared_down.size() * elem()) {}

  std::size_t elem() const { return f32 ? 4 : 2; }

  BackwardArgs args() const {
    const MoeShape& s = gpu.host.shape;
    const Device d = Device::cuda(0);
    const std::int64_t T = gpu.host.tokens, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k;
    const std::int64_t Is = s.shared_intermediate;
    const DType g = f32 ? DType::f32 : DType::bf16;
    BackwardArgs b;
    b.dy = TensorView::contiguous(dy.get(), DType::bf16, d, {T, H});
    b.dx = TensorView::contiguous(dx.get(), DType::bf16, d, {T, H});
    b.d_topk_weights = TensorView::contiguous(d_weights.get(), DType::f32, d, {T, k});
    b.d_w_gate = TensorView::contiguous(d_gate.get(), g, d, {E, I, H});
    b.d_w_up = TensorView::contiguous(d_up.get(), g, d, {E, I, H});
    b.d_w_down = TensorView::contiguous(d_down.get(), g, d, {E, H, I});
    if (s.has_shared()) {
      b.d_shared_gate = TensorView::contiguous(d_sgate.get(), g, d, {Is, H});
      b.d_shared_up = TensorView::contiguous(d_sup.get(), g, d, {Is, H});
      b.d_shared_down = TensorView::contiguous(d_sdown.get(), g, d, {H, Is});
    }
    return b;
  }

  // NaN everywhere a kernel writes (bf16 mode; f32 gradients are accumulated into).
  void poison() const {
    cudaMemset(dx.get(), 0xff, dx.size() * 2);
    cudaMemset(d_weights.get(), 0xff, d_weights.size() * 4);
    if (!f32)
      for (auto* b : {&d_gate, &d_up, &d_down, &d_sgate, &d_sup, &d_sdown}) cudaMemset(b->get(), 0xff, b->size());
    cudaDeviceSynchronize();
  }

  static std::vector<double> as_double(const DeviceBuffer<std::uint8_t>& b, bool fp32) {
    const auto bytes = b.download();
    std::vector<double> out(bytes.size() / (fp32 ? 4 : 2));
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (fp32) {
        float f;
        std::memcpy(&f, bytes.data() + 4 * i, 4);
        out[i] = f;
      } else {
        bf16 h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = h.to_float();
      }
    }
    return out;
  }

  // Every gradient's bytes, for bitwise comparisons (routed_weights false: all but the routed
  // experts' weight gradients).
  std::vector<std::uint8_t> snapshot(bool routed_weights = true) const {
    std::vector<std::uint8_t> all;
    auto add = [&](const void* p, std::size_t n) {
      std::vector<std::uint8_t> tmp(n);
      if (n) cudaMemcpy(tmp.data(), p, n, cudaMemcpyDeviceToHost);
      all.insert(all.end(), tmp.begin(), tmp.end());
    };
    add(dx.get(), dx.size() * 2);
    add(d_weights.get(), d_weights.size() * 4);
    if (routed_weights)
      for (auto* b : {&d_gate, &d_up, &d_down}) add(b->get(), b->size());
    for (auto* b : {&d_sgate, &d_sup, &d_sdown}) add(b->get(), b->size());
    return all;
  }
};

inline double cosine(const std::vector<double>& a, const std::vector<double>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) ab += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
  if (aa == 0 && bb == 0) return 1.0;
  return ab / std::sqrt(aa * bb);
}

// Bars of expect_close: the relative error and the cosine to the reference.
struct Bars {
  double max_rel = 1e-2, min_cos = 0.9999;
};

inline void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref, const char* name,
                         Bars bars = {}) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::int64_t bad = 0;
  for (double v : got) bad += !std::isfinite(v);
  EXPECT_EQ(bad, 0) << name << ": " << what << " has unwritten or non-finite values";
  const double rel = reference::relative_error(got, ref), cos = cosine(got, ref);
  EXPECT_LE(rel, bars.max_rel) << name << ": " << what;
  EXPECT_GE(cos, bars.min_cos) << name << ": " << what;
  ::testing::Test::RecordProperty(std::string("rel_error_") + what, std::to_string(rel));
  if (std::getenv("MOK_TEST_PRINT_ERRORS"))  // (calibrating bars: every comparison's figures)
    std::printf("%s %s: relative error %.5f, cosine %.6f\n", name, what, rel, cos);
}

// Every gradient of g against ref (base: what f32 gradients held before the call, or empty);
// routed_bars: the routed experts' weight gradients' bars where they differ from the others'.
inline void expect_gradients(const reference::Gradients& ref, const GpuGrads& g, const char* name,
                             const std::vector<std::vector<double>>& base = {}, Bars dx_bars = {}, Bars bars = {},
                             std::optional<Bars> routed_bars = std::nullopt) {
  expect_close("dx", reference::to_double(g.dx.download()), ref.x, name, dx_bars);
  expect_close("d_topk_weights", reference::to_double(g.d_weights.download()), ref.topk_weights, name, bars);
  const std::vector<const DeviceBuffer<std::uint8_t>*> bufs{&g.d_gate, &g.d_up, &g.d_down, &g.d_sgate, &g.d_sup, &g.d_sdown};
  const std::vector<const std::vector<double>*> refs{&ref.w.gate, &ref.w.up, &ref.w.down, &ref.w.shared_gate,
                                                     &ref.w.shared_up, &ref.w.shared_down};
  const char* names[] = {"d_w_gate", "d_w_up", "d_w_down", "d_shared_gate", "d_shared_up", "d_shared_down"};
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    if (refs[i]->empty()) continue;
    auto got = GpuGrads::as_double(*bufs[i], g.f32);
    if (!base.empty())
      for (std::size_t j = 0; j < got.size(); ++j) got[j] -= base[i][j];
    expect_close(names[i], got, *refs[i], name, i < 3 ? routed_bars.value_or(bars) : bars);
  }
}

inline void check_gradients(const HostProblem& host, const GpuGrads& g, const std::vector<bf16>& dy, const char* name,
                            const std::vector<std::vector<double>>& base = {}) {
  const auto ref = reference::backward(host.shape, host.tokens, host.reference_x(), host.reference_routing(),
                                       host.reference_weights(), reference::to_double(dy));
  expect_gradients(ref, g, name, base);
}

inline TensorView saved_view(const DeviceBuffer<bf16>& saved) {
  return TensorView::contiguous(saved.get(), DType::bf16, Device::cuda(0), {static_cast<std::int64_t>(saved.size())});
}

}  // namespace mok::testing
