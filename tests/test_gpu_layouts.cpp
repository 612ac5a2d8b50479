// Callers' layouts: one workspace serving every token count up to its max_tokens, and
// weights as frameworks keep them (gate and up as the halves of one [E, 2I, H] tensor,
// strided views, their gradients written in the same layout), each against the plain
// layout bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "gpu_grads.hpp"
#include "gpu_problem.hpp"
#include "mok/backward.hpp"
#include "mok/forward.hpp"

namespace mok {
namespace {

using testing::check_gradients;
using testing::DeviceBuffer;
using testing::GpuGrads;
using testing::GpuProblem;
using testing::random_bf16;
using testing::saved_view;
using testing::shape_of;

// One Training::save workspace for up to 1200 tokens serves smaller calls (forward and
// backward, the saved tensor and scratch sized for each T): every gradient is bitwise that
// of a workspace made for exactly T, a small T after a large one included.
TEST(Backward, OneWorkspaceServesEveryTokenCountBitwise) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 128, 0, RoutingKind::uniform});
  Workspace big(s, 1200, {}, Training::save);
  for (std::int64_t T : {1200, 5, 640, 1}) {
    const HostProblem host = make_problem(s, T, RoutingKind::skewed, 900 + T);
    GpuProblem gpu(host);
    const auto dy = random_bf16(host.x.size(), 901 + T);
    GpuGrads grads(gpu, dy, false);
    auto run = [&](Workspace& ws) {
      ASSERT_EQ(ws.saved_elements(T), saved_elements(s, T));
      DeviceBuffer<bf16> saved(ws.saved_elements(T));
      DeviceBuffer<std::uint8_t> fwd(ws.forward_scratch_bytes(T)), bwd(ws.backward_scratch_bytes(DType::bf16, T));
      auto u8 = [](const DeviceBuffer<std::uint8_t>& b) {
        return TensorView::contiguous(b.get(), DType::u8, Device::cuda(0), {static_cast<std::int64_t>(b.size())});
      };
      forward(gpu.args(), ws, nullptr, saved_view(saved), u8(fwd));
      grads.poison();
      backward(gpu.args(), grads.args(), ws, nullptr, saved_view(saved), u8(bwd));
      ws.check(nullptr);
    };
    Workspace exact(s, T, {}, Training::save);
    run(exact);
    const auto want = grads.snapshot();
    if (T == 5) check_gradients(host, grads, dy, "T = 5");
    run(big);
    EXPECT_TRUE(grads.snapshot() == want) << "T = " << T;
  }
}

// Weights as frameworks keep them: gate and up as the two halves of one [E, 2I, H] tensor
// (strided views, no copy), W_down with a row pitch; the gradients of gate and up written into
// the two halves of one [E, 2I, H] tensor (which also hold the backward's dy rows and w h, as
// separate gradient tensors do: the same scratch). Every output bitwise equal to separate
// contiguous tensors.
TEST(Backward, ConcatenatedGateUpAndStridedViewsBitwiseLikeContiguous) {
  MOK_REQUIRE_HOPPER();
  const MoeShape s = shape_of({"", 0, 512, 256, 8, 2, 128, 0, RoutingKind::uniform});
  const std::int64_t T = 700, E = s.num_local_experts, H = s.hidden, I = s.intermediate, pitch = I + 64;
  const HostProblem host = make_problem(s, T, RoutingKind::skewed, 4242);
  GpuProblem gpu(host);
  const auto dy = random_bf16(host.x.size(), 4243);
  GpuGrads grads(gpu, dy, false);
  Workspace ws(s, T, {}, Training::save);
  DeviceBuffer<bf16> saved(ws.saved_elements());
  DeviceBuffer<std::uint8_t> bwd_scratch(ws.backward_scratch_bytes(DType::bf16));
  const auto scratch = TensorView::contiguous(bwd_scratch.get(), DType::u8, Device::cuda(0),
                                              {static_cast<std::int64_t>(bwd_scratch.size())});
  auto run = [&](const ForwardArgs& a, const BackwardArgs& b) {
    gpu.poison_output();
    forward(a, ws, nullptr, saved_view(saved));
    grads.poison();
    backward(a, b, ws, nullptr, saved_view(saved), scratch);
    ws.check(nullptr);
  };
  run(gpu.args(), grads.args());
  const auto y = gpu.y.download(), dx = grads.dx.download();
  const auto d_gate = grads.d_gate.download(), d_up = grads.d_up.download(), d_down = grads.d_down.download();

  std::vector<bf16> gate_up(E * 2 * I * H), down(E * H * pitch, bf16::from_float(7.0f));
  for (std::int64_t e = 0; e < E; ++e) {
    std::copy_n(host.w_gate.begin() + e * I * H, I * H, gate_up.begin() + e * 2 * I * H);
    std::copy_n(host.w_up.begin() + e * I * H, I * H, gate_up.begin() + e * 2 * I * H + I * H);
    for (std::int64_t r = 0; r < H; ++r)
      std::copy_n(host.w_down.begin() + (e * H + r) * I, I, down.begin() + (e * H + r) * pitch);
  }
  DeviceBuffer<bf16> gate_up_dev(gate_up), down_dev(down), d_gate_up(gate_up.size());
  auto view = [&](bf16* base, std::int64_t rows, std::int64_t cols, std::array<std::int64_t, 4> stride) {
    TensorView v = TensorView::contiguous(base, DType::bf16, Device::cuda(0), {E, rows, cols});
    v.stride = stride;
    return v;
  };
  ForwardArgs a = gpu.args();
  a.w_gate = view(gate_up_dev.get(), I, H, {2 * I * H, H, 1});
  a.w_up = view(gate_up_dev.get() + I * H, I, H, {2 * I * H, H, 1});
  a.w_down = view(down_dev.get(), H, I, {H * pitch, pitch, 1});
  BackwardArgs b = grads.args();
  b.d_w_gate = view(d_gate_up.get(), I, H, {2 * I * H, H, 1});
  b.d_w_up = view(d_gate_up.get() + I * H, I, H, {2 * I * H, H, 1});
  run(a, b);
  EXPECT_TRUE(testing::same_bits(gpu.y.download(), y));
  EXPECT_TRUE(testing::same_bits(grads.dx.download(), dx));
  EXPECT_TRUE(grads.d_down.download() == d_down);
  const auto got = d_gate_up.download();
  std::vector<std::uint8_t> got_gate(d_gate.size()), got_up(d_up.size());
  for (std::int64_t e = 0; e < E; ++e) {
    std::memcpy(got_gate.data() + e * I * H * 2, got.data() + e * 2 * I * H, I * H * 2);
    std::memcpy(got_up.data() + e * I * H * 2, got.data() + e * 2 * I * H + I * H, I * H * 2);
  }
  EXPECT_TRUE(got_gate == d_gate) << "d_w_gate";
  EXPECT_TRUE(got_up == d_up) << "d_w_up";
}

}  // namespace
}  // namespace mok
