// mok::Workspace: what one shape keeps between calls (the plan, counters, the d_topk_weights
// partials, an EP rank's own row buffers), the errors the device records and their texts.
#include "mok/forward.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>

#include "cuda_check.hpp"
#include "launch_cache.hpp"
#include "layer_launch.hpp"
#include "mok/error.hpp"

namespace mok {
namespace {

void check_cuda(cudaError_t err, const char* what) { detail::cuda_check(err, "mok::Workspace", what); }

template <typename T>
void allocate(T*& ptr, std::int64_t bytes, const char* what, std::int64_t& total) {
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<std::int64_t>(bytes, 16)), what);
  total += bytes;
}

std::int64_t dh_tiles(const MoeShape& s) { return (s.intermediate + 255) / 256; }

// A layer's token count: T >= 0, and T * k inside the plan's int32 pair ids.
void check_tokens(std::string_view where, const MoeShape& shape, std::int64_t tokens) {
  if (tokens < 0) throw_argument_error(where, "tokens", "must be >= 0, got ", tokens);
  if (tokens * shape.top_k > std::numeric_limits<std::int32_t>::max())
    throw_argument_error(where, "tokens", "T*k must fit in int32, got ", tokens * shape.top_k);
}

// The plan rows a call of T tokens gets: every routed row plus padding (capacity_factor 0),
// else capacity_factor * T * k rows plus padding, in whole tiles, at least one.
std::int64_t call_capacity_rows(const MoeShape& shape, std::int64_t tokens, const Config& config) {
  PlanOptions options;
  options.block_m = detail::kTileRows;
  if (config.capacity_factor > 0) options.capacity_rows = plan_capacity_rows(shape, config, tokens, detail::kTileRows);
  return std::max(device_plan_capacity_rows(shape, tokens, options), detail::kTileRows);
}

}  // namespace

const char* wait_site_text(WaitSite site) {
  switch (site) {
    case WaitSite::none: return "no wait";
    case WaitSite::stage_full: return "waiting for a filled pipeline stage (full barrier)";
    case WaitSite::stage_empty: return "waiting for a free pipeline stage (empty barrier)";
    case WaitSite::hidden_ready: return "forward: waiting for GEMM1 rows of an M-tile (h_ready)";
    case WaitSite::all_gemm2: return "forward: waiting for every GEMM2 tile before the combine (y_done)";
    case WaitSite::dh_ready:
      return "backward: waiting for the dh tiles of an M-tile (and on one GPU its expert's dW_gate|up tiles) (dgu_ready)";
    case WaitSite::expert_dh_ready:
      return "backward: waiting for every dh tile of an expert before its weight gradients (dgu_ready)";
    case WaitSite::all_dx: return "backward: waiting for every dx row tile before the combine (dx_done)";
    case WaitSite::forward_pushed:
      return "forward: waiting for the result rows a peer rank pushes into this rank's combine slots (slots_done)";
    case WaitSite::backward_pushed:
      return "backward: waiting for the dx rows and d_topk_weights partials a peer rank pushes (slots_done)";
    case WaitSite::forward_landed: return "forward: waiting for a minibatch of rows to land in the ring (landed)";
    case WaitSite::forward_freed: return "forward: comm CTA waiting for GEMM1 to free a ring slot (freed)";
    case WaitSite::exchange_flag: return "waiting for a peer rank's routing exchange of this call (exchange flag)";
    case WaitSite::plan_flag: return "waiting for a peer rank's plan of this call (plan flag)";
    case WaitSite::forward_copy:
      return "forward: comm CTA waiting for a bulk copy of rows into its staging (comm loaded barrier)";
    case WaitSite::backward_landed:
      return "backward: waiting for a minibatch of dy and x rows to land in the ring (landed)";
    case WaitSite::backward_freed:
      return "backward: comm CTA waiting for the dh and weight-gradient tasks to free a ring slot (freed)";
    case WaitSite::backward_copy:
      return "backward: comm CTA waiting for a bulk copy of rows into its staging (comm loaded barrier)";
    case WaitSite::x_rows_read:
      return "forward: waiting for GEMM1 to read the x rows that a GEMM2 tile's slot rows overwrite (h_ready)";
    case WaitSite::mainloop_turn:
      return "forward (ping-pong): a consumer warpgroup waiting for the other's mainloop to reach its last stage (turn "
             "barrier)";
    case WaitSite::x_rows_copied:
      return "forward: waiting for the producer warps to copy an M-tile's routed x rows (x_copied)";
    case WaitSite::grad_rows_read:
      return "backward: waiting for every dW_down tile to read the dy rows and w*h kept in the W_gate / W_up "
             "gradient buffers (wd_done)";
  }
  return "unknown wait site";
}

Workspace::Workspace(const MoeShape& shape, std::int64_t tokens, const Config& config, Training training)
    : Workspace(shape, tokens, config, training, ForRank{-1}) {}

Workspace::Workspace(const MoeShape& shape, std::int64_t tokens, const Config& config, Training training, ForRank rank)
    : rank_(std::max(rank.rank, 0)), shape_(shape), config_(config), training_(training), max_tokens_(tokens) {
  validate(shape);
  validate(config);
  if (rank.rank < 0 && shape.ep_size() != 1)
    throw_argument_error("mok::Workspace", "num_local_experts",
                         "must equal num_experts = ", shape.num_experts, " on one GPU (got ", shape.num_local_experts,
                         "); an expert-parallel group's workspaces come from mok::VirtualRanks");
  if (config.precision == Precision::fp8) {
    if (rank.rank >= 0 && (config.comm_sms > 0 || config.ring_rows > 0))
      throw_argument_error("mok::Workspace", config.comm_sms > 0 ? "config.comm_sms" : "config.ring_rows",
                           "must be 0 with Precision::fp8 (an EP rank's FP8 forward pulls and quantizes its rows "
                           "before the kernel; the ring token buffer carries bf16 rows only for now), got comm_sms = ",
                           config.comm_sms, ", ring_rows = ", config.ring_rows);
    if (training == Training::recompute)
      throw_argument_error("mok::Workspace", "config.precision",
                           "fp8 trains with Training::save (its backward reads the saved pre-activations of the FP8 "
                           "forward; a recompute would redo GEMM1 in bf16)");
    if (config.interleave_rows > 0)
      throw_argument_error("mok::Workspace", "config.interleave_rows",
                           "must be 0 with Precision::fp8 (its kernel runs GEMM1 before GEMM2), got ",
                           config.interleave_rows);
    if (shape.hidden % kernels::kFp8BlockK != 0 || shape.intermediate % kernels::kFp8BlockK != 0)
      throw_argument_error("mok::Workspace", "shape", "Precision::fp8 needs hidden and intermediate multiples of ",
                           kernels::kFp8BlockK, " (its scale blocks), got hidden = ", shape.hidden,
                           ", intermediate = ", shape.intermediate);
  }
  check_tokens("mok::Workspace", shape, tokens);
  PlanOptions options;
  options.block_m = detail::kTileRows;
  options.capacity_rows = call_capacity_rows(shape, tokens, config);
  plan_ = std::make_unique<DevicePlan>(shape, tokens, options);
  launch_cache_ = std::make_unique<detail::LaunchCache>(config.replay_launches);

  const std::int64_t capacity = plan_->allocated_rows();
  const std::int64_t padded_tokens = detail::shared_tiles(shape, tokens) * detail::kTileRows;
  const std::int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  if (rank.rank >= 0) {  // an EP rank owns its row buffers; one GPU's calls take scratch
    allocate(x_routed_, 2 * capacity * H, "cudaMalloc(x_routed)", bytes_);
    allocate(hidden_, 2 * (capacity * I + padded_tokens * Is), "cudaMalloc(hidden)", bytes_);
    // (bf16 rows: detail::rank_slot_rows)
    const detail::RankSlotRows slot_rows = detail::rank_slot_rows(shape, training, config.precision, capacity,
                                                                  padded_tokens);
    allocate(slots_, 2 * slot_rows.rows * H, "cudaMalloc(slots)", bytes_);
    dx_row0_ = slot_rows.dx_rows, shared_dx_row0_ = slot_rows.shared_dx_rows;
    if (training == Training::recompute) allocate(recompute_, 2 * saved_elements(), "cudaMalloc(recompute)", bytes_);
    if (config.fp8_dgrad && config.precision == Precision::fp8 && training == Training::save)
      allocate(fp8_dgrad_rows_, detail::rank_fp8_dgrad_bytes(*this), "cudaMalloc(FP8 dgrad rows)", bytes_);
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
                  static_cast<void*>(dw_partial_), recompute_, scratch_, fp8_dgrad_rows_})
    cudaFree(p);
  cudaFreeHost(status_host_);
}

std::int64_t Workspace::tokens() const { return plan_->tokens(); }
std::int64_t Workspace::replayed_calls() const { return launch_cache_->replays(); }
std::int64_t Workspace::captured_calls() const { return launch_cache_->captures(); }

std::int64_t Workspace::counter_count() const {
#if defined(MOK_DIAG_COPY_WARPS)  // (and the forward's x_copied: detail::x_copied_counters)
  return detail::counters_per_tile(*this) + 3 + plan_->allocated_tiles();
#else
  return detail::counters_per_tile(*this) + 3;  // per-tile counters, done, abort, wd_done
#endif
}

void Workspace::begin_call(std::int64_t tokens, std::string_view where) {
  enqueued_rows_.reset();
  if (!rows_in_slots()) {  // an EP rank: its group's T
    if (tokens != max_tokens_)
      throw_argument_error(where, "x", "has ", tokens, " tokens but the rank was made for ", max_tokens_);
    return;
  }
  if (tokens > max_tokens_)
    throw_argument_error(where, "x", "has ", tokens, " tokens, more than the workspace's max_tokens = ", max_tokens_,
                         " (make a workspace for the largest T)");
  plan_->set_tokens(tokens, capacity_rows(tokens));
}

std::int64_t Workspace::capacity_rows(std::int64_t tokens) const {
  return std::min(call_capacity_rows(shape_, tokens, config_), plan_->allocated_rows());
}

std::int64_t Workspace::forward_scratch_bytes(std::int64_t tokens) const {
  return rows_in_slots() ? detail::forward_buffers(detail::scratch_shape(*this, tokens), nullptr).bytes : 0;
}

std::int64_t Workspace::backward_scratch_bytes(DType grad_dtype, std::int64_t tokens, bool gate_up_adjacent,
                                              bool dx_apart, bool fp8_dgrad, bool fp8_wgrad) const {
  if (!rows_in_slots() || training_ == Training::off) return 0;
  // (stand-in addresses for the gradient buffers and dx: only the sizes and their adjacency are used)
  auto* dx = dx_apart ? reinterpret_cast<std::uint16_t*>(std::uintptr_t{1} << 38) : nullptr;
  if (grad_dtype != DType::bf16)
    return detail::backward_buffers(detail::scratch_shape(*this, tokens), nullptr, nullptr, nullptr, dx, fp8_dgrad, fp8_wgrad)
        .bytes;
  auto* a = reinterpret_cast<std::uint16_t*>(std::uintptr_t{256});
  std::uint16_t* b = gate_up_adjacent ? a + shape_.num_local_experts * shape_.intermediate * shape_.hidden : a;
  return detail::backward_buffers(detail::scratch_shape(*this, tokens), nullptr, a, b, dx, fp8_dgrad, fp8_wgrad).bytes;
}

void* Workspace::own_scratch(std::int64_t bytes, std::string_view where, cudaStream_t stream) {
  if (scratch_ != nullptr && bytes <= scratch_bytes_) return scratch_;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  detail::cuda_check(cudaStreamIsCapturing(stream, &capturing), where, "cudaStreamIsCapturing");
  if (capturing != cudaStreamCaptureStatusNone)
    throw_argument_error(where, "scratch", "is needed: this workspace allocates its own on its first call (and a larger "
                                           "one on the first call that needs more: BackwardArgs::fp8_weight_gradients), "
                                           "which cannot happen while a CUDA graph is being captured (run one such call "
                                           "first, or pass scratch)");
  if (scratch_ != nullptr) {  // grown: after the work that may still use the old one
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(before growing the scratch)");
    check_cuda(cudaFree(scratch_), "cudaFree(scratch)");
    bytes_ -= scratch_bytes_;
    scratch_ = nullptr;
  }
  // One buffer for every call: the larger of the forward's and the backward's (f32 gradients;
  // Precision::fp8: with the FP8 dgrad's rows), or of this call's when larger (the FP8 weight
  // gradients' operands, which a workspace does not hold until a call asks for them).
  const bool fp8 = config_.precision == Precision::fp8;
  scratch_bytes_ = std::max({bytes, forward_scratch_bytes(), backward_scratch_bytes(DType::f32, max_tokens_, false, false, fp8)});
  allocate(scratch_, scratch_bytes_, "cudaMalloc(scratch)", bytes_);
  return scratch_;
}


std::int64_t saved_elements(const MoeShape& shape, std::int64_t tokens, const Config& config) {
  validate(shape);
  check_tokens("mok::saved_elements", shape, tokens);  // (as the Workspace it sizes)
  const std::int64_t capacity = call_capacity_rows(shape, tokens, config);
  const std::int64_t padded_tokens = detail::shared_tiles(shape, tokens) * detail::kTileRows;
  return 2 * (capacity * shape.intermediate + padded_tokens * shape.shared_intermediate) + detail::kSavedTrailer;
}


std::int64_t Workspace::saved_elements(std::int64_t tokens) const { return mok::saved_elements(shape_, tokens, config_); }

void Workspace::throw_if_failed() const {
  const volatile KernelStatus* v = status_host_;  // written by the device, read without a sync
  if (v->code == KernelStatus::ok) return;
  const KernelStatus s{v->code, v->block, v->task, v->site, v->peer, 0, v->observed, v->expected};
  status_host_->code = KernelStatus::ok;  // reported once
  if (s.code == KernelStatus::saved_not_valid)
    throw ArgumentError("mok::backward: the saved tensor was not filled by a forward, or an earlier backward already "
                "consumed it (the backward overwrites it); dx and d_topk_weights were set to NaN");
  if (s.code == KernelStatus::bad_plan) {
    plan_->check(nullptr);  // synchronises; throws the planner's message (bad id, capacity)
    throw ArgumentError("mok: the plan was invalid and the outputs were set to NaN");
  }
  throw Error(detail::concat("mok: timeout after ", config_.timeout_seconds, " s on rank ", rank_, " (CTA ", s.block,
                             ", task ", s.task, "): ", wait_site_text(s.site),
                             s.peer >= 0 ? detail::concat(" from peer rank ", s.peer) : std::string(), "; expected ",
                             s.expected, ", observed ", s.observed));
}

void Workspace::check(cudaStream_t stream) {
  const cudaError_t err = cudaStreamSynchronize(stream);
  throw_if_failed();
  if (err != cudaSuccess) throw Error(detail::concat("mok: CUDA error: ", cudaGetErrorString(err)));
  plan_->check(stream);
}

}  // namespace mok
