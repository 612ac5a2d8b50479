// The main job: runs one preset and prints a checked result.
//
// Without a GPU it runs the CPU reference (forward + backward) and checks its gradients
// by directional finite differences. With a Hopper GPU it also runs the fused forward and
// the fused backward and checks every output and gradient against the reference, and (H and
// I multiples of 128) the FP8 forward against the FP8 recipe's fp64 reference.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>

#include "mok/mok.hpp"
#include "mok/testing.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// <grad, v> against (L(p + eps v) - L(p - eps v)) / 2 eps along a random direction v.
template <typename Loss>
double directional_error(std::vector<double>& param, const std::vector<double>& grad, Loss loss,
                         std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  std::vector<double> v(param.size());
  for (double& e : v) e = normal(rng);
  double analytic = 0;
  for (std::size_t i = 0; i < v.size(); ++i) analytic += grad[i] * v[i];
  const std::vector<double> saved = param;
  const double eps = 1e-6;
  for (std::size_t i = 0; i < v.size(); ++i) param[i] = saved[i] + eps * v[i];
  const double up = loss();
  for (std::size_t i = 0; i < v.size(); ++i) param[i] = saved[i] - eps * v[i];
  const double down = loss();
  param = saved;
  const double fd = (up - down) / (2 * eps);
  return std::abs(fd - analytic) / std::max(1e-12, std::abs(fd) + std::abs(analytic));
}

int usage() {
  std::printf("usage: mok_demo [--preset NAME] [--seed N]\npresets:");
  for (const mok::Preset& p : mok::presets()) std::printf(" %s", p.name.c_str());
  std::printf("\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string preset_name = "small";
  std::uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--preset") && i + 1 < argc) preset_name = argv[++i];
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) seed = std::stoull(argv[++i]);
    else return usage();
  }
  const mok::Preset& preset = mok::find_preset(preset_name);
  const mok::MoeShape& s = preset.shape;
  const std::int64_t T = preset.tokens;

  const int gpus = mok::cuda_device_count();
  const bool hopper = gpus > 0 && mok::query_device(0).is_hopper();
  if (gpus == 0) std::printf("No CUDA GPU found: running the CPU reference only.\n");
  else std::printf("GPU 0: %s (%s)\n", mok::query_device(0).name.c_str(), hopper ? "Hopper" : "not Hopper: CPU reference only");

  const double fwd_flops = mok::forward_flops(s, T * s.top_k, T);
  if (fwd_flops > 2e11) {
    std::printf("Preset '%s' needs %.1f TFLOP for one forward: too large for the CPU reference.\n"
                "Use --preset tiny or small here; time the large presets with mok_bench.\n",
                preset.name.c_str(), fwd_flops / 1e12);
    return 1;
  }
  std::printf("preset %s: T=%lld H=%lld I=%lld E=%lld k=%lld shared I=%lld limit=%s\n",
              preset.name.c_str(), (long long)T, (long long)s.hidden, (long long)s.intermediate,
              (long long)s.num_experts, (long long)s.top_k, (long long)s.shared_intermediate,
              s.swiglu_limit ? std::to_string(*s.swiglu_limit).c_str() : "none");

  const mok::HostProblem p = mok::make_problem(s, T, mok::RoutingKind::uniform, seed);
  const mok::Plan plan = mok::plan_host(s, T, p.topk_ids, 0);
  std::printf("plan: %lld routed rows, %lld padded rows, %lld M-tiles of %lld\n",
              (long long)plan.routed_rows(), (long long)plan.padded_rows(), (long long)plan.num_tiles(),
              (long long)plan.block_m);

  auto x = p.reference_x();
  auto routing = p.reference_routing();
  auto w = p.reference_weights();
  auto t0 = Clock::now();
  const auto y = mok::reference::forward(s, T, x, routing, w);
  const double t_fwd = seconds_since(t0);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> dy(y.size());
  for (double& v : dy) v = mok::round_to_bf16(normal(rng));  // representable: the GPU takes dy in bf16
  t0 = Clock::now();
  const auto g = mok::reference::backward(s, T, x, routing, w, dy);
  const double t_bwd = seconds_since(t0);
  std::printf("CPU reference (fp64): forward %.2f s (%.2f GFLOP/s), backward %.2f s\n", t_fwd,
              fwd_flops / t_fwd / 1e9, t_bwd);

  auto loss = [&] {
    const auto yy = mok::reference::forward(s, T, x, routing, w);
    double l = 0;
    for (std::size_t i = 0; i < yy.size(); ++i) l += yy[i] * dy[i];
    return l;
  };
  bool ok = true;
  const struct { const char* name; std::vector<double>* param; const std::vector<double>* grad; } checks[] = {
      {"x", &x, &g.x}, {"topk_weights", &routing.weights, &g.topk_weights}, {"w_down", &w.down, &g.w.down},
      {"w_gate", &w.gate, &g.w.gate}, {"shared_up", &w.shared_up, &g.w.shared_up}};
  for (const auto& c : checks) {
    if (c.param->empty()) continue;
    const double err = directional_error(*c.param, *c.grad, loss, rng);
    std::printf("  d/d%-13s directional finite difference: rel. error %.1e\n", c.name, err);
    ok = ok && err < 1e-6;
  }

  if (hopper) {
    // The fused forward on GPU 0, against the fp64 reference computed above.
    const mok::Device gpu = mok::Device::cuda(0);
    auto upload = [](const auto& host) {
      void* d = nullptr;
      const std::size_t bytes = host.size() * sizeof(host[0]);
      cudaMalloc(&d, std::max<std::size_t>(bytes, 16));
      cudaMemcpy(d, host.data(), bytes, cudaMemcpyHostToDevice);
      return d;
    };
    const std::int64_t H = s.hidden, I = s.intermediate, E = s.num_experts, k = s.top_k, Is = s.shared_intermediate;
    mok::ForwardArgs a;
    a.x = mok::TensorView::contiguous(upload(p.x), mok::DType::bf16, gpu, {T, H});
    a.topk_ids = mok::TensorView::contiguous(upload(p.topk_ids), mok::DType::i32, gpu, {T, k});
    a.topk_weights = mok::TensorView::contiguous(upload(p.topk_weights), mok::DType::f32, gpu, {T, k});
    a.w_gate = mok::TensorView::contiguous(upload(p.w_gate), mok::DType::bf16, gpu, {E, I, H});
    a.w_up = mok::TensorView::contiguous(upload(p.w_up), mok::DType::bf16, gpu, {E, I, H});
    a.w_down = mok::TensorView::contiguous(upload(p.w_down), mok::DType::bf16, gpu, {E, H, I});
    if (s.has_shared()) {
      a.shared_gate = mok::TensorView::contiguous(upload(p.shared_gate), mok::DType::bf16, gpu, {Is, H});
      a.shared_up = mok::TensorView::contiguous(upload(p.shared_up), mok::DType::bf16, gpu, {Is, H});
      a.shared_down = mok::TensorView::contiguous(upload(p.shared_down), mok::DType::bf16, gpu, {H, Is});
    }
    std::vector<mok::bf16> y_gpu(T * H);
    a.y = mok::TensorView::contiguous(upload(y_gpu), mok::DType::bf16, gpu, {T, H});
    cudaMemset(a.y.data, 0xff, T * H * 2);  // poison: unwritten rows stay NaN
    mok::Workspace ws(s, T);
    mok::forward(a, ws, nullptr);
    ws.check(nullptr);
    cudaMemcpy(y_gpu.data(), a.y.data, T * H * 2, cudaMemcpyDeviceToHost);
    const double err = mok::reference::relative_error(mok::reference::to_double(y_gpu), y);
    cudaEvent_t start, stop;
    cudaEventCreate(&start), cudaEventCreate(&stop);
    cudaEventRecord(start);
    constexpr int kRuns = 20;
    for (int i = 0; i < kRuns; ++i) mok::forward(a, ws, nullptr);
    cudaEventRecord(stop);
    ws.check(nullptr);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    std::printf("fused forward on GPU 0: rel. error vs fp64 reference %.2e, %.1f us per call (mean of %d)\n", err,
                1e3 * ms / kRuns, kRuns);
    ok = ok && err <= 1e-2;

    // The FP8 forward (Precision::fp8): the routed weights quantized on the GPU, y against the
    // fp64 reference of the same recipe (reference::forward_fp8) and, for scale, the exact layer.
    if (H % 128 == 0 && I % 128 == 0) {
      mok::Fp8Weights q;
      auto quantized = [&](const mok::TensorView& bf16, std::int64_t rows, std::int64_t cols, mok::TensorView& values,
                           mok::TensorView& exponents) {
        values = mok::TensorView::contiguous(upload(std::vector<std::uint8_t>(E * rows * cols)), mok::DType::u8, gpu,
                                             {E, rows, cols});
        exponents = mok::TensorView::contiguous(upload(std::vector<std::int32_t>(E * (rows / 128) * (cols / 128))),
                                                mok::DType::i32, gpu, {E, rows / 128, cols / 128});
        mok::fp8::quantize_weights(bf16, values, exponents, nullptr);
      };
      quantized(a.w_gate, I, H, q.gate, q.gate_exponents);
      quantized(a.w_up, I, H, q.up, q.up_exponents);
      quantized(a.w_down, H, I, q.down, q.down_exponents);
      mok::ForwardArgs a8 = a;
      a8.fp8 = q;
      mok::Config fp8;
      fp8.precision = mok::Precision::fp8;
      mok::Workspace ws8(s, T, fp8);
      cudaMemset(a.y.data, 0xff, T * H * 2);
      mok::forward(a8, ws8, nullptr);
      ws8.check(nullptr);
      cudaMemcpy(y_gpu.data(), a.y.data, T * H * 2, cudaMemcpyDeviceToHost);
      const auto y8 = mok::reference::to_double(y_gpu);
      const double err8 = mok::reference::relative_error(y8, mok::reference::forward_fp8(s, T, x, routing, w));
      std::printf("fused FP8 forward on GPU 0: rel. error vs the FP8 recipe's fp64 reference %.2e, vs the exact layer "
                  "%.2e\n", err8, mok::reference::relative_error(y8, y));
      ok = ok && err8 <= 1e-2;  // (the recipe's operands, other sums: tests/test_gpu_forward_fp8.cpp)
      for (const mok::TensorView* v : {&q.gate, &q.up, &q.down, &q.gate_exponents, &q.up_exponents, &q.down_exponents})
        cudaFree(v->data);
    }

    // The fused backward (the forward saves its pre-activations), every gradient against
    // the fp64 reference gradients computed above.
    mok::Workspace wt(s, T, {}, mok::Training::save);
    std::vector<mok::bf16> dy_bf16(dy.size()), dx_gpu(T * H);
    for (std::size_t i = 0; i < dy.size(); ++i) dy_bf16[i] = mok::bf16::from_float(static_cast<float>(dy[i]));
    const auto saved = mok::TensorView::contiguous(upload(std::vector<mok::bf16>(wt.saved_elements())),
                                                   mok::DType::bf16, gpu, {wt.saved_elements()});
    mok::BackwardArgs b;
    b.dy = mok::TensorView::contiguous(upload(dy_bf16), mok::DType::bf16, gpu, {T, H});
    b.dx = mok::TensorView::contiguous(upload(dx_gpu), mok::DType::bf16, gpu, {T, H});
    b.d_topk_weights = mok::TensorView::contiguous(upload(p.topk_weights), mok::DType::f32, gpu, {T, k});
    b.d_w_gate = mok::TensorView::contiguous(upload(p.w_gate), mok::DType::bf16, gpu, {E, I, H});
    b.d_w_up = mok::TensorView::contiguous(upload(p.w_up), mok::DType::bf16, gpu, {E, I, H});
    b.d_w_down = mok::TensorView::contiguous(upload(p.w_down), mok::DType::bf16, gpu, {E, H, I});
    if (s.has_shared()) {
      b.d_shared_gate = mok::TensorView::contiguous(upload(p.shared_gate), mok::DType::bf16, gpu, {Is, H});
      b.d_shared_up = mok::TensorView::contiguous(upload(p.shared_up), mok::DType::bf16, gpu, {Is, H});
      b.d_shared_down = mok::TensorView::contiguous(upload(p.shared_down), mok::DType::bf16, gpu, {H, Is});
    }
    cudaEventRecord(start);
    mok::forward(a, wt, nullptr, saved);
    mok::backward(a, b, wt, nullptr, saved);
    cudaEventRecord(stop);
    wt.check(nullptr);
    cudaEventElapsedTime(&ms, start, stop);
    auto download_bf16 = [](const mok::TensorView& v) {
      std::vector<mok::bf16> host(v.numel());
      cudaMemcpy(host.data(), v.data, host.size() * 2, cudaMemcpyDeviceToHost);
      return mok::reference::to_double(host);
    };
    std::vector<float> d_weights(T * k);
    cudaMemcpy(d_weights.data(), b.d_topk_weights.data, d_weights.size() * 4, cudaMemcpyDeviceToHost);
    struct Gradient { const char* name; std::vector<double> got; const std::vector<double>* ref; };
    std::vector<Gradient> grads{{"dx", download_bf16(b.dx), &g.x},
                                {"d_topk_weights", mok::reference::to_double(d_weights), &g.topk_weights},
                                {"d_w_gate", download_bf16(b.d_w_gate), &g.w.gate},
                                {"d_w_up", download_bf16(b.d_w_up), &g.w.up},
                                {"d_w_down", download_bf16(b.d_w_down), &g.w.down}};
    if (s.has_shared()) {
      grads.push_back({"d_shared_gate", download_bf16(*b.d_shared_gate), &g.w.shared_gate});
      grads.push_back({"d_shared_up", download_bf16(*b.d_shared_up), &g.w.shared_up});
      grads.push_back({"d_shared_down", download_bf16(*b.d_shared_down), &g.w.shared_down});
    }
    double worst = 0;
    const char* worst_name = "";
    for (const Gradient& gr : grads) {
      const double e = mok::reference::relative_error(gr.got, *gr.ref);
      if (!(e <= worst)) worst = e, worst_name = gr.name;
    }
    std::printf("fused forward + backward on GPU 0: worst gradient rel. error vs fp64 reference %.2e (%s), "
                "%.1f us for the pair\n", worst, worst_name, 1e3 * ms);
    ok = ok && worst <= 1e-2;
    for (const mok::TensorView* v : std::initializer_list<const mok::TensorView*>{&saved, &b.dy, &b.dx, &b.d_topk_weights, &b.d_w_gate, &b.d_w_up, &b.d_w_down})
      cudaFree(v->data);
    if (s.has_shared())
      for (const auto& v : {b.d_shared_gate, b.d_shared_up, b.d_shared_down}) cudaFree(v->data);
    for (void* ptr : {a.x.data, a.topk_ids.data, a.topk_weights.data, a.w_gate.data, a.w_up.data, a.w_down.data, a.y.data})
      cudaFree(ptr);
    if (s.has_shared())
      for (const auto& v : {a.shared_gate, a.shared_up, a.shared_down}) cudaFree(v->data);
  }
  std::printf(ok ? "CHECK PASSED\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
} catch (const mok::Error& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 2;
}
