// The FP8 tests' shared setup: a problem's routed weights quantized on the GPU for the forward
// (Fp8Weights) and for the backward's dgrad (Fp8DgradWeights), and a Precision::fp8 config.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "gpu_problem.hpp"
#include "mok/forward.hpp"
#include "mok/fp8.hpp"

namespace mok::testing {

// The routed weights of a problem quantized on the GPU (mok::fp8::quantize_weights and
// quantize_dgrad_weights).
struct QuantizedWeights {
  DeviceBuffer<std::uint8_t> gate, up, down, down_t, gate_up_t;
  DeviceBuffer<std::int32_t> gate_exponents, up_exponents, down_exponents, down_t_exponents, gate_up_t_exponents;
  Fp8Weights views;
  Fp8DgradWeights dgrad;

  // How the buffers are written: quantize_weights and quantize_dgrad_weights (six kernels), or
  // fp8::quantize_experts into poisoned buffers (bytes 0xa5, exponents 0x5a5a5a5a) — with the
  // dgrad operands (W and W^T from one kernel a matrix) or without (those stay poisoned).
  enum class By { separate, one_read, forward_only };
  explicit QuantizedWeights(const GpuProblem& gpu, By by = By::separate)
      : gate(gpu.w_gate.size()), up(gpu.w_up.size()), down(gpu.w_down.size()), down_t(gpu.w_down.size()),
        gate_up_t(2 * gpu.w_gate.size()), gate_exponents(blocks(gpu)), up_exponents(blocks(gpu)),
        down_exponents(blocks(gpu)), down_t_exponents(blocks(gpu)), gate_up_t_exponents(2 * blocks(gpu)) {
    const MoeShape& s = gpu.host.shape;
    const std::int64_t E = s.num_local_experts, H = s.hidden, I = s.intermediate, Hb = H / 128, Ib = I / 128;
    const Device d = Device::cuda(0);
    views.gate = TensorView::contiguous(gate.get(), DType::u8, d, {E, I, H});
    views.up = TensorView::contiguous(up.get(), DType::u8, d, {E, I, H});
    views.down = TensorView::contiguous(down.get(), DType::u8, d, {E, H, I});
    views.gate_exponents = TensorView::contiguous(gate_exponents.get(), DType::i32, d, {E, Ib, Hb});
    views.up_exponents = TensorView::contiguous(up_exponents.get(), DType::i32, d, {E, Ib, Hb});
    views.down_exponents = TensorView::contiguous(down_exponents.get(), DType::i32, d, {E, Hb, Ib});
    dgrad.down_t = TensorView::contiguous(down_t.get(), DType::u8, d, {E, I, H});
    dgrad.gate_up_t = TensorView::contiguous(gate_up_t.get(), DType::u8, d, {E, H, 2 * I});
    dgrad.down_t_exponents = TensorView::contiguous(down_t_exponents.get(), DType::i32, d, {E, Ib, Hb});
    dgrad.gate_up_t_exponents = TensorView::contiguous(gate_up_t_exponents.get(), DType::i32, d, {E, Hb, 2 * Ib});
    const ForwardArgs a = gpu.args();
    if (by != By::separate) {
      for (auto* b : {&gate, &up, &down, &down_t, &gate_up_t}) EXPECT_EQ(cudaSuccess, cudaMemset(b->get(), 0xa5, b->size()));
      for (auto* b : {&gate_exponents, &up_exponents, &down_exponents, &down_t_exponents, &gate_up_t_exponents})
        EXPECT_EQ(cudaSuccess, cudaMemset(b->get(), 0x5a, b->size() * sizeof(std::int32_t)));
      fp8::quantize_experts(a.w_gate, a.w_up, a.w_down, views, by == By::one_read ? &dgrad : nullptr, nullptr);
    } else {
      fp8::quantize_weights(a.w_gate, views.gate, views.gate_exponents, nullptr);
      fp8::quantize_weights(a.w_up, views.up, views.up_exponents, nullptr);
      fp8::quantize_weights(a.w_down, views.down, views.down_exponents, nullptr);
      fp8::quantize_dgrad_weights(a.w_gate, a.w_up, a.w_down, dgrad, nullptr);
    }
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  }
  static std::size_t blocks(const GpuProblem& gpu) {  // 128 x 128 blocks of one weight tensor
    const MoeShape& s = gpu.host.shape;
    return static_cast<std::size_t>(s.num_local_experts * (s.hidden / 128) * (s.intermediate / 128));
  }
};

inline ForwardArgs fp8_args(const GpuProblem& gpu, const QuantizedWeights& q) {
  ForwardArgs a = gpu.args();
  a.fp8 = q.views;
  return a;
}

// One FP8 forward on ws into gpu.y (poisoned first); y's bits.
inline std::vector<bf16> run_fp8(const GpuProblem& gpu, const QuantizedWeights& q, Workspace& ws) {
  gpu.poison_output();
  forward(fp8_args(gpu, q), ws, nullptr);
  ws.check(nullptr);
  return gpu.y.download();
}

inline Config fp8_config(int sms = 0) {
  Config c;
  c.precision = Precision::fp8;
  c.compute_sms = sms;
  return c;
}

}  // namespace mok::testing
