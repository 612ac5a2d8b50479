#include "mok/forward.hpp"

#include <cuda_runtime_api.h>

#include <cmath>
#include <limits>

#include "kernels/dispatch.cuh"
#include "kernels/forward.cuh"
#include "cuda_check.hpp"
#include "mok/error.hpp"
#include "tensor_map.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::forward";

void check_cuda(cudaError_t err, const char* what) { detail::cuda_check(err, kWhere, what); }

std::int64_t shared_tiles(const MoeShape& s, std::int64_t tokens) {
  return s.has_shared() ? (tokens + kernels::kBlockM - 1) / kernels::kBlockM : 0;
}

}  // namespace

const char* kernel_phase_name(std::int32_t phase) {
  switch (phase) {
    case 1: return "waiting for a filled pipeline stage (full barrier)";
    case 2: return "waiting for a free pipeline stage (empty barrier)";
    case 3: return "waiting for GEMM1 rows of an M-tile (h_ready)";
    case 4: return "waiting for every GEMM2 tile before the combine (y_done)";
    default: return "unknown phase";
  }
}

Workspace::Workspace(const MoeShape& shape, std::int64_t tokens, const Config& config)
    : shape_(shape), config_(config), tokens_(tokens) {
  validate(shape);
  validate(config);
  if (shape.ep_size() != 1)
    throw_argument_error("mok::Workspace", "num_local_experts",
                         "expert parallelism is not supported yet: must equal num_experts = ", shape.num_experts,
                         ", got ", shape.num_local_experts);
  if (tokens < 0) throw_argument_error("mok::Workspace", "tokens", "must be >= 0, got ", tokens);
  if (tokens * shape.top_k > std::numeric_limits<std::int32_t>::max())
    throw_argument_error("mok::Workspace", "tokens", "T*k must fit in int32, got ", tokens * shape.top_k);
  PlanOptions options;
  options.block_m = kernels::kBlockM;
  if (config.capacity_factor > 0) options.capacity_rows = plan_capacity_rows(shape, config, tokens, kernels::kBlockM);
  plan_ = std::make_unique<DevicePlan>(shape, tokens, options);

  const std::int64_t capacity = plan_->capacity_rows(), padded_tokens = shared_tiles(shape, tokens) * kernels::kBlockM;
  const std::int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  const std::int64_t routed_x_bytes = 2 * capacity * H;
  const std::int64_t hidden_bytes = 2 * (capacity * I + padded_tokens * Is);
  const std::int64_t slot_bytes = 4 * (capacity * H + padded_tokens * H);
  check_cuda(cudaMalloc(&x_routed_, std::max<std::int64_t>(routed_x_bytes, 16)), "cudaMalloc(x_routed)");
  check_cuda(cudaMalloc(&hidden_, std::max<std::int64_t>(hidden_bytes, 16)), "cudaMalloc(hidden)");
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&slots_), std::max<std::int64_t>(slot_bytes, 16)), "cudaMalloc(slots)");
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&counters_), 4 * counter_count()), "cudaMalloc(counters)");
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&status_host_), sizeof(KernelStatus), cudaHostAllocMapped),
             "cudaHostAlloc(status)");
  *status_host_ = KernelStatus{};
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device_), status_host_, 0),
             "cudaHostGetDevicePointer(status)");
  bytes_ = routed_x_bytes + hidden_bytes + slot_bytes + 4 * counter_count();
}

Workspace::~Workspace() {
  cudaFree(x_routed_);
  cudaFree(hidden_);
  cudaFree(slots_);
  cudaFree(counters_);
  cudaFreeHost(status_host_);
}

std::int64_t Workspace::counter_count() const {
  return plan_->max_tiles() + shared_tiles(shape_, tokens_) + 2;  // h_ready[...], y_done, abort
}

void Workspace::throw_if_failed() const {
  const volatile KernelStatus* v = status_host_;  // written by the device, read without a sync
  if (v->code == KernelStatus::ok) return;
  const KernelStatus s{v->code, v->block, v->task, v->phase, v->observed, v->expected};
  status_host_->code = KernelStatus::ok;  // reported once
  if (s.code == KernelStatus::bad_plan) {
    plan_->check(nullptr);  // synchronises; throws the planner's message (bad id, capacity)
    throw Error("mok::forward: the plan was invalid and the output was set to NaN");
  }
  throw Error(detail::concat("mok::forward: timeout after ", config_.timeout_seconds, " s on rank 0 (CTA ", s.block,
                             ", task ", s.task, "): ", kernel_phase_name(s.phase), "; expected ", s.expected,
                             ", observed ", s.observed));
}

void Workspace::check(cudaStream_t stream) {
  const cudaError_t err = cudaStreamSynchronize(stream);
  throw_if_failed();
  if (err != cudaSuccess) throw Error(detail::concat("mok: CUDA error: ", cudaGetErrorString(err)));
  plan_->check(stream);
}

void forward(const ForwardArgs& a, Workspace& ws, cudaStream_t stream) {
  ws.throw_if_failed();
  const MoeShape& s = ws.shape();
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const std::int64_t T = validate_forward_args(kWhere, s, a, Device::cuda(device));
  if (T != ws.tokens())
    throw_argument_error(kWhere, "x", "has ", T, " tokens but the workspace was made for ", ws.tokens());
  for (auto [name, view] : {std::pair{"x", &a.x}, {"topk_ids", &a.topk_ids}, {"topk_weights", &a.topk_weights},
                            {"w_gate", &a.w_gate}, {"w_up", &a.w_up}, {"w_down", &a.w_down}, {"y", &a.y}})
    if (view->numel() > 0) check_pointer_location(kWhere, name, *view);
  if (s.has_shared())
    for (auto [name, view] : {std::pair{"shared_gate", &*a.shared_gate}, {"shared_up", &*a.shared_up},
                              {"shared_down", &*a.shared_down}})
      check_pointer_location(kWhere, name, *view);
  if (T == 0) return;

  DevicePlan& plan = ws.plan();
  plan_device(a.topk_ids, 0, plan, stream);
  check_cuda(cudaMemsetAsync(ws.counters(), 0, 4 * ws.counter_count(), stream), "cudaMemsetAsync(counters)");
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const int ctas = ws.config().compute_sms > 0 ? std::min(ws.config().compute_sms, sms) : sms;

  const std::int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts, Is = s.shared_intermediate;
  const std::int64_t capacity = plan.capacity_rows(), n_shared_tiles = shared_tiles(s, T);
  const std::int64_t padded_tokens = n_shared_tiles * kernels::kBlockM;
  const DevicePlanView& v = plan.view();
  auto* x_routed = static_cast<std::uint16_t*>(ws.x_routed());
  kernels::DispatchParams dispatch{static_cast<const std::uint16_t*>(a.x.data), x_routed, v.row_pair, v.expert_offset,
                                   v.status, capacity, static_cast<int>(H), static_cast<int>(s.top_k),
                                   static_cast<int>(El)};
  kernels::launch_dispatch(dispatch, 4 * ctas, stream);

  using detail::make_bf16_tensor_map;
  kernels::ForwardParams p{};
  p.maps.x = make_bf16_tensor_map(a.x.data, {std::uint64_t(H), std::uint64_t(T)}, {64, 128}, "x");
  p.maps.x_routed = make_bf16_tensor_map(x_routed, {std::uint64_t(H), std::uint64_t(capacity)}, {64, 128}, "x_routed");
  auto* hidden = static_cast<std::uint16_t*>(ws.hidden());
  p.maps.gate = make_bf16_tensor_map(a.w_gate.data, {std::uint64_t(H), std::uint64_t(I), std::uint64_t(El)}, {64, 128, 1}, "w_gate");
  p.maps.up = make_bf16_tensor_map(a.w_up.data, {std::uint64_t(H), std::uint64_t(I), std::uint64_t(El)}, {64, 128, 1}, "w_up");
  p.maps.down = make_bf16_tensor_map(a.w_down.data, {std::uint64_t(I), std::uint64_t(H), std::uint64_t(El)}, {64, 256, 1}, "w_down");
  p.maps.h_store = make_bf16_tensor_map(hidden, {std::uint64_t(I), std::uint64_t(capacity)}, {64, 64}, "h");
  p.maps.h_load = make_bf16_tensor_map(hidden, {std::uint64_t(I), std::uint64_t(capacity)}, {64, 128}, "h");
  if (s.has_shared()) {
    std::uint16_t* shared_hidden = hidden + capacity * I;
    p.maps.shared_gate = make_bf16_tensor_map(a.shared_gate->data, {std::uint64_t(H), std::uint64_t(Is), 1}, {64, 128, 1}, "shared_gate");
    p.maps.shared_up = make_bf16_tensor_map(a.shared_up->data, {std::uint64_t(H), std::uint64_t(Is), 1}, {64, 128, 1}, "shared_up");
    p.maps.shared_down = make_bf16_tensor_map(a.shared_down->data, {std::uint64_t(Is), std::uint64_t(H), 1}, {64, 256, 1}, "shared_down");
    p.maps.shared_h_store = make_bf16_tensor_map(shared_hidden, {std::uint64_t(Is), std::uint64_t(padded_tokens)}, {64, 64}, "shared h");
    p.maps.shared_h_load = make_bf16_tensor_map(shared_hidden, {std::uint64_t(Is), std::uint64_t(padded_tokens)}, {64, 128}, "shared h");
    p.shared_slots = ws.slots() + capacity * H;
  }
  p.row_pair = v.row_pair;
  p.tile_expert = v.tile_expert;
  p.tile_row = v.tile_row;
  p.num_tiles = v.num_tiles;
  p.expert_rows = v.expert_rows;
  p.expert_offset = v.expert_offset;
  p.pair_row = v.pair_row;
  p.plan_status = v.status;
  p.topk_weights = static_cast<const float*>(a.topk_weights.data);
  p.slots = ws.slots();
  p.y = static_cast<std::uint16_t*>(a.y.data);
  p.counters = {ws.counters(), ws.counters() + plan.max_tiles() + n_shared_tiles, ws.counters() + plan.max_tiles() + n_shared_tiles + 1};
  p.status = ws.status_device();
  p.tokens = static_cast<int>(T);
  p.hidden = static_cast<int>(H);
  p.inter = static_cast<int>(I);
  p.shared_inter = static_cast<int>(Is);
  p.top_k = static_cast<int>(s.top_k);
  p.num_local_experts = static_cast<int>(El);
  p.shared_tiles = static_cast<int>(n_shared_tiles);
  p.max_routed_tiles = static_cast<int>(plan.max_tiles());
  p.swiglu_limit = s.swiglu_limit ? *s.swiglu_limit : std::numeric_limits<float>::infinity();
  p.timeout_ns = static_cast<long long>(ws.config().timeout_seconds * 1e9);
  kernels::launch_forward(p, ctas, stream);
  check_cuda(cudaGetLastError(), "launching the forward kernel");
}

}  // namespace mok
