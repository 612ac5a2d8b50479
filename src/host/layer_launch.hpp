// Host steps shared by forward() and backward(): argument checks against a workspace,
// the plan + row copy, and the forward kernel's launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string_view>

#include "kernels/backward/backward.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/forward/forward_fp8.cuh"
#include "kernels/fp8/quantize.cuh"
#include "mok/error.hpp"
#include "mok/forward.hpp"
#include "mok/validate.hpp"

namespace mok::detail {

inline constexpr std::int64_t kTileRows = 128;  // the kernels' M-tile = the plan's block_m
inline constexpr std::int64_t kSavedTrailer = 8;  // bf16 elements at a saved tensor's end: the 8-byte validity marker
// Config::backward_column_blocks 0: this many (the x / dx rows, the backward scratch's largest
// buffer, at half their bytes; bench/NOTES.md, thirteenth session). MOK_DIAG_WHOLE_ROWS (a
// diagnostic build, for same-run A/Bs): one, as before.
#if defined(MOK_DIAG_WHOLE_ROWS)
inline constexpr std::int64_t kBackwardColumnBlocks = 1;
#else
inline constexpr std::int64_t kBackwardColumnBlocks = 2;
#endif

inline std::int64_t shared_tiles(const MoeShape& s, std::int64_t tokens) {
  return s.has_shared() ? (tokens + kTileRows - 1) / kTileRows : 0;
}

// Checks that every tensor lives where it says and `saved` (if given) fits the workspace.
void check_locations(std::string_view where, const ForwardArgs& a, const MoeShape& s, bool check_output);
void check_saved(std::string_view where, const TensorView& saved, const Workspace& ws, Device device);

// The validity marker at the end of a saved tensor (set by the forward kernel, checked by
// the backward kernel, cleared after it).
unsigned long long* saved_marker(std::uint16_t* saved, const Workspace& ws);

// Per-tile counters a workspace holds: its allocated routed tiles, then the shared expert's
// tiles of max_tokens (a call uses the first max_tiles() + shared_tiles(T) of them).
inline std::int64_t counters_per_tile(const Workspace& ws) {
  return ws.plan().allocated_tiles() + shared_tiles(ws.shape(), ws.max_tokens());
}

// The fields both kernels' params share: plan tables, routing weights, counters, status
// and sizes of the current call.
template <typename Params>
void fill_common_params(Params& p, const Workspace& ws, const void* topk_weights) {
  const MoeShape& s = ws.shape();
  const DevicePlan& plan = ws.plan();
  const DevicePlanView& v = plan.view();
  p.plan = {v.row_pair, v.tile_expert, v.tile_row, v.num_tiles, v.expert_offset, v.pair_row, v.status};
  p.topk_weights = static_cast<const float*>(topk_weights);
  const std::int64_t per_tile = counters_per_tile(ws);
  // [per-tile counters (h_ready / dgu_ready)..., done (y_done / dx_done), abort, the backward's wd_done]
  p.counters = {ws.counters(), ws.counters() + per_tile, ws.counters() + per_tile + 1};
  p.status = ws.status_device();
  p.tokens = static_cast<int>(ws.tokens());
  p.hidden = static_cast<int>(s.hidden);
  p.top_k = static_cast<int>(s.top_k);
  p.num_local_experts = static_cast<int>(s.num_local_experts);
  p.shared_tiles = static_cast<int>(shared_tiles(s, ws.tokens()));
  p.max_routed_tiles = static_cast<int>(plan.max_tiles());
  p.swiglu_limit = s.swiglu_limit ? *s.swiglu_limit : std::numeric_limits<float>::infinity();
  p.timeout_ns = static_cast<long long>(ws.config().timeout_seconds * 1e9);
}

// Where one call's row buffers lie (kernels' view); null = none.
struct CallBuffers {
  std::uint16_t* slots = nullptr;           // forward: [capacity + T_pad, H] bf16 result rows
  std::uint16_t* x_rows = nullptr;          // [capacity, H]: x's routed rows (one GPU: backward's dx rows over them)
  std::uint16_t* hidden = nullptr;          // [capacity, I]: h (forward), w h (backward)
  std::uint16_t* shared_hidden = nullptr;   // [T_pad, I_s]
  std::uint16_t* dy_rows = nullptr;         // backward: [capacity, H], or its rows [0, dy_split)
  std::uint16_t* dy_rows_hi = nullptr;      //   and here the rows [dy_split, capacity) (one GPU: in dx)
  std::int64_t dy_split = kernels::kNoSplit;  //   (a multiple of 128; dy_rows_hi > dy_rows)
  std::uint16_t* dx_rows = nullptr;         // backward: [capacity, H]
  std::uint16_t* shared_dx_rows = nullptr;  // backward: [T_pad, H], or dx itself ([T, H])
  std::uint16_t* recompute = nullptr;       // backward of a Training::recompute workspace: the pre-activations
  // A Precision::fp8 forward: the routed x rows and h in E4M3 ([capacity, H], [capacity, I]) and
  // their per-row scales of each 128 columns as E8M0 bytes ([H / 128, capacity], [I / 128, capacity];
  // Fp8ForwardParams::x_exps, h_exps).
  std::uint8_t* x_fp8 = nullptr;
  std::uint8_t* h_fp8 = nullptr;
  std::uint8_t* x_exps = nullptr;
  std::uint8_t* h_exps = nullptr;
  // A Precision::fp8 backward (its FP8 dgrad): the routed dy rows and dgate|dup in E4M3 ([capacity,
  // H], [capacity, 2I]), each followed by its per-row scales of each 128 columns as E8M0 bytes
  // ([H / 128, capacity], [2I / 128, capacity], padded to 512 bytes: fp8_rows_bytes).
  std::uint8_t* dy_fp8 = nullptr;
  std::uint8_t* dgu_fp8 = nullptr;
  std::uint8_t* dy_exps = nullptr;
  std::uint8_t* dgu_exps = nullptr;
  // ... with its weight gradients in E4M3 (BackwardArgs::fp8_weight_gradients): the transposes of
  // the routed dy rows, x rows, w h and dgate|dup ([H | H | I | 2I, capacity] E4M3), the gradients'
  // scales per channel and 128 rows as E8M0 bytes ([capacity / 128, H | 2I]) and the activations'
  // exponents per 128 x 128 block ([H | I / 128, capacity / 128 + 1] i32; kernels/backward/backward.cuh).
  std::uint8_t* dy_t = nullptr;
  std::uint8_t* x_t = nullptr;
  std::uint8_t* hw_t = nullptr;
  std::uint8_t* dgu_t = nullptr;
  std::uint8_t* dy_t_exps = nullptr;
  std::uint8_t* dgu_t_exps = nullptr;
  std::int32_t* hw_t_exponents = nullptr;
  std::int32_t* x_t_exponents = nullptr;
  std::int32_t* tile_order = nullptr;  // [capacity / 128]: the gathers' tile order (kernels/fp8/tile_order.cuh)
  bool rows_in_grads = false;               // dy_rows or hidden lie in the W_gate / W_up gradient buffers (or dx)
  // backward: the columns of x_rows / dx_rows, one column block's (backward_block_columns; 0: H)
  std::int64_t row_columns = 0;
  std::int64_t bytes = 0;                   // of the scratch
};

// What a call's scratch layout depends on (a workspace's, or any, for tests).
struct ScratchShape {
  MoeShape shape;
  std::int64_t tokens = 0, capacity = 0, saved_elements = 0;
  Training training = Training::off;
  Precision precision = Precision::bf16;
  std::int64_t block_columns = 0;  // the backward's column blocks' width (backward_block_columns; 0: H)
};
// An EP rank's slot buffer (Workspace::slots(), bf16 rows of H), in rows. The forward: the
// routed result rows [capacity] (with peers unused: GEMM2 pushes them to their tokens' owners),
// then the shared expert's [T_pad]. Training reuses it for the backward: the dy rows [capacity],
// the routed dx rows [capacity] only where the rank keeps them — a group of one (its TMA stores,
// then its combine) or Precision::fp8 (the FP8 weight gradients' transposed operands take that
// room); a rank with peers and bf16 pushes each dx row straight into its owner's slots — then
// the shared expert's dx rows [T_pad].
struct RankSlotRows {
  std::int64_t rows = 0;            // the buffer's rows
  std::int64_t dx_rows = -1;        // the routed dx rows' first row, or -1 (none kept)
  std::int64_t shared_dx_rows = 0;  // the shared expert's dx rows' first row (training)
};
RankSlotRows rank_slot_rows(const MoeShape& shape, Training training, Precision precision, std::int64_t capacity,
                            std::int64_t padded_tokens);

// The width of the one-GPU backward's column blocks (Config::backward_column_blocks): H split
// into that many blocks of whole 256-column tiles, the first ones the widest; H when one (the
// ring or comm SMs, Training::off). Training::recompute's 0: two blocks where I > H, else one.
std::int64_t backward_block_columns(const MoeShape& shape, const Config& config, Training training);
// Of a call of `tokens` tokens (no argument: the call being enqueued).
ScratchShape scratch_shape(const Workspace& ws, std::int64_t tokens);
inline ScratchShape scratch_shape(const Workspace& ws) { return scratch_shape(ws, ws.tokens()); }

// One GPU: a forward's buffers in `scratch` (null: offsets from 0, for .bytes).
CallBuffers forward_buffers(const ScratchShape& s, void* scratch);
// One GPU: a backward's buffers in `scratch`; with bf16 weight gradients (Training::save or
// recompute) the routed dy rows / w h go to row_space_a / row_space_b (non-null: E_l I H
// elements each that the W_gate / W_up gradients cover) where they fit — into both as one
// block when b == a + E_l I H — and dy rows that miss them may continue in dx_space (non-null:
// dx's T x H elements, apart from every other argument), split at a 128-row tile; else the
// shared expert's dx rows go there (any mode).
// fp8_dgrad (a Precision::fp8 call with BackwardArgs::fp8): the E4M3 dy and dgate|dup rows and
// their scale bytes too; fp8_wgrad (and BackwardArgs::fp8_weight_gradients): the transposed operands of
// the FP8 weight gradients too, where they fit in rooms dead by the time they are made (the x / dx
// rows', the bf16 and E4M3 dy rows' in the scratch, and the routed pre-activations': saved_space,
// the saved tensor's data in Training::save — needed then unless scratch is null, a size query;
// the figure does not depend on it).
CallBuffers backward_buffers(const ScratchShape& s, void* scratch, void* row_space_a, void* row_space_b,
                             void* dx_space = nullptr, bool fp8_dgrad = false, bool fp8_wgrad = false,
                             void* saved_space = nullptr);
inline CallBuffers forward_buffers(const Workspace& ws, void* scratch) {
  return forward_buffers(scratch_shape(ws), scratch);
}
inline CallBuffers backward_buffers(const Workspace& ws, void* scratch, void* row_space_a, void* row_space_b,
                                   void* dx_space = nullptr, bool fp8_dgrad = false, bool fp8_wgrad = false,
                                   void* saved_space = nullptr) {
  return backward_buffers(scratch_shape(ws), scratch, row_space_a, row_space_b, dx_space, fp8_dgrad, fp8_wgrad,
                          saved_space);
}
// An EP rank: the workspace's own buffers.
CallBuffers rank_buffers(const Workspace& ws);
// An EP rank's FP8 dgrad (Precision::fp8 with BackwardArgs::fp8): its E4M3 dy and dgate|dup rows
// and their scales in `base` (Workspace::rank_fp8_dgrad_rows, rank_fp8_dgrad_bytes of it); with
// its FP8 weight gradients (after the dgrad launch), their transposed operands too, in rooms dead
// by then where they fit (scratch_layout.cpp).
std::int64_t rank_fp8_dgrad_bytes(const Workspace& ws);
void rank_fp8_dgrad_buffers(CallBuffers& buffers, const Workspace& ws, void* base);
void rank_fp8_wgrad_buffers(CallBuffers& buffers, const Workspace& ws, void* base);
// (The same arithmetic for a rank of `rows` allocated rows, for tests: dx_rows its dx rows' 2 rows H
// bytes; rank_fp8_forward_buffers: the FP8 forward's E4M3 x rows and h in buffers.x_rows' 2 rows H
// and buffers.hidden's 2 rows I bytes, each followed by its scale bytes.)
std::int64_t rank_fp8_dgrad_bytes(std::int64_t rows, std::int64_t H, std::int64_t I);
void rank_fp8_dgrad_buffers(CallBuffers& buffers, std::int64_t rows, std::int64_t H, std::int64_t I, void* base);
void rank_fp8_wgrad_buffers(CallBuffers& buffers, std::int64_t rows, std::int64_t H, std::int64_t I, void* base,
                            void* dx_rows);
void rank_fp8_forward_buffers(CallBuffers& buffers, std::int64_t rows, std::int64_t H, std::int64_t I);
// The FP8 weight gradients' transposing quantization of `columns` columns of the plan's rows into
// values (E4M3 [columns, capacity]) with col_exps (the scales' E8M0 bytes) or block_exponents
// (kernels/fp8/quantize.cuh): gathered from a [T, columns] tensor (gather) or the plan rows of a
// [capacity, columns] one. tile_order (gathers): the order of the plan's tiles to visit
// (launch_tile_order's; null: plan order).
void quantize_transposed(Workspace& ws, const void* src, std::int64_t columns, bool gather, std::uint8_t* values,
                         std::uint8_t* col_exps, std::int32_t* block_exponents, cudaStream_t stream, std::string_view where,
                         const std::int32_t* tile_order = nullptr);
// The FP8 weight-gradient kernel's params on p (the call's BF16 params): buffers' transposed operands.
kernels::Fp8WgradParams wgrad_fp8_params(Workspace& ws, const CallBuffers& buffers, const kernels::BackwardParams& p);

// A forward's args against its workspace's precision: ForwardArgs::fp8 given exactly when it is fp8.
void check_forward_precision(std::string_view where, const Workspace& ws, const ForwardArgs& a);
// Virtual ranks' backward runs in bf16 (on an FP8 forward's saved activations too): eight ranks'
// FP8 dgrad parameters would not fit one launch's (EpRank runs it).
inline void check_virtual_ranks_backward_precision(std::string_view where, const BackwardArgs& b) {
  if (b.fp8)
    throw_argument_error(where, "fp8", "was given, but the FP8 dgrad of an EP group runs in mok::EpRank (a launch "
                                       "per rank): one launch for every virtual rank would not hold its parameters; "
                                       "virtual ranks take the bf16 backward (leave BackwardArgs::fp8 unset)");
}

// Number of CTAs of a persistent kernel: the configured compute SMs, or every SM.
int persistent_ctas(const Workspace& ws, std::string_view where);

// Zeroes the workspace's counters (per-tile readiness, done, abort, wd_done) on `stream`:
// before every kernel that counts in them.
void zero_counters(Workspace& ws, cudaStream_t stream, std::string_view where);
// The workspace's dependency counters, for plan_device's also_zero (zeroed by the planner's
// first kernel instead of a memset of their own).
inline std::span<int> counters(Workspace& ws) {
  return {ws.counters(), static_cast<std::size_t>(ws.counter_count())};
}

// Copies the rows of `rows` ([T, H] bf16) into `routed` in the order of ws.plan()
// (padding rows become zero); plan rows from `split` on go to `routed_hi`, from its start.
void dispatch_rows(const void* rows, void* routed, Workspace& ws, cudaStream_t stream, void* routed_hi = nullptr,
                   std::int64_t split = kernels::kNoSplit);
// The same for expert parallelism: rank q's rows are rows[q] (pull through the peer table).
void dispatch_rows(std::span<const void* const> rows, void* routed, Workspace& ws, cudaStream_t stream,
                   void* routed_hi = nullptr, std::int64_t split = kernels::kNoSplit);
// One GPU, a column block: columns [column0, column0 + columns) of each of rows' routed rows into
// `routed` rows of `stride` elements (the backward's x rows in column blocks).
void dispatch_row_columns(const void* rows, void* routed, Workspace& ws, cudaStream_t stream, std::int64_t column0,
                          std::int64_t columns, std::int64_t stride);

// The forward kernel's params for one rank (no EP fields), after plan_device(). pingpong: the
// weight maps take the ping-pong kernel's boxes (kernels::launch_forward_pingpong).
kernels::ForwardParams forward_params(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers,
                                      std::uint16_t* saved_gu, bool gemm1_only, bool pingpong = false);
// The fields of the forward kernel's params that are not the routed experts' (shared expert,
// slots, y, plan, counters, sizes): forward_params() and the FP8 forward's.
void set_shared_expert_params(kernels::ForwardParams& p, const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers,
                              bool pingpong = false);
// Training: where the forward saves the pre-activations (saved_gu, the routed rows' [capacity, 2I]
// then the shared expert's [T_pad, 2I_s]; null: inference), their store maps and the marker.
void set_saved_params(kernels::ForwardParams& p, Workspace& ws, std::uint16_t* saved_gu);
inline kernels::ForwardParams forward_params(const ForwardArgs& a, Workspace& ws, std::uint16_t* saved_gu,
                                             bool gemm1_only) {
  return forward_params(a, ws, rank_buffers(ws), saved_gu, gemm1_only);
}

// The checks of one backward call against its workspace (throws mok::Error).
// (Sizes the workspace's plan for the call: Workspace::begin_call.)
void check_backward_call(std::string_view where, const ForwardArgs& a, const BackwardArgs& b, Workspace& ws,
                         const std::optional<TensorView>& saved, int device);
// The FP8 dgrad kernel's params on p (the BF16 kernel's params of the call): buffers' E4M3 dy rows
// (filled) and dgate|dup rows (to fill), b.fp8's transposed weights.
kernels::Fp8BackwardParams backward_fp8_params(const BackwardArgs& b, Workspace& ws, const CallBuffers& buffers,
                                               const kernels::BackwardParams& p);
// The backward kernel's params for one rank (no EP fields), after plan_device() and the
// row copies into ws; gu: the saved (or recomputed) pre-activations.
kernels::BackwardParams backward_params(const ForwardArgs& a, const BackwardArgs& b, Workspace& ws,
                                        const CallBuffers& buffers, std::uint16_t* gu);
inline kernels::BackwardParams backward_params(const ForwardArgs& a, const BackwardArgs& b, Workspace& ws,
                                               std::uint16_t* gu) {
  return backward_params(a, b, ws, rank_buffers(ws), gu);
}

// The FP8 row gather's params (kernels/fp8/quantize.cuh): the plan's routed rows of `rows`
// ([T, H] bf16) into values and their scales' E8M0 bytes `exps` (which the FP8 kernels' stages
// carry), quantized per 1 x 128 (no bf16 copy).
kernels::QuantizeRowsParams quantize_rows_params(Workspace& ws, const void* rows, std::uint8_t* values, std::uint8_t* exps);
// The same for expert parallelism: rank q's rows are rows[q] (through the peer table).
kernels::QuantizeRowsParams quantize_rows_params(Workspace& ws, std::span<const void* const> rows, std::uint8_t* values,
                                                 std::uint8_t* exps);
// The FP8 forward kernel's params for one rank (no EP fields), after plan_device(): x's routed
// rows quantized in buffers.x_fp8 / x_exps, h's to go in buffers.h_fp8 / h_exps.
kernels::Fp8ForwardParams fp8_forward_params(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers,
                                             std::uint16_t* saved_gu);

// Precision::fp8, after plan_device() with the counters zeroed: gathers and quantizes x's
// routed rows into buffers.x_fp8 / x_exps and launches the FP8 forward kernel into a.y
// (saved_gu: null, or the tensor of the gate/up pre-activations to fill, as the BF16 forward).
void launch_forward_fp8(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers, cudaStream_t stream,
                        std::uint16_t* saved_gu, std::string_view where);

// After plan_device() into ws.plan() with the counters zeroed (also_zero = counters(ws)) and
// x's rows copied into buffers.x_rows (dispatch_rows): launches the forward kernel, the full
// layer into a.y, or only GEMM1 (gemm1_only, the backward's recompute).
// saved_gu: null or the tensor of the gate/up pre-activations to fill.
void launch_forward_kernel(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers, cudaStream_t stream,
                           std::uint16_t* saved_gu, bool gemm1_only, std::string_view where);

#if defined(MOK_DIAG_COPY_WARPS)
// (diagnostic builds, kernels/forward/producer.cuh's copy_x_rows) Whether a one-GPU BF16 forward's
// kernel copies x's routed rows itself (the cooperative kernel; the ping-pong one reads rows the
// dispatch copied); with MOK_DIAG_COPY_SHADOW the dispatch copies them as by default and the
// kernel's copy goes to a buffer nobody reads.
inline bool copies_rows_in_kernel(const Workspace& ws) { return !ws.config().pingpong; }
#if defined(MOK_DIAG_COPY_SHADOW)
inline constexpr bool kDispatchRows = true;
#else
inline constexpr bool kDispatchRows = false;
#endif
// The forward's x_copied counters (one a routed M-tile): after the per-tile counters, done,
// abort and the backward's wd_done.
inline int* x_copied_counters(Workspace& ws) { return ws.counters() + counters_per_tile(ws) + 3; }
#endif

}  // namespace mok::detail
