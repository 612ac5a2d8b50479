// mok_bench's implementations: the planner alone, and the fused layer (one GPU or an EP
// group of one rank) on one preset's problem (mok_bench/problem.cuh), with its sampled-token check.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "mok/mok.hpp"
#include "mok/testing.hpp"
#include "mok_bench/problem.cuh"
#include "mok_bench/support.cuh"

namespace mok_bench {

Record bench_plan(const Options& o, const mok::Preset& p, cudaStream_t stream) {
  const mok::MoeShape& s = p.shape;
  const auto ids = mok::make_routing(mok::RoutingKind::uniform, p.tokens, s.num_experts, s.top_k, 7);
  Arena arena;
  std::int32_t* d_ids = arena.alloc<std::int32_t>(ids.size());
  // Async copy on the bench stream: a plain cudaMemcpy from pageable memory may return
  // before its DMA lands, and a non-blocking stream does not wait for it.
  CUDA_OK(cudaMemcpyAsync(d_ids, ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  mok::DevicePlan plan(s, p.tokens);
  const auto view = mok::TensorView::contiguous(d_ids, mok::DType::i32, mok::Device::cuda(0), {p.tokens, s.top_k});
  mok::plan_device(view, 0, plan, stream);
  const mok::Plan got = plan.to_host(stream, 0);  // correctness first
  const mok::Plan expected = mok::plan_host(s, p.tokens, ids, 0);
  if (got.row_pair != expected.row_pair || got.tile_row != expected.tile_row)
    throw mok::Error("mok_bench: device plan differs from the host plan on preset " + p.name);
  const auto ms = time_iterations(o.warmup, o.iters, stream, [&] { mok::plan_device(view, 0, plan, stream); });
  return make_record(p, "plan", "plan", ms, static_cast<std::size_t>(plan.capacity_rows() * 4 * 3), o.iters);
}

// The fused layer on one Problem: one pass ("fwd" or "fwd+bwd") as a step that can be
// timed, measured for peak memory, or run once with its outputs kept for a checksum.
// impl "mok": the one-GPU kernels; "mok-ep1": the same layer through the expert-parallel
// machinery (routing exchange, peer pulls, push combine) as an EP group of one rank;
// "mok-fp8": Precision::fp8 — the FP8 forward, and with "fwd+bwd" the backward with the FP8
// dgrad (BackwardArgs::fp8); "mok-fp8-bf16dgrad": the same forward, the backward's dgrad in
// bf16; "mok-fp8-wgrad": "mok-fp8" with the weight gradients in E4M3 too
// (BackwardArgs::fp8_weight_gradients; pass fwd+bwd). The routed weights are quantized once when the layer is made
// (mok::fp8::quantize_experts: three kernels, W and W^T from one read each; not in the timed pass), except in
// "mok-fp8-step": "mok-fp8-wgrad" with that quantization in every pass too — a training step with
// one micro-batch an optimizer step, whose weights are new each step. "mok-pp": "mok"
// with Config::pingpong (the forward's ping-pong consumers; the same bits). "mok-recompute":
// "mok" with Training::recompute (pass fwd+bwd: no saved tensor, the backward runs GEMM1 again;
// the same bits); "mok-1block": "mok" with Config::backward_column_blocks = 1 (the backward's x
// rows whole in one launch; the same bits; "mok-fp8-wgrad-1block" the same for "mok-fp8-wgrad", and
// "mok-fp8-wgrad-2block" with two: on H <= 2048 its default is one, mok::default_backward_column_blocks;
// "mok-fp8-2block" and "mok-fp8-bf16dgrad-2block" the same for "mok-fp8" and "mok-fp8-bf16dgrad");
// "mok-recompute-1block" / "mok-recompute-2block":
// "mok-recompute" with Config::backward_column_blocks = 1 / 2 (the recompute's GEMM1 on whole
// rows, then the backward in one or two column blocks — its default two where I > H, else one;
// the same bits).
// An impl without its "-1block" / "-2block" suffix (the column blocks it asks for, one_gpu_config):
// the layer it runs.
inline std::string_view without_blocks(std::string_view impl) {
  return impl.ends_with("-1block") || impl.ends_with("-2block") ? impl.substr(0, impl.size() - 7) : impl;
}
// The impls that are a training step only (pass fwd+bwd).
inline bool is_training_step(const std::string& impl) {
  const std::string_view layer = without_blocks(impl);
  return layer == "mok-fp8-bf16dgrad" || layer == "mok-fp8-wgrad" || layer == "mok-fp8-step" || layer == "mok-recompute";
}

class FusedLayer {
  static mok::Config one_gpu_config(const mok::Config& ep_config, bool fp8, const std::string& impl) {  // (--interleave-rows, replay_launches: all)
    mok::Config c;
    c.pingpong = impl == "mok-pp";
    c.backward_column_blocks = impl.ends_with("-1block") ? 1 : impl.ends_with("-2block") ? 2 : 0;
    c.interleave_rows = fp8 ? 0 : ep_config.interleave_rows;
    c.replay_launches = ep_config.replay_launches;
    c.precision = fp8 ? mok::Precision::fp8 : mok::Precision::bf16;
    return c;
  }
  static bool fp8_forward(const std::string& impl, const std::string& pass) {
    if (is_training_step(impl) && pass != "fwd+bwd")
      throw mok::Error("mok_bench: " + impl + " is a training step (pass fwd+bwd), got pass '" + pass + "'");
    const std::string_view layer = without_blocks(impl);
    return layer == "mok-fp8" || layer == "mok-fp8-bf16dgrad" || layer == "mok-fp8-wgrad" || layer == "mok-fp8-step";
  }

 public:
  FusedLayer(const Problem& pr, const std::string& impl, const std::string& pass, const mok::Config& ep_config,
             cudaStream_t stream)
      : pr_(pr), ep1_(impl == "mok-ep1"), bwd_(pass == "fwd+bwd"), fp8_(fp8_forward(impl, pass)),
        recompute_(impl.starts_with("mok-recompute")), stream_(stream), pool_(stream),
        ws_(pr.s, pr.T, one_gpu_config(ep_config, fp8_, impl),
            !bwd_ ? mok::Training::off : recompute_ ? mok::Training::recompute : mok::Training::save) {
    const mok::MoeShape& s = pr.s;
    const std::int64_t T = pr.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                       Is = s.shared_intermediate;
    const mok::Device dev = mok::Device::cuda(0);
    y_ = arena_.alloc<std::uint16_t>(T * H);
    a_.x = bf16_view(pr.x, {T, H});
    a_.topk_ids = mok::TensorView::contiguous(pr.ids, mok::DType::i32, dev, {T, k});
    a_.topk_weights = mok::TensorView::contiguous(pr.weights, mok::DType::f32, dev, {T, k});
    a_.w_gate = bf16_view(pr.gate, {E, I, H});
    a_.w_up = bf16_view(pr.up, {E, I, H});
    a_.w_down = bf16_view(pr.down, {E, H, I});
    if (s.has_shared())
      a_.shared_gate = bf16_view(pr.shared_gate, {Is, H}), a_.shared_up = bf16_view(pr.shared_up, {Is, H}),
      a_.shared_down = bf16_view(pr.shared_down, {H, Is});
    a_.y = bf16_view(y_, {T, H});
    if (fp8_) {
      const std::int64_t Hb = H / 128, Ib = I / 128;
      auto u8 = [&](std::int64_t n) { return arena_.alloc<std::uint8_t>(n); };
      auto i32 = [&](std::int64_t n) { return arena_.alloc<std::int32_t>(n); };
      mok::Fp8Weights w;
      w.gate = mok::TensorView::contiguous(u8(E * I * H), mok::DType::u8, dev, {E, I, H});
      w.up = mok::TensorView::contiguous(u8(E * I * H), mok::DType::u8, dev, {E, I, H});
      w.down = mok::TensorView::contiguous(u8(E * H * I), mok::DType::u8, dev, {E, H, I});
      w.gate_exponents = mok::TensorView::contiguous(i32(E * Ib * Hb), mok::DType::i32, dev, {E, Ib, Hb});
      w.up_exponents = mok::TensorView::contiguous(i32(E * Ib * Hb), mok::DType::i32, dev, {E, Ib, Hb});
      w.down_exponents = mok::TensorView::contiguous(i32(E * Hb * Ib), mok::DType::i32, dev, {E, Hb, Ib});
      a_.fp8 = w;
      requantize_ = impl == "mok-fp8-step";
      wgrad_ = without_blocks(impl) == "mok-fp8-wgrad" || requantize_;
      if (bwd_ && (without_blocks(impl) == "mok-fp8" || wgrad_)) {
        mok::Fp8DgradWeights d;
        d.down_t = mok::TensorView::contiguous(u8(E * I * H), mok::DType::u8, dev, {E, I, H});
        d.gate_up_t = mok::TensorView::contiguous(u8(2 * E * H * I), mok::DType::u8, dev, {E, H, 2 * I});
        d.down_t_exponents = mok::TensorView::contiguous(i32(E * Ib * Hb), mok::DType::i32, dev, {E, Ib, Hb});
        d.gate_up_t_exponents = mok::TensorView::contiguous(i32(2 * E * Hb * Ib), mok::DType::i32, dev, {E, Hb, 2 * Ib});
        dgrad_ = d;
      }
      quantize_weights();
    }
    if (ep1_) {
      group_ = std::make_unique<mok::VirtualRanks>(s, T, ep_config, bwd_ ? mok::Training::save : mok::Training::off);
      if (bwd_) {  // the EP machinery owns its buffers: fixed tensors, peak not reported
        saved_fixed_ = arena_.alloc<std::uint16_t>(ws_.saved_elements());
        outputs_ = {arena_.alloc<std::uint16_t>(T * H), arena_.alloc<float>(T * k), arena_.alloc<std::uint16_t>(E * I * H),
                    arena_.alloc<std::uint16_t>(E * I * H), arena_.alloc<std::uint16_t>(E * H * I)};
        if (s.has_shared())
          outputs_.d_shared_gate = arena_.alloc<std::uint16_t>(Is * H), outputs_.d_shared_up = arena_.alloc<std::uint16_t>(Is * H),
          outputs_.d_shared_down = arena_.alloc<std::uint16_t>(H * Is);
      }
    }
  }

  // The routed weights quantized (Precision::fp8): the forward's, and the dgrad's where it runs.
  void quantize_weights() {
    mok::fp8::quantize_experts(a_.w_gate, a_.w_up, a_.w_down, *a_.fp8, dgrad_ ? &*dgrad_ : nullptr, stream_);
  }

  // One pass. With keep, the outputs stay allocated (poisoned before the pass) for the
  // caller to read; release_kept() frees them.
  void step(bool keep = false) {
    if (keep) CUDA_OK(cudaMemsetAsync(y_, 0xff, pr_.T * pr_.s.hidden * 2, stream_));
    if (ep1_) return step_ep1(keep);
    if (requantize_) quantize_weights();  // (mok-fp8-step: new weights every step)
    if (!bwd_) {
      forward(std::nullopt);
      return;
    }
    const mok::MoeShape& s = pr_.s;
    const std::int64_t T = pr_.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                       Is = s.shared_intermediate;
    // One training step's tensors: saved (forward to backward), then dx, d_topk_weights and
    // the bf16 weight gradients, allocated when the backward runs (as autograd does); the
    // W_gate and W_up gradients as one block and dx a buffer of its own, as mok.moe allocates
    // them (the backward's rows may then span both and continue in dx: the smaller scratch).
    auto* saved = recompute_ ? nullptr : pool_.alloc<std::uint16_t>(ws_.saved_elements());
    forward(saved ? std::optional(saved_view(saved)) : std::nullopt);
    auto* gate_up = pool_.alloc<std::uint16_t>(2 * E * I * H);
    Outputs g{pool_.alloc<std::uint16_t>(T * H), pool_.alloc<float>(T * k), gate_up, gate_up + E * I * H,
              pool_.alloc<std::uint16_t>(E * H * I)};
    if (s.has_shared())
      g.d_shared_gate = pool_.alloc<std::uint16_t>(Is * H), g.d_shared_up = pool_.alloc<std::uint16_t>(Is * H),
      g.d_shared_down = pool_.alloc<std::uint16_t>(H * Is);
    if (keep) poison(g);
    const std::int64_t bytes = ws_.backward_scratch_bytes(mok::DType::bf16, T, /*gate_up_adjacent=*/true,
                                                          /*dx_apart=*/true, /*fp8_dgrad=*/dgrad_.has_value(),
                                                          /*fp8_wgrad=*/wgrad_);
    auto* scratch = pool_.alloc<std::uint8_t>(bytes);
    mok::BackwardArgs b = grads(g);
    b.fp8 = dgrad_;
    b.fp8_weight_gradients = wgrad_;
    mok::backward(a_, b, ws_, stream_, saved ? std::optional(saved_view(saved)) : std::nullopt, u8(scratch, bytes));
    pool_.free(scratch);
    if (saved) pool_.free(saved);
    if (keep) outputs_ = g, kept_ = true;
    else for (void* q : g.all()) pool_.free(q);
  }

  // (name, bytes) of every output of the last kept pass.
  using Buffers = std::vector<std::pair<std::string, std::pair<void*, std::size_t>>>;
  Buffers outputs() const {
    Buffers out{{"y", {y_, pr_.T * pr_.s.hidden * 2}}};
    if (!bwd_) return out;
    Buffers g = gradient_buffers(outputs_);
    out.insert(out.end(), g.begin(), g.end());
    return out;
  }

  void release_kept() {
    if (kept_ && !ep1_)
      for (void* q : outputs_.all()) pool_.free(q);
    kept_ = false;
  }

  // Raises if a kernel recorded an error.
  void check_status() {
    if (ep1_) group_->check(stream_);
    else ws_.check(stream_);
  }

  // What one pass needs beyond its inputs and weights: the workspace, y and the pool's
  // high-water mark (EP machinery: not measured, 0).
  std::size_t peak_bytes() {
    if (ep1_) return 0;
    const std::size_t high = pool_.high_water([&] { step(); });
    return static_cast<std::size_t>(ws_.bytes()) + 2 * pr_.T * pr_.s.hidden + high;
  }

  const std::uint16_t* y() const { return y_; }
  // The kept pass's dx and d_topk_weights, copied to the host.
  void copy_dx_and_d_topk_weights(std::vector<mok::bf16>* dx, std::vector<float>* dtw) const {
    dx->resize(pr_.T * pr_.s.hidden), dtw->resize(pr_.T * pr_.s.top_k);
    CUDA_OK(cudaMemcpy(dx->data(), outputs_.dx, dx->size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dtw->data(), outputs_.d_topk_weights, dtw->size() * 4, cudaMemcpyDeviceToHost));
  }

 private:
  struct Outputs {
    std::uint16_t* dx = nullptr;
    float* d_topk_weights = nullptr;
    std::uint16_t *d_w_gate = nullptr, *d_w_up = nullptr, *d_w_down = nullptr;
    std::uint16_t *d_shared_gate = nullptr, *d_shared_up = nullptr, *d_shared_down = nullptr;
    // The pool allocations of step() (to free): d_w_up lies in d_w_gate's block. (The EP
    // group's outputs come from the arena and are never freed one by one.)
    std::vector<void*> all() const {
      std::vector<void*> v{dx, d_topk_weights, d_w_gate, d_w_down};
      for (void* q : {d_shared_gate, d_shared_up, d_shared_down})
        if (q) v.push_back(q);
      return v;
    }
  };

  static mok::TensorView u8(void* p, std::int64_t bytes) {
    return mok::TensorView::contiguous(p, mok::DType::u8, mok::Device::cuda(0), {bytes});
  }
  mok::TensorView saved_view(std::uint16_t* at) const { return bf16_view(at, {ws_.saved_elements()}); }

  void forward(const std::optional<mok::TensorView>& saved) {
    auto* scratch = pool_.alloc<std::uint8_t>(ws_.forward_scratch_bytes());
    mok::forward(a_, ws_, stream_, saved, u8(scratch, ws_.forward_scratch_bytes()));
    pool_.free(scratch);
  }

  // (name, bytes) of a backward's outputs, as the layer writes them.
  Buffers gradient_buffers(const Outputs& g) const {
    const mok::MoeShape& s = pr_.s;
    const std::size_t T = pr_.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                      Is = s.shared_intermediate;
    Buffers out{{"dx", {g.dx, T * H * 2}},
                {"d_topk_weights", {g.d_topk_weights, T * k * 4}},
                {"d_w_gate", {g.d_w_gate, E * I * H * 2}},
                {"d_w_up", {g.d_w_up, E * I * H * 2}},
                {"d_w_down", {g.d_w_down, E * H * I * 2}}};
    if (s.has_shared())
      out.insert(out.end(), {{"d_shared_gate", {g.d_shared_gate, Is * H * 2}},
                             {"d_shared_up", {g.d_shared_up, Is * H * 2}},
                             {"d_shared_down", {g.d_shared_down, H * Is * 2}}});
    return out;
  }

  void poison(const Outputs& g) {
    for (const auto& [name, buffer] : gradient_buffers(g))
      CUDA_OK(cudaMemsetAsync(buffer.first, 0xff, buffer.second, stream_));
  }

  mok::BackwardArgs grads(const Outputs& g) const {
    const mok::MoeShape& s = pr_.s;
    const std::int64_t T = pr_.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                       Is = s.shared_intermediate;
    mok::BackwardArgs b;
    b.dy = bf16_view(pr_.dy, {T, H});
    b.dx = bf16_view(g.dx, {T, H});
    b.d_topk_weights = mok::TensorView::contiguous(g.d_topk_weights, mok::DType::f32, mok::Device::cuda(0), {T, k});
    b.d_w_gate = bf16_view(g.d_w_gate, {E, I, H});
    b.d_w_up = bf16_view(g.d_w_up, {E, I, H});
    b.d_w_down = bf16_view(g.d_w_down, {E, H, I});
    if (s.has_shared())
      b.d_shared_gate = bf16_view(g.d_shared_gate, {Is, H}), b.d_shared_up = bf16_view(g.d_shared_up, {Is, H}),
      b.d_shared_down = bf16_view(g.d_shared_down, {H, Is});
    return b;
  }

  void step_ep1(bool keep) {
    if (!bwd_) {
      group_->forward(std::span<const mok::ForwardArgs>(&a_, 1), stream_);
      return;
    }
    if (keep) poison(outputs_);
    const mok::TensorView sv = saved_view(saved_fixed_);
    const mok::BackwardArgs b = grads(outputs_);
    group_->forward(std::span<const mok::ForwardArgs>(&a_, 1), stream_, std::span<const mok::TensorView>(&sv, 1));
    group_->backward(std::span<const mok::ForwardArgs>(&a_, 1), std::span<const mok::BackwardArgs>(&b, 1), stream_,
                     std::span<const mok::TensorView>(&sv, 1));
    kept_ = keep;
  }

  const Problem& pr_;
  const bool ep1_, bwd_, fp8_, recompute_;
  cudaStream_t stream_;
  Arena arena_;
  StepPool pool_;
  mok::Workspace ws_;
  std::unique_ptr<mok::VirtualRanks> group_;
  mok::ForwardArgs a_;
  std::optional<mok::Fp8DgradWeights> dgrad_;  // mok-fp8, fwd+bwd
  bool wgrad_ = false;                          // mok-fp8-wgrad, mok-fp8-step
  bool requantize_ = false;                     // mok-fp8-step
  std::uint16_t* y_ = nullptr;
  std::uint16_t* saved_fixed_ = nullptr;
  Outputs outputs_;
  bool kept_ = false;
};

// Standalone "mok" / "mok-ep1": own inputs (uniform routing), sampled fp64 check of the
// forward, finiteness of the backward's outputs, then timing and peak.
Record bench_mok(const Options& o, const mok::Preset& p, const std::string& impl, const std::string& pass,
                 cudaStream_t stream) {
  const mok::MoeShape& s = p.shape;
  auto ids = mok::make_routing(mok::RoutingKind::uniform, p.tokens, s.num_experts, s.top_k, 7);
  auto weights = mok::make_routing_weights(ids, s.top_k, 7);
  const Problem pr(p, 11, std::move(ids), std::move(weights), stream);
  FusedLayer layer(pr, impl, pass, o.ep_config, stream);
  layer.step(/*keep=*/true);
  layer.check_status();
  const double err = o.check ? check_sampled_tokens(pr, layer.y(), impl.starts_with("mok-fp8")) : 0.0;
  if (!(err <= 1e-2))
    throw mok::Error("mok_bench: fused forward wrong on " + p.name + ": relative error " + std::to_string(err));
  if (pass == "fwd+bwd") {
    std::vector<float> dtw;
    std::vector<mok::bf16> dx;
    layer.copy_dx_and_d_topk_weights(&dx, &dtw);
    for (mok::bf16 v : dx)
      if (!std::isfinite(v.to_float())) throw mok::Error("mok_bench: fused backward wrote a non-finite dx on " + p.name);
    for (float v : dtw)
      if (!std::isfinite(v)) throw mok::Error("mok_bench: fused backward wrote a non-finite d_topk_weights on " + p.name);
  }
  layer.release_kept();
  const std::size_t peak = layer.peak_bytes();
  const std::vector<float> ms = time_iterations(o.warmup, o.iters, stream, [&] { layer.step(); });
  layer.check_status();
  return make_record(p, impl, pass, ms, peak, o.iters);
}

}  // namespace mok_bench
