#include "mok/forward.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cuda_check.hpp"
#include "kernels/ep/dispatch.cuh"
#include "kernels/forward/forward.cuh"
#include "launch_cache.hpp"
#include "layer_launch.hpp"
#include "mok/error.hpp"
#include "tensor_map.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::forward";
constexpr const char* kScratchFrom = "Workspace::forward_scratch_bytes(T)";

// The boxes of the weights' B tiles: the cooperative kernel's 128 gate + 128 up rows and 256 rows
// of w_down, the ping-pong kernel's 64 + 64 and 128.
struct WeightBoxes {
  kernels::Box gate_up, down;
};
constexpr WeightBoxes weight_boxes(bool pingpong) {
  return pingpong ? WeightBoxes{kernels::kBoxMN, kernels::kBoxK} : WeightBoxes{kernels::kBoxK, kernels::kBoxDown};
}

}  // namespace

namespace detail {

void check_forward_precision(std::string_view where, const Workspace& ws, const ForwardArgs& a) {
  if (ws.config().precision == Precision::fp8 && !a.fp8)
    throw_argument_error(where, "fp8", "is required: the workspace's precision is fp8 (quantize the routed weights "
                                       "with mok::fp8::quantize_weights)");
  if (ws.config().precision != Precision::fp8 && a.fp8)
    throw_argument_error(where, "fp8", "was given, but the workspace's precision is bf16 (make it with "
                                       "Config::precision = Precision::fp8)");
}

int persistent_ctas(const Workspace& ws, std::string_view where) {
  int device = 0, sms = 0;
  cuda_check(cudaGetDevice(&device), where, "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), where, "cudaDeviceGetAttribute");
  return ws.config().compute_sms > 0 ? std::min(ws.config().compute_sms, sms) : sms;
}

namespace {

void dispatch(std::span<const void* const> rows, void* routed, Workspace& ws, cudaStream_t stream, void* routed_hi,
              std::int64_t split, std::int64_t column0 = 0, std::int64_t columns = 0, std::int64_t stride = 0) {
  const MoeShape& s = ws.shape();
  const DevicePlanView& v = ws.plan().view();
  kernels::DispatchParams d{};
  for (std::size_t q = 0; q < rows.size(); ++q) d.x[q] = static_cast<const std::uint16_t*>(rows[q]);
  d.x_routed = static_cast<std::uint16_t*>(routed);
  d.x_routed_hi = static_cast<std::uint16_t*>(routed_hi);
  d.split = split;
  d.row_pair = v.row_pair;
#if !defined(MOK_DIAG_DISPATCH_GATHER)  // (a diagnostic build: the gather on one GPU too, as before)
  // One GPU (one source, a plan of every pair): the scatter, x read once (dispatch.cu).
  if (rows.size() == 1 && s.num_local_experts == s.num_experts) d.pair_row = v.pair_row;
#endif
  d.expert_offset = v.expert_offset;
  d.plan_status = v.status;
  d.capacity = ws.plan().capacity_rows();
  d.pairs_per_rank = static_cast<std::int32_t>(ws.tokens() * s.top_k);
  d.hidden = static_cast<int>(s.hidden);
  d.top_k = static_cast<int>(s.top_k);
  d.num_local_experts = static_cast<int>(s.num_local_experts);
  d.column0 = static_cast<int>(column0);
  d.columns = static_cast<int>(columns);
  d.routed_stride = static_cast<int>(stride);
  kernels::launch_dispatch(d, 4 * persistent_ctas(ws, "mok::dispatch"), stream);
}

}  // namespace

void dispatch_rows(std::span<const void* const> rows, void* routed, Workspace& ws, cudaStream_t stream,
                   void* routed_hi, std::int64_t split) {
  dispatch(rows, routed, ws, stream, routed_hi, split);
}

void dispatch_row_columns(const void* rows, void* routed, Workspace& ws, cudaStream_t stream, std::int64_t column0,
                          std::int64_t columns, std::int64_t stride) {
  const void* const sources[1] = {rows};
  dispatch(std::span<const void* const>(sources), routed, ws, stream, nullptr, kernels::kNoSplit, column0, columns,
           stride);
}

void dispatch_rows(const void* rows, void* routed, Workspace& ws, cudaStream_t stream, void* routed_hi,
                   std::int64_t split) {
  const void* const sources[1] = {rows};
  dispatch_rows(std::span<const void* const>(sources), routed, ws, stream, routed_hi, split);
}

kernels::ForwardParams forward_params(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers,
                                      std::uint16_t* saved_gu, bool gemm1_only, bool pingpong) {
  const MoeShape& s = ws.shape();
  const std::int64_t H = s.hidden, I = s.intermediate, capacity = ws.plan().capacity_rows();
  using U = std::uint64_t;
  kernels::ForwardParams p{};
  p.maps.x_routed = make_bf16_tensor_map(buffers.x_rows, {U(H), U(capacity)}, kernels::kBoxK, "x_routed");
  std::uint16_t* hidden = buffers.hidden;
  const WeightBoxes boxes = weight_boxes(pingpong);
  p.maps.gate = make_bf16_weight_map(a.w_gate, boxes.gate_up, "w_gate");
  p.maps.up = make_bf16_weight_map(a.w_up, boxes.gate_up, "w_up");
  p.maps.down = make_bf16_weight_map(a.w_down, boxes.down, "w_down");
  p.maps.h_store = make_bf16_tensor_map(hidden, {U(I), U(capacity)}, kernels::kBoxMN, "h");
  p.maps.h_load = make_bf16_tensor_map(hidden, {U(I), U(capacity)}, kernels::kBoxK, "h");
  set_shared_expert_params(p, a, ws, buffers, pingpong);
  set_saved_params(p, ws, saved_gu);
  p.gemm1_only = gemm1_only;
  p.interleave_tiles = gemm1_only ? 0 : static_cast<int>(ws.config().interleave_rows / kTileRows);
  // One GPU: each x row under its own slot row (forward_buffers()).
  p.x_rows_in_slots = ws.rows_in_slots() ? capacity : 0;
  return p;
}

void set_saved_params(kernels::ForwardParams& p, Workspace& ws, std::uint16_t* saved_gu) {
  if (!saved_gu) return;
  const MoeShape& s = ws.shape();
  const std::int64_t I = s.intermediate, Is = s.shared_intermediate, capacity = ws.plan().capacity_rows();
  using U = std::uint64_t;
  p.saved_gu = saved_gu;
  p.maps.saved_gu = make_bf16_tensor_map(saved_gu, {U(2 * I), U(capacity)}, kernels::kBoxMN, "saved gate|up");
  if (s.has_shared()) {
    p.shared_saved_gu = saved_gu + 2 * capacity * I;
    p.maps.shared_saved_gu = make_bf16_tensor_map(p.shared_saved_gu, {U(2 * Is), U(shared_tiles(s, ws.tokens()) * kTileRows)},
                                                  kernels::kBoxMN, "shared saved gate|up");
  }
  p.saved_marker = saved_marker(saved_gu, ws);
}

void set_shared_expert_params(kernels::ForwardParams& p, const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers,
                              bool pingpong) {
  const MoeShape& s = ws.shape();
  const std::int64_t T = ws.tokens(), H = s.hidden, Is = s.shared_intermediate;
  const std::int64_t capacity = ws.plan().capacity_rows(), padded_tokens = shared_tiles(s, T) * kTileRows;
  using U = std::uint64_t;
  p.maps.x = make_bf16_tensor_map(a.x.data, {U(H), U(T)}, kernels::kBoxK, "x");
  if (s.has_shared()) {
    std::uint16_t* shared_hidden = buffers.shared_hidden;
    const WeightBoxes boxes = weight_boxes(pingpong);
    p.maps.shared_gate = make_bf16_tensor_map(a.shared_gate->data, {U(H), U(Is), 1}, boxes.gate_up, "shared_gate");
    p.maps.shared_up = make_bf16_tensor_map(a.shared_up->data, {U(H), U(Is), 1}, boxes.gate_up, "shared_up");
    p.maps.shared_down = make_bf16_tensor_map(a.shared_down->data, {U(Is), U(H), 1}, boxes.down, "shared_down");
    p.maps.shared_h_store = make_bf16_tensor_map(shared_hidden, {U(Is), U(padded_tokens)}, kernels::kBoxMN, "shared h");
    p.maps.shared_h_load = make_bf16_tensor_map(shared_hidden, {U(Is), U(padded_tokens)}, kernels::kBoxK, "shared h");
    p.shared_slots = buffers.slots + capacity * H;
    p.maps.shared_slots = make_bf16_tensor_map(p.shared_slots, {U(H), U(padded_tokens)}, kernels::kBoxMN, "shared slots");
  }
  p.maps.slots = make_bf16_tensor_map(buffers.slots, {U(H), U(capacity)}, kernels::kBoxMN, "slots");
  fill_common_params(p, ws, a.topk_weights.data);
  p.slots = buffers.slots;
  p.y = static_cast<std::uint16_t*>(a.y.data);
  p.inter = static_cast<int>(s.intermediate);
  p.shared_inter = static_cast<int>(Is);
}

void zero_counters(Workspace& ws, cudaStream_t stream, std::string_view where) {
  cuda_check(cudaMemsetAsync(ws.counters(), 0, 4 * ws.counter_count(), stream), where, "cudaMemsetAsync(counters)");
}

void launch_forward_kernel(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers, cudaStream_t stream,
                           std::uint16_t* saved_gu, bool gemm1_only, std::string_view where) {
  const bool pingpong = ws.config().pingpong;  // (one GPU: this path; EP ranks launch the cooperative kernel)
  const kernels::ForwardParams p = forward_params(a, ws, buffers, saved_gu, gemm1_only, pingpong);
  if (pingpong) kernels::launch_forward_pingpong(p, persistent_ctas(ws, where), stream);
  else kernels::launch_forward(p, persistent_ctas(ws, where), stream);
  cuda_check(cudaGetLastError(), where, "launching the forward kernel");
}

#if defined(MOK_DIAG_COPY_WARPS)
// A buffer the shadow copy writes and nobody reads (MOK_DIAG_COPY_SHADOW): one per size, kept for
// the process (a diagnostic build; the launch cache's graphs may hold its address).
std::uint16_t* shadow_rows(Workspace& ws, std::string_view where) {
  static std::vector<std::pair<std::int64_t, void*>> buffers;
  const std::int64_t bytes = 2 * ws.plan().allocated_rows() * ws.shape().hidden;
  for (auto& [size, ptr] : buffers)
    if (size >= bytes) return static_cast<std::uint16_t*>(ptr);
  void* ptr = nullptr;
  cuda_check(cudaMalloc(&ptr, bytes), where, "cudaMalloc(shadow rows)");
  buffers.emplace_back(bytes, ptr);
  return static_cast<std::uint16_t*>(ptr);
}

// launch_forward_kernel() with the kernel's copy warps on (into shadow when given).
void launch_forward_kernel_copying(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers, cudaStream_t stream,
                                   std::uint16_t* saved_gu, std::uint16_t* shadow, std::string_view where) {
  kernels::ForwardParams p = forward_params(a, ws, buffers, saved_gu, false, false);
  p.x_rows_src = static_cast<const std::uint16_t*>(a.x.data);
  p.x_rows_dst = shadow ? shadow : buffers.x_rows;
  p.counters.x_copied = x_copied_counters(ws);
  kernels::launch_forward(p, persistent_ctas(ws, where), stream);
  cuda_check(cudaGetLastError(), where, "launching the forward kernel");
}
#endif

}  // namespace detail

void forward(const ForwardArgs& a, Workspace& ws, cudaStream_t stream, const std::optional<TensorView>& saved,
             const std::optional<TensorView>& scratch, bool rows_enqueued) {
  ws.throw_if_failed();
  const MoeShape& s = ws.shape();
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  const std::int64_t T = validate_forward_args(kWhere, s, a, Device::cuda(device));
  // (forward_rows() checked and recorded this call's rows; begin_call() forgets them)
  const std::optional<Workspace::EnqueuedRows> rows = ws.enqueued_rows();
  ws.begin_call(T, kWhere);
  detail::check_locations(kWhere, a, s, true);
  detail::check_forward_precision(kWhere, ws, a);
  if (saved) {
    if (ws.training() != Training::save)
      throw_argument_error(kWhere, "saved", "needs a workspace made with Training::save");
    detail::check_saved(kWhere, *saved, ws, Device::cuda(device));
  }
  if (T == 0) {
    if (scratch) detail::call_scratch(ws, scratch, 0, kScratchFrom, kWhere, stream);  // (checked all the same)
    return;
  }
  void* base = detail::call_scratch(ws, scratch, ws.forward_scratch_bytes(T), kScratchFrom, kWhere, stream);
  if (rows_enqueued && rows != Workspace::EnqueuedRows{T, a.x.data, a.topk_ids.data, base, stream})
    throw_argument_error(kWhere, "rows_enqueued",
                         rows ? "is set, but the workspace's last forward_rows() was for other x, topk_ids, scratch "
                                "or stream (each forward needs its own, with no other call in between)"
                              : "is set, but forward_rows() was not called on this workspace just before");
  auto* saved_gu = saved ? static_cast<std::uint16_t*>(saved->data) : nullptr;
#if defined(MOK_DIAG_COPY_WARPS)
  std::uint16_t* shadow = detail::kDispatchRows ? detail::shadow_rows(ws, kWhere) : nullptr;  // (before any capture)
#endif
  detail::LaunchKey key;
  key.add(std::uint64_t{rows_enqueued ? 4u : 1u}).add(static_cast<std::uint64_t>(T)).add(base).add(saved_gu).add(a);
  ws.launch_cache().run(key, stream, kWhere, [&](cudaStream_t s) {
    const detail::CallBuffers buffers = detail::forward_buffers(ws, base);
    if (!rows_enqueued) plan_device(a.topk_ids, 0, ws.plan(), s, {}, detail::counters(ws));  // (zeroes the counters too)
    if (ws.config().precision == Precision::fp8) {
      detail::launch_forward_fp8(a, ws, buffers, s, saved_gu, kWhere);
      return;
    }
#if defined(MOK_DIAG_COPY_WARPS)
    if (detail::copies_rows_in_kernel(ws)) {
      if (!rows_enqueued && detail::kDispatchRows) detail::dispatch_rows(a.x.data, buffers.x_rows, ws, s);
      detail::launch_forward_kernel_copying(a, ws, buffers, s, saved_gu, shadow, kWhere);
      return;
    }
#endif
    if (!rows_enqueued) detail::dispatch_rows(a.x.data, buffers.x_rows, ws, s);
    detail::launch_forward_kernel(a, ws, buffers, s, saved_gu, false, kWhere);
  });
}

void forward_rows(const TensorView& x, const TensorView& topk_ids, Workspace& ws, cudaStream_t stream,
                  const std::optional<TensorView>& scratch) {
  constexpr const char* where = "mok::forward_rows";
  ws.throw_if_failed();
  if (ws.config().precision != Precision::bf16 || !ws.rows_in_slots())
    throw_argument_error(where, "workspace", "must be a one-GPU bf16 workspace");
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), where, "cudaGetDevice");
  const std::int64_t T = validate_rows_args(where, ws.shape(), x, topk_ids, Device::cuda(device));
  ws.begin_call(T, where);
  for (auto [name, view] : {std::pair{"x", &x}, {"topk_ids", &topk_ids}})
    if (view->numel() > 0) check_pointer_location(where, name, *view);
  void* base = detail::call_scratch(ws, scratch, ws.forward_scratch_bytes(T), kScratchFrom, where, stream);
  if (T > 0) {
    detail::LaunchKey key;
    key.add(std::uint64_t{3}).add(static_cast<std::uint64_t>(T)).add(base).add(x).add(topk_ids);
    ws.launch_cache().run(key, stream, where, [&](cudaStream_t s) {
      plan_device(topk_ids, 0, ws.plan(), s, {}, detail::counters(ws));  // (zeroes the counters too)
#if defined(MOK_DIAG_COPY_WARPS)
      if (detail::copies_rows_in_kernel(ws) && !detail::kDispatchRows) return;  // (the kernel copies them)
#endif
      detail::dispatch_rows(x.data, detail::forward_buffers(ws, base).x_rows, ws, s);
    });
  }
  ws.enqueued_rows_ = Workspace::EnqueuedRows{T, x.data, topk_ids.data, base, stream};
}

}  // namespace mok
