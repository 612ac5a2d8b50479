// The validation tests' fixture: valid arguments over host memory, declared on cpu (validation
// never dereferences them), and the check that a call throws mok::Error with a given message.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "mok/error.hpp"
#include "mok/validate.hpp"

namespace mok::testing {

inline void expect_error(const std::function<void()>& call, const std::string& expected) {
  try {
    call();
    ADD_FAILURE() << "no mok::Error; expected: " << expected;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << expected;
  }
}

inline MoeShape good_shape() {
  MoeShape s;
  s.hidden = 128, s.intermediate = 64, s.num_experts = 8, s.num_local_experts = 4, s.top_k = 2;
  return s;
}

// Valid arguments over host memory, declared on cpu (validation never dereferences them).
struct Fixture {
  MoeShape shape = good_shape();
  static constexpr std::int64_t T = 5;
  alignas(16) static inline char memory[1 << 20];
  ForwardArgs args;
  BackwardArgs grads;

  Fixture() {
    const Device cpu = Device::cpu();
    const std::int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_local_experts, k = shape.top_k;
    args.x = TensorView::contiguous(memory, DType::bf16, cpu, {T, H});
    args.topk_ids = TensorView::contiguous(memory, DType::i32, cpu, {T, k});
    args.topk_weights = TensorView::contiguous(memory, DType::f32, cpu, {T, k});
    args.w_gate = TensorView::contiguous(memory, DType::bf16, cpu, {El, I, H});
    args.w_up = TensorView::contiguous(memory, DType::bf16, cpu, {El, I, H});
    args.w_down = TensorView::contiguous(memory, DType::bf16, cpu, {El, H, I});
    args.y = TensorView::contiguous(memory, DType::bf16, cpu, {T, H});
    grads.dy = args.x, grads.dx = args.x, grads.d_topk_weights = args.topk_weights;
    grads.d_w_gate = args.w_gate, grads.d_w_up = args.w_up, grads.d_w_down = args.w_down;
  }
  void forward() const { validate_forward_args("mok::forward", shape, args, Device::cpu()); }
  void backward() const { validate_backward_args("mok::backward", shape, args, grads, Device::cpu()); }
};

}  // namespace mok::testing
