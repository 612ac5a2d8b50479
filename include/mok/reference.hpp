// CPU reference of the whole layer (docs/design.md §2) in fp64: the oracle every kernel is
// checked against. It computes the *global* layer (all E experts), so one reference
// serves one GPU, N virtual ranks and N real ranks alike. No intermediate rounding.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/types.hpp"

namespace mok::reference {

// All E experts, row-major, in fp64.
struct Weights {
  std::vector<double> gate;         // [E, I, H]
  std::vector<double> up;           // [E, I, H]
  std::vector<double> down;         // [E, H, I]
  std::vector<double> shared_gate;  // [I_s, H]  (empty without a shared expert)
  std::vector<double> shared_up;    // [I_s, H]
  std::vector<double> shared_down;  // [H, I_s]
};

struct Routing {
  std::vector<std::int32_t> ids;  // [T, k] global expert ids, -1 = no expert
  std::vector<double> weights;    // [T, k]
};

struct Gradients {
  std::vector<double> x;             // [T, H]
  std::vector<double> topk_weights;  // [T, k]; 0 where the id is -1
  Weights w;                         // same shapes as the weights
};

// y[t] = shared(x[t]) + sum_j w[t,j] * down_e(silu(clamp(gate_e x)) * clamp(up_e x)).
// Throws mok::Error on inconsistent sizes or an expert id outside [-1, E).
std::vector<double> forward(const MoeShape& shape, std::int64_t tokens,
                            std::span<const double> x, const Routing& routing,
                            const Weights& weights);

// Gradients of sum(y * dy). Where the clamp is active its input gets zero gradient.
// The forward of the FP8 recipe the FP8 path will implement (DeepSeek-V3's, power-of-two
// scales; mok/fp8.hpp), in fp64 arithmetic on the quantized operands: x quantized per 1 x 128
// block of each token, the routed experts' W_gate, W_up, W_down per 128 x 128 block, the
// SwiGLU output h per 1 x 128 block of each routed row; the shared expert unquantized. It
// differs from an FP8 kernel only in the order and precision of its sums (fp32 there).
std::vector<double> forward_fp8(const MoeShape& shape, std::int64_t tokens, std::span<const double> x,
                                const Routing& routing, const Weights& weights);

Gradients backward(const MoeShape& shape, std::int64_t tokens, std::span<const double> x,
                   const Routing& routing, const Weights& weights, std::span<const double> dy);

// The backward of the FP8 recipe (forward_fp8's, with the dgrad GEMMs in E4M3; what the FP8
// backward will implement), in fp64: the routed experts' pre-activations are FP8 GEMM1's (x
// per 1 x 128, weights per 128 x 128); dh = weight * W_down^T dy with dy quantized per 1 x 128
// of the token; d_topk_weight = <W_down^T dy, h> on the same operands; dx gets W_gate^T dgate +
// W_up^T dup with dgate and dup rounded to bf16 (the values the weight gradients read) and
// quantized per 1 x 128 of the pair's row (the transposed
// weights have the same 128 x 128 blocks, so the same values); the weight gradients are the
// BF16 backward's products of the unquantized x, dy, h and dgate / dup (straight through the
// forward's quantization of h). The shared expert is the BF16 backward's. fp8_dgrad = false:
// the BF16 backward on the FP8 forward's pre-activations (unquantized dy, weights, dgate, dup
// in the dgrad products): what the layer computes today for Precision::fp8 with Training::save.
// fp8_wgrad = true (BackwardArgs::fp8_weight_gradients): the routed weight gradients of E4M3
// operands instead, over each expert's rows in plan order (the pairs by token) in blocks of 128
// from its first: dy and dgate | dup (rounded to bf16) per column and block, x and w h (rounded
// to bf16) per 128 x 128 block; and the backward then reads the routed pre-activations as the
// FP8 forward saves them (bf16; a clamped value at the limit), as the kernel does.
Gradients backward_fp8(const MoeShape& shape, std::int64_t tokens, std::span<const double> x,
                       const Routing& routing, const Weights& weights, std::span<const double> dy,
                       bool fp8_dgrad = true, bool fp8_wgrad = false);

// Helpers to feed bf16 / f32 host data to the reference.
std::vector<double> to_double(std::span<const bf16> values);
std::vector<double> to_double(std::span<const float> values);

// ||a - b|| / ||b||; infinity if either holds a NaN or infinity.
double relative_error(std::span<const double> a, std::span<const double> b);

}  // namespace mok::reference
