// Argument validation shared by every entry point (fused kernels, reference, bindings).
// Each check throws mok::Error naming the entry point, the argument and the bad value.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "mok/types.hpp"

namespace mok {

// The routed experts' weights quantized for Precision::fp8 (mok::fp8::quantize_weights of
// w_gate, w_up and w_down): E4M3 values (u8, the shapes of the bf16 weights, contiguous) and
// the power-of-two exponents (i32) of their 128 x 128 blocks, [E_l, I / 128, H / 128] for gate
// and up, [E_l, H / 128, I / 128] for down.
struct Fp8Weights {
  TensorView gate, up, down;
  TensorView gate_exponents, up_exponents, down_exponents;
};

// The routed weights transposed for Precision::fp8's dgrad GEMMs (mok::fp8::quantize_dgrad_weights
// of w_gate, w_up and w_down; E4M3 tensor cores read K-major operands only): the values (u8,
// contiguous) of W_down^T [E_l, I, H] and of W_gate^T then W_up^T along K, [E_l, H, 2I], and the
// exponents (i32, contiguous) of their 128 x 128 blocks, [E_l, I / 128, H / 128] and
// [E_l, H / 128, 2I / 128]: the forward's blocks transposed, so the same values.
struct Fp8DgradWeights {
  TensorView down_t, gate_up_t;
  TensorView down_t_exponents, gate_up_t_exponents;
};

// The tensors of one forward call on one rank. Expert weights are this rank's E_l experts.
struct ForwardArgs {
  TensorView x;             // [T, H] bf16
  TensorView topk_ids;      // [T, k] i32 or i64; global expert id, -1 = no expert
  TensorView topk_weights;  // [T, k] f32
  TensorView w_gate;        // [E_l, I, H] bf16
  TensorView w_up;          // [E_l, I, H] bf16
  TensorView w_down;        // [E_l, H, I] bf16
  std::optional<TensorView> shared_gate;  // [I_s, H] bf16, iff shape.has_shared()
  std::optional<TensorView> shared_up;    // [I_s, H] bf16
  std::optional<TensorView> shared_down;  // [H, I_s] bf16
  TensorView y;             // [T, H] bf16, written
  // Precision::fp8 only (and then required by the forward): the routed weights as the FP8
  // GEMMs read them. w_gate, w_up and w_down are still given (the bf16 weights they were
  // quantized from; the backward, which ignores fp8, runs on them).
  std::optional<Fp8Weights> fp8;
};

// The extra tensors of one backward call. Weight gradients are bf16 (overwritten)
// or f32 (accumulated into, main_grad style); all of one call share one dtype.
struct BackwardArgs {
  TensorView dy;                 // [T, H] bf16
  TensorView dx;                 // [T, H] bf16, written
  TensorView d_topk_weights;     // [T, k] f32, written
  TensorView d_w_gate;           // like w_gate
  TensorView d_w_up;             // like w_up
  TensorView d_w_down;           // like w_down
  std::optional<TensorView> d_shared_gate;
  std::optional<TensorView> d_shared_up;
  std::optional<TensorView> d_shared_down;
  // Precision::fp8 only: given, the dgrad GEMMs (dh = dy W_down, dx = [dgate dup] [W_gate; W_up])
  // run in E4M3 (dy and dgate|dup quantized per 1 x 128 of a row where they are made; the
  // weight gradients stay bf16 GEMMs: reference::backward_fp8); absent, in bf16 on the bf16
  // weights (reference::backward_fp8 with fp8_dgrad = false).
  std::optional<Fp8DgradWeights> fp8;
  // Precision::fp8 with fp8 given: the routed weight gradients' GEMMs in E4M3 too (dW_down =
  // dy^T (w h), [dW_gate; dW_up] = [dg du]^T x, K = the expert's rows in plan order: the
  // gradient operand (dy, dg | du) scaled per channel and 128 rows, the activation (w h, x) per
  // 128 channels x 128 rows, each quantized transposed in one pass after it is made;
  // reference::backward_fp8 with fp8_wgrad = true). false: bf16 GEMMs (the default).
  bool fp8_weight_gradients = false;
};

// Checks dtypes, shapes, contiguity, alignment, null pointers and the declared device of
// every tensor; returns T. `where` names the caller in messages ("mok::forward").
// require_output = false: y may be left empty (the backward does not read it).
std::int64_t validate_forward_args(std::string_view where, const MoeShape& shape,
                                   const ForwardArgs& args, Device device, bool require_output = true);
void validate_backward_args(std::string_view where, const MoeShape& shape,
                            const ForwardArgs& fwd, const BackwardArgs& bwd, Device device);
// The same checks of x and topk_ids alone (what forward_rows() reads); returns T.
std::int64_t validate_rows_args(std::string_view where, const MoeShape& shape, const TensorView& x,
                                const TensorView& topk_ids, Device device);

// Checks every id of a host-resident [T, k] routing tensor: -1 <= id < E.
void validate_routing_values(std::string_view where, const MoeShape& shape,
                             const TensorView& topk_ids);

// Asks the CUDA runtime where `view.data` really lives and throws if that is not
// `view.device` (a host pointer passed as device memory, or the wrong GPU). A pointer this
// thread has already found on its declared GPU is not asked about again.
void check_pointer_location(std::string_view where, std::string_view arg, const TensorView& view);

}  // namespace mok
