// The fused backward of the layer on one GPU (EP = 1).
#pragma once

#include <cuda_runtime_api.h>

#include <optional>

#include "mok/forward.hpp"
#include "mok/validate.hpp"

namespace mok {

// Gradients of sum(y * dy) for the forward call `fwd` (its y is not read and may be
// empty): dx, d_topk_weights and every weight gradient, in one persistent kernel after
// the device planner and the copy of x and dy rows into plan order. Weight gradients are
// written (bf16) or accumulated into (f32, main_grad style). Deterministic: bitwise
// identical across runs and SM counts; stream-ordered with no host synchronisation.
//
// `saved`: the tensor the forward filled (Training::save; 16-byte aligned). The backward
// consumes it: the pre-activations are replaced by their gradients (a second backward from it
// is an error, reported by Workspace::check), and with BackwardArgs::fp8_weight_gradients its
// routed rows then hold the weight gradients' E4M3 operands. Without it the workspace must be
// Training::recompute and GEMM1 runs again first.
// `scratch`: 1-D u8 of at least workspace.backward_scratch_bytes(d_w_gate's dtype), or none
// (see Workspace). With bf16 weight gradients the W_gate / W_up gradient buffers also serve
// as scratch until the kernel writes them: they must not overlap any other argument. dx does
// too (routed dy rows that miss the gradients, or the shared expert's dx rows) when it shares
// no byte with any other argument; else the call needs the larger scratch figure
// (backward_scratch_bytes without dx_apart). With a shared expert dx must not overlap x or dy
// (an error): the shared expert's tasks read them while the combine may write dx.
void backward(const ForwardArgs& fwd, const BackwardArgs& bwd, Workspace& workspace, cudaStream_t stream,
              const std::optional<TensorView>& saved = std::nullopt,
              const std::optional<TensorView>& scratch = std::nullopt);

}  // namespace mok
