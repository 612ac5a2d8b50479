#include "mok/backward.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "cuda_check.hpp"
#include "kernels/backward/backward.cuh"
#include "launch_cache.hpp"
#include "layer_launch.hpp"
#include "mok/error.hpp"
#include "tensor_map.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::backward";
// Diagnostic builds of the FP8 weight gradients (MOK_DIAG_DEFINES; bench/NOTES.md): the dy and
// x gathers in plan order instead of the rank order (the same bits), or none of the four
// transposing passes at all, or none of the two whose sources the dgrad kernel writes (w h^T and
// dgate|dup^T: what quantizing them in the dh epilogue could save at most) — timing only: the weight
// gradients read stale operands.
#if defined(MOK_DIAG_WGRAD_PLAN_ORDER)
constexpr bool kWgradRankOrder = false;
#else
constexpr bool kWgradRankOrder = true;
#endif
#if defined(MOK_DIAG_WGRAD_NO_PASSES)
constexpr bool kWgradPasses = false;
#else
constexpr bool kWgradPasses = true;
#endif
#if defined(MOK_DIAG_WGRAD_NO_ACTIVATION_PASSES)
constexpr bool kWgradActivationPasses = false;
#else
constexpr bool kWgradActivationPasses = true;
#endif
constexpr const char* kScratchFrom =
    "Workspace::backward_scratch_bytes(d_w_gate's dtype, T, whether d_w_up directly follows d_w_gate, whether dx is "
    "apart from every other argument, whether fp8 is given, fp8_weight_gradients)";
using U = std::uint64_t;

// The nine tensor maps of one expert set: rows = the set's row count (capacity or padded
// tokens), dy/x = its A-side row sources, weights = its [E, I, H] / [E, H, I] matrices (strided
// views too).
// dy_hi, split: the dy rows from `split` on (null: none; detail::CallBuffers).
// x_columns: the x rows' columns (a column block's; H for the shared expert's x).
kernels::ExpertSetMaps set_maps(const void* dy, const void* dy_hi, std::int64_t split, const void* x,
                                std::int64_t dy_rows, const void* dgu, const void* hw, std::int64_t rows,
                                const TensorView& gate, const TensorView& up, const TensorView& down, std::int64_t H,
                                std::int64_t I, std::int64_t x_columns) {
  using detail::make_bf16_row_regions_map;
  using detail::make_bf16_tensor_map;
  using detail::make_bf16_weight_map;
  kernels::ExpertSetMaps m{};
  m.dy_k = make_bf16_row_regions_map(dy, dy_hi, U(H), U(dy_rows), U(split), kernels::kBoxK, "dy rows");
  m.down_mn = make_bf16_weight_map(down, kernels::kBoxMN, "w_down");
  m.dgu_k = make_bf16_tensor_map(dgu, {U(2 * I), U(rows)}, kernels::kBoxK, "d pre-activations");
  m.gate_mn = make_bf16_weight_map(gate, kernels::kBoxMN, "w_gate");
  m.up_mn = make_bf16_weight_map(up, kernels::kBoxMN, "w_up");
  m.dy_mn = make_bf16_row_regions_map(dy, dy_hi, U(H), U(dy_rows), U(split), kernels::kBoxMN, "dy rows");
  m.hw_mn = make_bf16_tensor_map(hw, {U(I), U(rows)}, kernels::kBoxMN, "w h");
  m.dgu_mn = make_bf16_tensor_map(dgu, {U(2 * I), U(rows)}, kernels::kBoxMN, "d pre-activations");
  m.x_mn = make_bf16_tensor_map(x, {U(x_columns), U(dy_rows)}, kernels::kBoxMN, "x rows");
  return m;
}

// Store maps of bf16 weight gradients (f32 ones are accumulated with plain loads/stores).
void set_gradient_maps(kernels::ExpertSetMaps& m, const TensorView& d_gate, const TensorView& d_up,
                       const TensorView& d_down) {
  using detail::make_bf16_weight_map;
  m.d_gate = make_bf16_weight_map(d_gate, kernels::kBoxMN, "d_w_gate");
  m.d_up = make_bf16_weight_map(d_up, kernels::kBoxMN, "d_w_up");
  m.d_down = make_bf16_weight_map(d_down, kernels::kBoxMN, "d_w_down");
}

// Two spaces of E_l I H bf16 elements each that the W_gate / W_up gradients cover entirely
// (the backward may keep its routed dy rows and w h there: it writes them last, after every
// task that reads those rows): the two tensors when contiguous, or the two halves of the
// [E_l, 2I, H] tensor whose gate and up halves they are; else none.
std::pair<void*, void*> gradient_row_spaces(const BackwardArgs& b, const MoeShape& s) {
  if (b.d_w_gate.dtype != DType::bf16) return {nullptr, nullptr};
  if (b.d_w_gate.is_contiguous() && b.d_w_up.is_contiguous()) return {b.d_w_gate.data, b.d_w_up.data};
  const std::int64_t H = s.hidden, I = s.intermediate;
  auto* gate = static_cast<std::uint16_t*>(b.d_w_gate.data);
  auto halves_layout = [&](const TensorView& v) { return v.stride[0] == 2 * I * H && v.stride[1] == H && v.stride[2] == 1; };
  if (b.d_w_up.data == gate + I * H && halves_layout(b.d_w_gate) && halves_layout(b.d_w_up))
    return {gate, gate + s.num_local_experts * I * H};
  return {nullptr, nullptr};
}

// Whether two tensors share a byte (empty or absent ones share none).
bool overlap(const TensorView* a, const TensorView* b) { return a != nullptr && b != nullptr && a->overlaps(*b); }

// dx as space for the routed dy rows that miss the gradient buffers, or for the shared expert's
// dx rows (the combine writes dx last, after every reader of those rows:
// BackwardParams::dy_split): when it is contiguous, 16-byte aligned and shares no byte with any
// other argument; else none.
void* dx_row_space(const ForwardArgs& a, const BackwardArgs& b, const std::optional<TensorView>& saved,
                   const std::optional<TensorView>& scratch) {
  const TensorView& dx = b.dx;
  if (dx.numel() == 0 || !dx.is_contiguous() || reinterpret_cast<std::uintptr_t>(dx.data) % 16 != 0) return nullptr;
  auto opt = [](const std::optional<TensorView>& v) { return v ? &*v : nullptr; };
  for (const TensorView* v : {&a.x, &a.topk_ids, &a.topk_weights, &a.w_gate, &a.w_up, &a.w_down, opt(a.shared_gate),
                              opt(a.shared_up), opt(a.shared_down), &b.dy, &b.d_topk_weights, &b.d_w_gate, &b.d_w_up,
                              &b.d_w_down, opt(b.d_shared_gate), opt(b.d_shared_up), opt(b.d_shared_down), opt(saved),
                              opt(scratch)})
    if (overlap(&dx, v)) return nullptr;
  return dx.data;
}

// The shared expert's 2-D matrix as one expert's [1, rows, cols].
TensorView one_expert(const TensorView& w) {
  return TensorView::contiguous(w.data, w.dtype, w.device, {1, w.shape[0], w.shape[1]});
}

void zero_gradient(const std::optional<TensorView>& g, cudaStream_t stream) {
  if (!g || g->numel() == 0) return;
  if (g->is_contiguous()) {
    detail::cuda_check(cudaMemsetAsync(g->data, 0, g->numel() * dtype_size(g->dtype), stream), kWhere,
                       "cudaMemsetAsync(weight gradient)");
    return;
  }
  const std::size_t bytes = dtype_size(g->dtype);  // a strided [E, rows, cols] view: each expert's rows
  for (std::int64_t e = 0; e < g->shape[0]; ++e)
    detail::cuda_check(cudaMemset2DAsync(static_cast<char*>(g->data) + e * g->stride[0] * bytes, g->stride[1] * bytes, 0,
                                         g->shape[2] * bytes, g->shape[1], stream),
                       kWhere, "cudaMemset2DAsync(weight gradient)");
}

}  // namespace

namespace detail {

void check_backward_call(std::string_view kWhere, const ForwardArgs& a, const BackwardArgs& b, Workspace& ws,
                         const std::optional<TensorView>& saved, int device) {
  const MoeShape& s = ws.shape();
  validate_backward_args(kWhere, s, a, b, Device::cuda(device));
  ws.begin_call(a.x.shape[0], kWhere);
  if (ws.training() == Training::off)
    throw_argument_error(kWhere, "workspace", "was made for inference (Training::off): make it with Training::save or "
                                              "Training::recompute");
  if (saved) {
    detail::check_saved(kWhere, *saved, ws, Device::cuda(device));
  } else if (ws.training() != Training::recompute) {
    throw_argument_error(kWhere, "saved", "is required: the workspace is Training::save (pass the tensor the forward "
                                          "filled, or make the workspace with Training::recompute)");
  }
  detail::check_locations(kWhere, a, s, false);
  if (b.fp8_weight_gradients && !b.fp8)
    throw_argument_error(kWhere, "fp8_weight_gradients", "is true but 'fp8' is not given: the FP8 weight gradients run "
                                                         "with the FP8 dgrad (pass BackwardArgs::fp8 too)");
  if (b.fp8) {
    if (ws.config().precision != Precision::fp8)
      throw_argument_error(kWhere, "fp8", "was given, but the workspace's precision is bf16 (the FP8 dgrad runs on a "
                                          "Config::precision = Precision::fp8 workspace)");
    for (auto [name, view] : {std::pair{"fp8.down_t", &b.fp8->down_t}, {"fp8.gate_up_t", &b.fp8->gate_up_t},
                              {"fp8.down_t_exponents", &b.fp8->down_t_exponents},
                              {"fp8.gate_up_t_exponents", &b.fp8->gate_up_t_exponents}})
      if (view->numel() > 0) check_pointer_location(kWhere, name, *view);
  }
  for (auto [name, view] : {std::pair{"dy", &b.dy}, {"dx", &b.dx}, {"d_topk_weights", &b.d_topk_weights},
                            {"d_w_gate", &b.d_w_gate}, {"d_w_up", &b.d_w_up}, {"d_w_down", &b.d_w_down}})
    if (view->numel() > 0) check_pointer_location(kWhere, name, *view);
  if (s.has_shared()) {
    for (auto [name, view] : {std::pair{"d_shared_gate", &*b.d_shared_gate}, {"d_shared_up", &*b.d_shared_up},
                              {"d_shared_down", &*b.d_shared_down}})
      check_pointer_location(kWhere, name, *view);
    // (the shared expert's tasks read x and dy themselves, while the combine may write dx)
    for (auto [name, view] : {std::pair{"x", &a.x}, {"dy", &b.dy}})
      if (overlap(&b.dx, view))
        throw_argument_error(kWhere, "dx", "must not overlap '", name, "' when the layer has a shared expert (its "
                             "tasks read ", name, " while dx is written)");
  }
}

kernels::BackwardParams backward_params(const ForwardArgs& a, const BackwardArgs& b, Workspace& ws,
                                        const CallBuffers& buffers, std::uint16_t* gu) {
  const MoeShape& s = ws.shape();
  const std::int64_t T = ws.tokens();
  const bool grad_fp32 = b.d_w_gate.dtype == DType::f32;
  DevicePlan& plan = ws.plan();
  const std::int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
  const std::int64_t capacity = plan.capacity_rows(), n_shared_tiles = detail::shared_tiles(s, T);
  const std::int64_t padded_tokens = n_shared_tiles * detail::kTileRows;
  std::uint16_t* dgu = gu;  // the kernel replaces the pre-activations by their gradients
  std::uint16_t* hw = buffers.hidden;
  std::uint16_t* dx_rows = buffers.dx_rows;
  const std::int64_t W = buffers.row_columns > 0 ? buffers.row_columns : H;  // (the first column block's)

  kernels::BackwardParams p{};
  p.routed_maps = set_maps(buffers.dy_rows, buffers.dy_rows_hi, buffers.dy_split, buffers.x_rows, capacity, dgu, hw,
                           capacity, a.w_gate, a.w_up, a.w_down, H, I, W);
  // (none on an EP rank with peers in bf16: its dx tiles push their rows to the tokens' owners)
  if (dx_rows != nullptr)
    p.routed_maps.dx_rows = detail::make_bf16_tensor_map(dx_rows, {U(W), U(capacity), 1}, kernels::kBoxMN, "dx rows");
  p.block_first_tile = 0;  // (the first column block; W = H: the one)
  p.block_tiles = static_cast<std::uint16_t>(W == H ? 0 : W / kernels::kBlockN);
  p.routed = {gu, hw, dx_rows, b.d_w_gate.data, b.d_w_up.data, b.d_w_down.data, static_cast<int>(I)};
  if (!grad_fp32) set_gradient_maps(p.routed_maps, b.d_w_gate, b.d_w_up, b.d_w_down);
  if (s.has_shared()) {
    std::uint16_t* s_dgu = dgu + 2 * capacity * I;
    std::uint16_t* s_hw = buffers.shared_hidden;
    p.shared_maps = set_maps(b.dy.data, nullptr, 0, a.x.data, T, s_dgu, s_hw, padded_tokens, one_expert(*a.shared_gate),
                             one_expert(*a.shared_up), one_expert(*a.shared_down), H, Is, H);
    std::uint16_t* s_dx_rows = buffers.shared_dx_rows;
    const std::int64_t s_rows = s_dx_rows == b.dx.data ? T : padded_tokens;  // (in dx: the stores stop at T)
    p.shared_maps.dx_rows =
        detail::make_bf16_tensor_map(s_dx_rows, {U(H), U(s_rows), 1}, kernels::kBoxMN, "shared dx rows");
    p.shared = {s_dgu, s_hw, s_dx_rows, b.d_shared_gate->data, b.d_shared_up->data, b.d_shared_down->data,
                static_cast<int>(Is)};
    if (!grad_fp32)
      set_gradient_maps(p.shared_maps, one_expert(*b.d_shared_gate), one_expert(*b.d_shared_up),
                        one_expert(*b.d_shared_down));
  }
  detail::fill_common_params(p, ws, a.topk_weights.data);
  p.counters.wd_done = ws.counters() + detail::counters_per_tile(ws) + 2;  // after done and abort
  p.dw_partial = ws.dw_partial();
  p.dx = static_cast<std::uint16_t*>(b.dx.data);
  p.d_topk_weights = static_cast<float*>(b.d_topk_weights.data);
  p.grad_fp32 = grad_fp32;
  p.saved_marker = detail::saved_marker(gu, ws);
  p.dx_over_x = ws.rows_in_slots();
  p.rows_in_grads = buffers.rows_in_grads;
  p.dy_split = static_cast<int>(buffers.dy_split);
  return p;
}

// Precision::fp8 with BackwardArgs::fp8, after the plan: gathers the routed dy rows in one read
// of dy, quantized into buffers.dy_fp8 / dy_exps and (bf16_rows: for bf16 weight gradients) in
// bf16 where the BF16 backward's dispatch would put them.
void gather_dy_fp8(const BackwardArgs& b, Workspace& ws, const CallBuffers& buffers, cudaStream_t stream,
                   std::string_view where, bool bf16_rows) {
  kernels::QuantizeRowsParams rows = quantize_rows_params(ws, b.dy.data, buffers.dy_fp8, buffers.dy_exps);
  rows.rows_bf16 = bf16_rows ? buffers.dy_rows : nullptr;
  rows.rows_bf16_hi = buffers.dy_rows_hi;
  rows.split = buffers.dy_split;
  kernels::launch_quantize_rows(rows, 4 * persistent_ctas(ws, where), stream);
  cuda_check(cudaGetLastError(), where, "launching the FP8 dy row gather");
}

kernels::Fp8BackwardParams backward_fp8_params(const BackwardArgs& b, Workspace& ws, const CallBuffers& buffers,
                                               const kernels::BackwardParams& p) {
  const MoeShape& s = ws.shape();
  const std::int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts;
  const std::int64_t capacity = ws.plan().capacity_rows();
  const Fp8DgradWeights& w = *b.fp8;
  kernels::Fp8BackwardParams q{};
  q.base = p;
  q.maps.dy = make_u8_tensor_map(buffers.dy_fp8, {U(H), U(capacity)}, kernels::kBoxFp8, "dy rows (fp8)");
  q.maps.down_t = make_u8_tensor_map(w.down_t.data, {U(H), U(I), U(El)}, kernels::kBoxFp8, "fp8.down_t");
  q.maps.dgu = make_u8_tensor_map(buffers.dgu_fp8, {U(2 * I), U(capacity)}, kernels::kBoxFp8, "d pre-activations (fp8)");
  q.maps.gate_up_t = make_u8_tensor_map(w.gate_up_t.data, {U(2 * I), U(H), U(El)}, kernels::kBoxFp8, "fp8.gate_up_t");
  q.capacity = capacity;
  q.dgu_values = buffers.dgu_fp8;
  q.dy_exps = buffers.dy_exps;
  q.dgu_exps = buffers.dgu_exps;
  q.down_t_exponents = static_cast<const std::int32_t*>(w.down_t_exponents.data);
  q.gate_up_t_exponents = static_cast<const std::int32_t*>(w.gate_up_t_exponents.data);
  return q;
}

void quantize_transposed(Workspace& ws, const void* src, std::int64_t columns, bool gather, std::uint8_t* values,
                         std::uint8_t* col_exps, std::int32_t* block_exponents, cudaStream_t stream, std::string_view where,
                         const std::int32_t* tile_order) {
  const DevicePlanView& plan = ws.plan().view();
  kernels::QuantizeColumnsParams q{};
  q.src = static_cast<const std::uint16_t*>(src);
  q.row_stride = columns;
  q.row_pair = gather ? plan.row_pair : nullptr;
  q.tile_order = tile_order;
  q.top_k = ws.shape().top_k;
  q.values = values;
  q.col_exps = col_exps;
  q.block_exponents = block_exponents;
  q.exponent_stride = kernels::wgrad_exponent_stride(ws.plan().capacity_rows());  // (Fp8WgradParams' rows)
  q.num_tiles = plan.num_tiles;
  q.plan_status = plan.status;
  q.capacity = ws.plan().capacity_rows();
  q.columns = static_cast<int>(columns);
  kernels::launch_quantize_columns(q, stream);
  cuda_check(cudaGetLastError(), where, "launching the FP8 weight gradients' quantization");
}

kernels::Fp8WgradParams wgrad_fp8_params(Workspace& ws, const CallBuffers& buffers, const kernels::BackwardParams& p) {
  const MoeShape& s = ws.shape();
  const std::int64_t H = s.hidden, I = s.intermediate, capacity = ws.plan().capacity_rows();
  kernels::Fp8WgradParams w{};
  w.base = p;
  w.maps.dy_t = make_u8_tensor_map(buffers.dy_t, {U(capacity), U(H)}, kernels::kBoxFp8, "dy rows transposed (fp8)");
  w.maps.hw_t = make_u8_tensor_map(buffers.hw_t, {U(capacity), U(I)}, kernels::kBoxFp8, "w h transposed (fp8)");
  w.maps.dgu_t = make_u8_tensor_map(buffers.dgu_t, {U(capacity), U(2 * I)}, kernels::kBoxFp8, "d pre-activations transposed (fp8)");
  w.maps.x_t = make_u8_tensor_map(buffers.x_t, {U(capacity), U(H)}, kernels::kBoxFp8, "x rows transposed (fp8)");
  w.capacity = capacity;
  w.dy_t_exps = buffers.dy_t_exps;
  w.dgu_t_exps = buffers.dgu_t_exps;
  w.hw_t_exponents = buffers.hw_t_exponents;
  w.x_t_exponents = buffers.x_t_exponents;
  return w;
}

}  // namespace detail

void backward(const ForwardArgs& a, const BackwardArgs& b, Workspace& ws, cudaStream_t stream,
              const std::optional<TensorView>& saved, const std::optional<TensorView>& scratch) {
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  ws.throw_if_failed();
  detail::check_backward_call(kWhere, a, b, ws, saved, device);
  const std::int64_t T = ws.tokens();
  const bool grad_fp32 = b.d_w_gate.dtype == DType::f32;
  if (T == 0) {  // no rows: bf16 gradients are zero, f32 ones keep their value
    if (scratch) detail::call_scratch(ws, scratch, 0, kScratchFrom, kWhere, stream);  // (checked all the same)
    if (!grad_fp32)
      for (const auto& g : {std::optional<TensorView>(b.d_w_gate), std::optional<TensorView>(b.d_w_up),
                            std::optional<TensorView>(b.d_w_down), b.d_shared_gate, b.d_shared_up, b.d_shared_down})
        zero_gradient(g, stream);
    return;
  }

  // (the scratch this call's gradients leave it to need: none of the rows in them, some, or
  // the most when the two are one block)
  const auto [row_space_a, row_space_b] = gradient_row_spaces(b, ws.shape());
  void* dx_space = dx_row_space(a, b, saved, scratch);
  const bool fp8_dgrad = b.fp8.has_value(), fp8_wgrad = fp8_dgrad && b.fp8_weight_gradients;
  void* saved_space = saved ? saved->data : nullptr;
  const std::int64_t needed =
      detail::backward_buffers(ws, nullptr, row_space_a, row_space_b, dx_space, fp8_dgrad, fp8_wgrad, saved_space).bytes;
  void* base = detail::call_scratch(ws, scratch, needed, kScratchFrom, kWhere, stream);
  const detail::CallBuffers buffers =
      detail::backward_buffers(ws, base, row_space_a, row_space_b, dx_space, fp8_dgrad, fp8_wgrad, saved_space);
  std::uint16_t* gu = saved ? static_cast<std::uint16_t*>(saved->data) : buffers.recompute;
  detail::LaunchKey key;
  key.add(std::uint64_t{2}).add(static_cast<std::uint64_t>(T)).add(base).add(gu).add(a).add(b);
  ws.launch_cache().run(key, stream, kWhere, [&](cudaStream_t s) {
    plan_device(a.topk_ids, 0, ws.plan(), s, {}, detail::counters(ws));  // (zeroes the counters too)
    // The x rows one column block at a time (Config::backward_column_blocks; W = H: one): the
    // first block's launch does the dh, dW_down and shared-expert work too; the counters carry on.
    const std::int64_t H = ws.shape().hidden, W = buffers.row_columns;
    const auto copy_x_rows = [&](std::int64_t c0) {
      if (W == H) detail::dispatch_rows(a.x.data, buffers.x_rows, ws, s);
      else detail::dispatch_row_columns(a.x.data, buffers.x_rows, ws, s, c0, std::min(W, H - c0), W);
    };
    // (the FP8 weight gradients read x and dy transposed, quantized from x and dy themselves: the
    // bf16 rows serve only a recompute's GEMM1, and the dx rows take the x rows' room. A recompute's
    // GEMM1 reads whole rows: in column blocks the first block's columns are gathered again after it)
    if (!saved) {
      detail::dispatch_rows(a.x.data, buffers.x_rows, ws, s);
      detail::launch_forward_kernel(a, ws, buffers, s, gu, true, kWhere);
      if (W < H) copy_x_rows(0);
    } else if (!fp8_wgrad) {
      copy_x_rows(0);
    }
    if (b.fp8) detail::gather_dy_fp8(b, ws, buffers, s, kWhere, !fp8_wgrad);
    else detail::dispatch_rows(b.dy.data, buffers.dy_rows, ws, s, buffers.dy_rows_hi, buffers.dy_split);
    if (!saved) detail::zero_counters(ws, s, kWhere);  // (the recompute used them)
    kernels::BackwardParams p = detail::backward_params(a, b, ws, buffers, gu);
    unsigned long long* marker = detail::saved_marker(gu, ws);
    const int ctas = detail::persistent_ctas(ws, kWhere);
    // (the FP8 dgrad kernel's params once: a block changes only the block's first tile)
    kernels::Fp8BackwardParams q{};
    if (b.fp8) q = detail::backward_fp8_params(b, ws, buffers, p);
    if (fp8_wgrad) q.routed_weights = false, q.base.dx_over_x = false;  // (no task reads the x rows)
    for (std::int64_t c0 = 0; c0 < H; c0 += W) {
      if (c0 > 0 && !fp8_wgrad) copy_x_rows(c0);  // (stream order: after the previous block's combine has read its dx rows)
      const auto first_tile = static_cast<std::uint16_t>(c0 / kernels::kBlockN);
      if (b.fp8) {
        q.base.block_first_tile = first_tile;
        kernels::launch_backward_fp8(q, ctas, s);
      } else {
        p.block_first_tile = first_tile;
        kernels::launch_backward(p, ctas, s);
      }
      detail::cuda_check(cudaGetLastError(), kWhere, "launching the backward kernel");
    }
    if (fp8_wgrad) {  // the operands, transposed (w h and dgate|dup made by the launches above), then the
      // routed weight gradients. dgate|dup^T first: the others may take its source's room (the routed
      // pre-activations', detail::backward_buffers), as they may the x / dx rows' and the dy rows'.
      const std::int64_t I = ws.shape().intermediate;
      if (kWgradPasses) {
        if (kWgradActivationPasses) {
          detail::quantize_transposed(ws, gu, 2 * I, false, buffers.dgu_t, buffers.dgu_t_exps, nullptr, s, kWhere);
          detail::quantize_transposed(ws, buffers.hidden, I, false, buffers.hw_t, nullptr, buffers.hw_t_exponents, s, kWhere);
        }
        const std::int32_t* order = nullptr;  // (the gathers visit tiles rank by rank: kernels/fp8/tile_order.cuh)
        if (kWgradRankOrder) {
          const DevicePlanView& v = ws.plan().view();
          kernels::launch_tile_order(v.expert_offset, v.tile_expert, v.tile_row, v.num_tiles, v.status,
                                     static_cast<int>(ws.shape().num_local_experts), ws.plan().max_tiles(),
                                     buffers.tile_order, s);
          detail::cuda_check(cudaGetLastError(), kWhere, "launching the FP8 weight gradients' tile order");
          order = buffers.tile_order;
        }
        detail::quantize_transposed(ws, b.dy.data, H, true, buffers.dy_t, buffers.dy_t_exps, nullptr, s, kWhere, order);
        detail::quantize_transposed(ws, a.x.data, H, true, buffers.x_t, nullptr, buffers.x_t_exponents, s, kWhere, order);
      }
      kernels::launch_wgrad_fp8(detail::wgrad_fp8_params(ws, buffers, q.base), ctas, s);
      detail::cuda_check(cudaGetLastError(), kWhere, "launching the FP8 weight-gradient kernel");
    }
    // The pre-activations are gone (replaced by their gradients): mark the tensor consumed.
    detail::cuda_check(cudaMemsetAsync(marker, 0, sizeof(*marker), s), kWhere, "cudaMemsetAsync(saved marker)");
  });
}

}  // namespace mok
