#include "mok/forward.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "cuda_check.hpp"
#include "kernels/dispatch.cuh"
#include "kernels/forward.cuh"
#include "layer_launch.hpp"
#include "mok/error.hpp"
#include "tensor_map.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::forward";
constexpr const char* kScratchFrom = "Workspace::forward_scratch_bytes()";

void check_cuda(cudaError_t err, const char* what) { detail::cuda_check(err, "mok::Workspace", what); }

template <typename T>
void allocate(T*& ptr, std::int64_t bytes, const char* what, std::int64_t& total) {
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<std::int64_t>(bytes, 16)), what);
  total += bytes;
}

std::int64_t dh_tiles(const MoeShape& s) { return (s.intermediate + 255) / 256; }

}  // namespace

namespace {

constexpr std::int64_t kSavedTrailer = 8;  // bf16 elements: the 8-byte validity marker (+ padding)

PlanOptions plan_options(const MoeShape& shape, std::int64_t tokens, const Config& config) {
  PlanOptions options;
  options.block_m = detail::kTileRows;
  if (config.capacity_factor > 0) options.capacity_rows = plan_capacity_rows(shape, config, tokens, detail::kTileRows);
  return options;
}

}  // namespace

const char* kernel_phase_name(std::int32_t phase) {
  switch (phase) {
    case 1: return "waiting for a filled pipeline stage (full barrier)";
    case 2: return "waiting for a free pipeline stage (empty barrier)";
    case 3: return "forward: waiting for GEMM1 rows of an M-tile (h_ready)";
    case 4: return "forward: waiting for every GEMM2 tile before the combine (y_done)";
    case 5: return "backward: waiting for the dh tiles of an M-tile (and on one GPU its expert's dW_gate|up tiles) (dgu_ready)";
    case 6: return "backward: waiting for every dh tile of an expert before its weight gradients (dgu_ready)";
    case 7: return "backward: waiting for every dx row tile before the combine (dx_done)";
    case 8: return "forward: waiting for the result rows a peer rank pushes into this rank's combine slots (slots_done)";
    case 9: return "backward: waiting for the dx rows and d_topk_weights partials a peer rank pushes (slots_done)";
    case 10: return "forward: waiting for a minibatch of rows to land in the ring (landed)";
    case 11: return "forward: comm CTA waiting for GEMM1 to free a ring slot (freed)";
    case 12: return "waiting for a peer rank's routing exchange of this call (exchange flag)";
    case 13: return "waiting for a peer rank's plan of this call (plan flag)";
    case 14: return "forward: comm CTA waiting for a bulk copy of rows into its staging (comm loaded barrier)";
    case 15: return "backward: waiting for a minibatch of dy and x rows to land in the ring (landed)";
    case 16: return "backward: comm CTA waiting for the dh and weight-gradient tasks to free a ring slot (freed)";
    case 17: return "backward: comm CTA waiting for a bulk copy of rows into its staging (comm loaded barrier)";
    case 18: return "forward: waiting for GEMM1 to read the x rows that a GEMM2 tile's slot rows overwrite (h_ready)";
    case 19: return "backward: waiting for every dW_down tile to read the dy rows and w*h kept in the W_gate / W_up gradient buffers (wd_done)";
    default: return "unknown phase";
  }
}

Workspace::Workspace(const MoeShape& shape, std::int64_t tokens, const Config& config, Training training)
    : Workspace(shape, tokens, config, training, ForRank{-1}) {}

Workspace::Workspace(const MoeShape& shape, std::int64_t tokens, const Config& config, Training training, ForRank rank)
    : rank_(std::max(rank.rank, 0)), shape_(shape), config_(config), training_(training), tokens_(tokens) {
  validate(shape);
  validate(config);
  if (rank.rank < 0 && shape.ep_size() != 1)
    throw_argument_error("mok::Workspace", "num_local_experts",
                         "must equal num_experts = ", shape.num_experts, " on one GPU (got ", shape.num_local_experts,
                         "); an expert-parallel group's workspaces come from mok::VirtualRanks");
  if (tokens < 0) throw_argument_error("mok::Workspace", "tokens", "must be >= 0, got ", tokens);
  if (tokens * shape.top_k > std::numeric_limits<std::int32_t>::max())
    throw_argument_error("mok::Workspace", "tokens", "T*k must fit in int32, got ", tokens * shape.top_k);
  plan_ = std::make_unique<DevicePlan>(shape, tokens, plan_options(shape, tokens, config));

  const std::int64_t capacity = plan_->capacity_rows();
  const std::int64_t padded_tokens = detail::shared_tiles(shape, tokens) * detail::kTileRows;
  const std::int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  if (rank.rank >= 0) {  // an EP rank owns its row buffers; one GPU's calls take scratch
    allocate(x_routed_, 2 * capacity * H, "cudaMalloc(x_routed)", bytes_);
    allocate(hidden_, 2 * (capacity * I + padded_tokens * Is), "cudaMalloc(hidden)", bytes_);
    allocate(slots_, 4 * (capacity * H + padded_tokens * H), "cudaMalloc(slots)", bytes_);
    if (training == Training::recompute) allocate(recompute_, 2 * saved_elements(), "cudaMalloc(recompute)", bytes_);
  }
  allocate(counters_, 4 * counter_count(), "cudaMalloc(counters)", bytes_);
  if (training != Training::off) allocate(dw_partial_, 4 * capacity * dh_tiles(shape), "cudaMalloc(dw_partial)", bytes_);
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&status_host_), sizeof(KernelStatus), cudaHostAllocMapped),
             "cudaHostAlloc(status)");
  *status_host_ = KernelStatus{};
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device_), status_host_, 0),
             "cudaHostGetDevicePointer(status)");
}

Workspace::~Workspace() {
  for (void* p : {x_routed_, hidden_, static_cast<void*>(slots_), static_cast<void*>(counters_),
                  static_cast<void*>(dw_partial_), recompute_, scratch_})
    cudaFree(p);
  cudaFreeHost(status_host_);
}

std::int64_t Workspace::counter_count() const {
  return plan_->max_tiles() + detail::shared_tiles(shape_, tokens_) + 3;  // per-tile counters, done, abort, wd_done
}

std::int64_t Workspace::forward_scratch_bytes() const {
  return rows_in_slots() ? detail::forward_buffers(*this, nullptr).bytes : 0;
}

std::int64_t Workspace::backward_scratch_bytes(DType grad_dtype) const {
  if (!rows_in_slots() || training_ == Training::off) return 0;
  // (any non-null address stands for the gradient buffers: only the sizes are used)
  void* grads = grad_dtype == DType::bf16 ? reinterpret_cast<void*>(std::uintptr_t{256}) : nullptr;
  return detail::backward_buffers(*this, nullptr, grads, grads).bytes;
}

void* Workspace::own_scratch(std::int64_t bytes, std::string_view where, cudaStream_t stream) {
  if (scratch_ == nullptr) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    detail::cuda_check(cudaStreamIsCapturing(stream, &capturing), where, "cudaStreamIsCapturing");
    if (capturing != cudaStreamCaptureStatusNone)
      throw_argument_error(where, "scratch", "is needed: this workspace allocates its own on its first call, which "
                                             "cannot happen while a CUDA graph is being captured (run one call first, "
                                             "or pass scratch)");
    // One buffer for every call: the larger of the forward's and the backward's (f32 gradients).
    scratch_bytes_ = std::max({bytes, forward_scratch_bytes(), backward_scratch_bytes(DType::f32)});
    allocate(scratch_, scratch_bytes_, "cudaMalloc(scratch)", bytes_);
  }
  if (bytes > scratch_bytes_)
    throw Error(detail::concat(where, ": internal error: scratch of ", bytes, " bytes > ", scratch_bytes_));
  return scratch_;
}


std::int64_t saved_elements(const MoeShape& shape, std::int64_t tokens, const Config& config) {
  validate(shape);
  const std::int64_t capacity = device_plan_capacity_rows(shape, tokens, plan_options(shape, tokens, config));
  const std::int64_t padded_tokens = detail::shared_tiles(shape, tokens) * detail::kTileRows;
  return 2 * (capacity * shape.intermediate + padded_tokens * shape.shared_intermediate) + kSavedTrailer;
}

std::int64_t Workspace::capacity_h() const { return plan_->capacity_rows() * shape_.hidden; }

std::int64_t Workspace::saved_elements() const { return mok::saved_elements(shape_, tokens_, config_); }

void Workspace::throw_if_failed() const {
  const volatile KernelStatus* v = status_host_;  // written by the device, read without a sync
  if (v->code == KernelStatus::ok) return;
  const KernelStatus s{v->code, v->block, v->task, v->phase, v->peer, 0, v->observed, v->expected};
  status_host_->code = KernelStatus::ok;  // reported once
  if (s.code == KernelStatus::saved_not_valid)
    throw ArgumentError("mok::backward: the saved tensor was not filled by a forward, or an earlier backward already "
                "consumed it (the backward overwrites it); dx and d_topk_weights were set to NaN");
  if (s.code == KernelStatus::bad_plan) {
    plan_->check(nullptr);  // synchronises; throws the planner's message (bad id, capacity)
    throw ArgumentError("mok: the plan was invalid and the outputs were set to NaN");
  }
  throw Error(detail::concat("mok: timeout after ", config_.timeout_seconds, " s on rank ", rank_, " (CTA ", s.block,
                             ", task ", s.task, "): ", kernel_phase_name(s.phase),
                             s.peer >= 0 ? detail::concat(" from peer rank ", s.peer) : std::string(), "; expected ",
                             s.expected, ", observed ", s.observed));
}

void Workspace::check(cudaStream_t stream) {
  const cudaError_t err = cudaStreamSynchronize(stream);
  throw_if_failed();
  if (err != cudaSuccess) throw Error(detail::concat("mok: CUDA error: ", cudaGetErrorString(err)));
  plan_->check(stream);
}

namespace detail {

void check_locations(std::string_view where, const ForwardArgs& a, const MoeShape& s, bool check_output) {
  for (auto [name, view] : {std::pair{"x", &a.x}, {"topk_ids", &a.topk_ids}, {"topk_weights", &a.topk_weights},
                            {"w_gate", &a.w_gate}, {"w_up", &a.w_up}, {"w_down", &a.w_down}})
    if (view->numel() > 0) check_pointer_location(where, name, *view);
  if (check_output && a.y.numel() > 0) check_pointer_location(where, "y", a.y);
  if (s.has_shared())
    for (auto [name, view] : {std::pair{"shared_gate", &*a.shared_gate}, {"shared_up", &*a.shared_up},
                              {"shared_down", &*a.shared_down}})
      check_pointer_location(where, name, *view);
}

namespace {

// A flat buffer argument (saved, scratch): dtype, 1-D with `elements` (at least, or exactly)
// as `from` says, device, then contiguous, non-null and where it says it lives.
void check_flat(std::string_view where, std::string_view arg, const TensorView& v, DType dtype, std::int64_t elements,
                bool at_least, std::string_view from, Device device) {
  if (v.dtype != dtype) throw_dtype_error(where, arg, "dtype must be ", dtype_name(dtype), ", got ", dtype_name(v.dtype));
  if (v.ndim != 1 || (at_least ? v.shape[0] < elements : v.shape[0] != elements))
    throw_argument_error(where, arg, "shape must be [", at_least ? ">= " : "", elements, "] (", from, "), got ",
                         v.shape_string());
  if (v.device != device) throw_argument_error(where, arg, "must be on ", device_name(device), ", got ", device_name(v.device));
  if (v.numel() > 0 && (v.data == nullptr || !v.is_contiguous()))
    throw_argument_error(where, arg, "must be a contiguous non-null tensor");
  if (v.numel() > 0) check_pointer_location(where, arg, v);
}

}  // namespace

void check_saved(std::string_view where, const TensorView& saved, const Workspace& ws, Device device) {
  check_flat(where, "saved", saved, DType::bf16, ws.saved_elements(), false, "Workspace::saved_elements()", device);
}

void* call_scratch(Workspace& ws, const std::optional<TensorView>& given, std::int64_t bytes,
                   std::string_view bytes_from, std::string_view where, cudaStream_t stream) {
  if (!given) return ws.own_scratch(bytes, where, stream);
  int device = 0;
  cuda_check(cudaGetDevice(&device), where, "cudaGetDevice");
  check_flat(where, "scratch", *given, DType::u8, bytes, true, bytes_from, Device::cuda(device));
  if (reinterpret_cast<std::uintptr_t>(given->data) % kPointerAlignment != 0)
    throw_argument_error(where, "scratch", "must be aligned to ", kPointerAlignment, " bytes");
  return given->data;
}

unsigned long long* saved_marker(std::uint16_t* saved, const Workspace& ws) {
  return reinterpret_cast<unsigned long long*>(saved + ws.saved_elements() - kSavedTrailer);
}

int persistent_ctas(const Workspace& ws, std::string_view where) {
  int device = 0, sms = 0;
  cuda_check(cudaGetDevice(&device), where, "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), where, "cudaDeviceGetAttribute");
  return ws.config().compute_sms > 0 ? std::min(ws.config().compute_sms, sms) : sms;
}

void dispatch_rows(std::span<const void* const> rows, void* routed, Workspace& ws, cudaStream_t stream) {
  const MoeShape& s = ws.shape();
  const DevicePlanView& v = ws.plan().view();
  kernels::DispatchParams d{};
  for (std::size_t q = 0; q < rows.size(); ++q) d.x[q] = static_cast<const std::uint16_t*>(rows[q]);
  d.x_routed = static_cast<std::uint16_t*>(routed);
  d.row_pair = v.row_pair;
  d.expert_offset = v.expert_offset;
  d.plan_status = v.status;
  d.capacity = ws.plan().capacity_rows();
  d.pairs_per_rank = static_cast<std::int32_t>(ws.tokens() * s.top_k);
  d.hidden = static_cast<int>(s.hidden);
  d.top_k = static_cast<int>(s.top_k);
  d.num_local_experts = static_cast<int>(s.num_local_experts);
  kernels::launch_dispatch(d, 4 * persistent_ctas(ws, "mok::dispatch"), stream);
}

void dispatch_rows(const void* rows, void* routed, Workspace& ws, cudaStream_t stream) {
  const void* const sources[1] = {rows};
  dispatch_rows(std::span<const void* const>(sources), routed, ws, stream);
}

namespace {

std::uint16_t* at(void* base, std::int64_t byte) { return reinterpret_cast<std::uint16_t*>(static_cast<char*>(base) + byte); }

}  // namespace

ScratchShape scratch_shape(const Workspace& ws) {
  return {ws.shape(), ws.tokens(), ws.plan().capacity_rows(), ws.saved_elements(), ws.training()};
}

// [f32 slots (capacity + T_pad) x H, x rows = the bf16 rows [capacity, 2 capacity) of its
// view as bf16 [2 (capacity + T_pad), H]][h capacity x I][shared h T_pad x I_s]
CallBuffers forward_buffers(const ScratchShape& shape, void* scratch) {
  const MoeShape& s = shape.shape;
  const std::int64_t cap = shape.capacity, Tpad = shared_tiles(s, shape.tokens) * kTileRows;
  const std::int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
  CallBuffers b;
  b.slots = reinterpret_cast<float*>(scratch);
  b.x_rows = at(scratch, 2 * cap * H);
  b.hidden = at(scratch, 4 * (cap + Tpad) * H);
  b.shared_hidden = at(scratch, 4 * (cap + Tpad) * H + 2 * cap * I);
  b.bytes = 4 * (cap + Tpad) * H + 2 * (cap * I + Tpad * Is);
  return b;
}

// [dy rows capacity x H, unless in d_w_gate][x rows, then dx rows, capacity x H][shared dx
// rows T_pad x H][w h capacity x I, unless in d_w_up][shared w h T_pad x I_s][recomputed
// pre-activations]. The recompute's GEMM1 runs the forward kernel on this layout: its x rows
// then sit where the forward's do (the dy rows are never in d_w_gate), its slots unused.
CallBuffers backward_buffers(const ScratchShape& shape, void* scratch, void* d_w_gate, void* d_w_up) {
  const MoeShape& s = shape.shape;
  const std::int64_t cap = shape.capacity, Tpad = shared_tiles(s, shape.tokens) * kTileRows;
  const std::int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate, El = s.num_local_experts;
  const bool in_grads = shape.training == Training::save && d_w_gate != nullptr && d_w_up != nullptr;
  const bool dy_in_grads = in_grads && cap * H <= El * I * H, hw_in_grads = in_grads && cap * I <= El * I * H;
  CallBuffers b;
  std::int64_t used = 0;
  b.slots = reinterpret_cast<float*>(scratch);
  b.dy_rows = dy_in_grads ? static_cast<std::uint16_t*>(d_w_gate) : at(scratch, used);
  if (!dy_in_grads) used += 2 * cap * H;
  b.x_rows = b.dx_rows = at(scratch, used);
  used += 2 * cap * H;
  b.shared_dx_rows = at(scratch, used);
  used += 2 * Tpad * H;
  b.hidden = hw_in_grads ? static_cast<std::uint16_t*>(d_w_up) : at(scratch, used);
  if (!hw_in_grads) used += 2 * cap * I;
  b.shared_hidden = at(scratch, used);
  used += 2 * Tpad * Is;
  if (shape.training == Training::recompute) {
    b.recompute = at(scratch, used);
    used += 2 * shape.saved_elements;
  }
  b.rows_in_grads = dy_in_grads || hw_in_grads;
  b.bytes = used;
  return b;
}

CallBuffers rank_buffers(const Workspace& ws) {
  CallBuffers b;
  b.slots = ws.slots();
  b.x_rows = static_cast<std::uint16_t*>(ws.x_routed());
  b.hidden = static_cast<std::uint16_t*>(ws.hidden());
  b.shared_hidden = b.hidden ? b.hidden + ws.plan().capacity_rows() * ws.shape().intermediate : nullptr;
  b.dy_rows = static_cast<std::uint16_t*>(ws.dy_routed());
  b.dx_rows = static_cast<std::uint16_t*>(ws.dx_rows());
  b.shared_dx_rows = static_cast<std::uint16_t*>(ws.shared_dx_rows());
  b.recompute = static_cast<std::uint16_t*>(ws.recompute_buffer());
  return b;
}

kernels::ForwardParams forward_params(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers,
                                      std::uint16_t* saved_gu, bool gemm1_only) {
  const MoeShape& s = ws.shape();
  const std::int64_t T = ws.tokens();
  DevicePlan& plan = ws.plan();

  const std::int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts, Is = s.shared_intermediate;
  const std::int64_t capacity = plan.capacity_rows(), n_shared_tiles = shared_tiles(s, T);
  const std::int64_t padded_tokens = n_shared_tiles * kTileRows;
  const DevicePlanView& v = plan.view();
  using U = std::uint64_t;
  kernels::ForwardParams p{};
  p.maps.x = make_bf16_tensor_map(a.x.data, {U(H), U(T)}, {64, 128}, "x");
  p.maps.x_routed = make_bf16_tensor_map(buffers.x_rows, {U(H), U(capacity)}, {64, 128}, "x_routed");
  std::uint16_t* hidden = buffers.hidden;
  p.maps.gate = make_bf16_tensor_map(a.w_gate.data, {U(H), U(I), U(El)}, {64, 128, 1}, "w_gate");
  p.maps.up = make_bf16_tensor_map(a.w_up.data, {U(H), U(I), U(El)}, {64, 128, 1}, "w_up");
  p.maps.down = make_bf16_tensor_map(a.w_down.data, {U(I), U(H), U(El)}, {64, 256, 1}, "w_down");
  p.maps.h_store = make_bf16_tensor_map(hidden, {U(I), U(capacity)}, {64, 64}, "h");
  p.maps.h_load = make_bf16_tensor_map(hidden, {U(I), U(capacity)}, {64, 128}, "h");
  if (s.has_shared()) {
    std::uint16_t* shared_hidden = buffers.shared_hidden;
    p.maps.shared_gate = make_bf16_tensor_map(a.shared_gate->data, {U(H), U(Is), 1}, {64, 128, 1}, "shared_gate");
    p.maps.shared_up = make_bf16_tensor_map(a.shared_up->data, {U(H), U(Is), 1}, {64, 128, 1}, "shared_up");
    p.maps.shared_down = make_bf16_tensor_map(a.shared_down->data, {U(Is), U(H), 1}, {64, 256, 1}, "shared_down");
    p.maps.shared_h_store = make_bf16_tensor_map(shared_hidden, {U(Is), U(padded_tokens)}, {64, 64}, "shared h");
    p.maps.shared_h_load = make_bf16_tensor_map(shared_hidden, {U(Is), U(padded_tokens)}, {64, 128}, "shared h");
    p.shared_slots = buffers.slots + capacity * H;
    p.maps.shared_slots = make_f32_tensor_map(p.shared_slots, {U(H), U(padded_tokens)}, {32, 64}, "shared slots");
  }
  p.maps.slots = make_f32_tensor_map(buffers.slots, {U(H), U(capacity)}, {32, 64}, "slots");
  fill_common_params(p, ws, a.topk_weights.data);
  p.expert_rows = v.expert_rows;
  p.slots = buffers.slots;
  p.y = static_cast<std::uint16_t*>(a.y.data);
  p.saved_gu = saved_gu;
  p.shared_saved_gu = saved_gu && s.has_shared() ? saved_gu + 2 * capacity * I : nullptr;
  p.saved_marker = saved_gu ? saved_marker(saved_gu, ws) : nullptr;
  p.gemm1_only = gemm1_only;
  // One GPU: x rows in the upper half of the slots (forward_buffers()).
  p.x_rows_in_slots = ws.rows_in_slots() ? capacity : 0;
  p.inter = static_cast<int>(I);
  p.shared_inter = static_cast<int>(Is);
  return p;
}

void launch_forward_kernel(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers, cudaStream_t stream,
                           std::uint16_t* saved_gu, bool gemm1_only, std::string_view where) {
  dispatch_rows(a.x.data, buffers.x_rows, ws, stream);
  cuda_check(cudaMemsetAsync(ws.counters(), 0, 4 * ws.counter_count(), stream), where, "cudaMemsetAsync(counters)");
  kernels::launch_forward(forward_params(a, ws, buffers, saved_gu, gemm1_only), persistent_ctas(ws, where), stream);
  cuda_check(cudaGetLastError(), where, "launching the forward kernel");
}

}  // namespace detail

void forward(const ForwardArgs& a, Workspace& ws, cudaStream_t stream, const std::optional<TensorView>& saved,
             const std::optional<TensorView>& scratch) {
  ws.throw_if_failed();
  const MoeShape& s = ws.shape();
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  const std::int64_t T = validate_forward_args(kWhere, s, a, Device::cuda(device));
  if (T != ws.tokens())
    throw_argument_error(kWhere, "x", "has ", T, " tokens but the workspace was made for ", ws.tokens());
  detail::check_locations(kWhere, a, s, true);
  if (saved) {
    if (ws.training() != Training::save)
      throw_argument_error(kWhere, "saved", "needs a workspace made with Training::save");
    detail::check_saved(kWhere, *saved, ws, Device::cuda(device));
  }
  if (T == 0) {
    if (scratch) detail::call_scratch(ws, scratch, 0, kScratchFrom, kWhere, stream);  // (checked all the same)
    return;
  }
  void* base = detail::call_scratch(ws, scratch, ws.forward_scratch_bytes(), kScratchFrom, kWhere, stream);
  plan_device(a.topk_ids, 0, ws.plan(), stream);
  detail::launch_forward_kernel(a, ws, detail::forward_buffers(ws, base), stream,
                                saved ? static_cast<std::uint16_t*>(saved->data) : nullptr, false, kWhere);
}

}  // namespace mok
