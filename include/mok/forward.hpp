// The fused forward of the layer on one GPU (EP = 1).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "mok/device_plan.hpp"
#include "mok/kernel_status.hpp"
#include "mok/types.hpp"
#include "mok/validate.hpp"

namespace mok {

// The text of a wait site, for timeout messages.
const char* wait_site_text(WaitSite site);

// What a workspace is made for. `off`: forward only. `save`: the forward saves the gate/up
// pre-activations into a caller-given tensor (saved_elements() bf16) that the backward
// reads. `recompute`: the backward recomputes them (GEMM1 again) into the workspace, so
// nothing but the routing has to be kept between forward and backward.
enum class Training { off, save, recompute };

// bf16 elements of the tensor a Training::save forward fills for a workspace of this
// shape, T and config (Workspace::saved_elements(), computed without a GPU).
std::int64_t saved_elements(const MoeShape& shape, std::int64_t tokens, const Config& config = {});

// The column blocks Config::backward_column_blocks = 0 stands for on one GPU (no ring or comm
// SMs): Training::save 2, except 1 for a Precision::fp8 workspace where H <= 2048 (there one block
// was 0.93-0.95x the FP8 forward+backward's time with FP8 weight gradients, for 11 % more peak
// memory on qwen3-30b-a3b, and 0.945-0.958x with bf16 ones: bench/NOTES.md, forty-fifth and
// forty-sixth sessions); Training::recompute 2 where I > H, else 1 (its x rows' room holds whole
// rows either way, so the count is chosen for speed: bench/NOTES.md, thirty-first session).
int default_backward_column_blocks(const MoeShape& shape, Training training, Precision precision = Precision::bf16);

class Workspace;
namespace detail {
class LaunchCache;  // src/host/launch_cache.hpp
// A call's scratch: `given` after checking it, else the workspace's own (src/host/forward.cpp).
void* call_scratch(Workspace& ws, const std::optional<TensorView>& given, std::int64_t bytes,
                   std::string_view bytes_from, std::string_view where, cudaStream_t stream);
}  // namespace detail

// What one layer's forward (and backward) keeps between calls, for any number of tokens up
// to the `max_tokens` it is made for: the plan, dependency counters, the d_topk_weights
// partials and the status record. Reusable across calls and layers of the same shape and
// across token counts (a call with T <= max_tokens uses its first rows); it keeps nothing
// that the backward needs from the forward.
//
// Each call also needs scratch for its rows (one GPU): the forward the fp32 per-slot
// outputs, x's routed rows and the SwiGLU output h; the backward x's and dy's routed rows,
// w*h and the dx rows. Pass a buffer of forward_scratch_bytes(T) / backward_scratch_bytes()
// to each call — from a caching allocator, so the forward's bytes serve the backward (the
// PyTorch op does this) — or none: the workspace then allocates one buffer for max_tokens
// that serves every call on its first call that needs it (not while a CUDA graph is being
// captured). With bf16 weight gradients the backward keeps its routed dy rows and w*h in the
// W_gate / W_up gradient buffers (which it writes last) where they fit, so its scratch is
// smaller than the forward's (smallest when the two gradients are one block); a
// Training::save one also holds x's routed rows one column block at a time
// (Config::backward_column_blocks; a Training::recompute one holds whole rows, its GEMM1's).
class Workspace {
 public:
  Workspace(const MoeShape& shape, std::int64_t max_tokens, const Config& config = {},
            Training training = Training::off);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const MoeShape& shape() const { return shape_; }
  const Config& config() const { return config_; }
  Training training() const { return training_; }
  // bf16 elements of the tensor a forward of T tokens saves for the backward
  // (Training::save): capacity_rows(T) * 2I + ceil(T / 128) * 128 * 2 I_s, plus an
  // 8-element trailer that marks it as filled by a forward and not yet consumed by a
  // backward. No argument: T = max_tokens().
  std::int64_t saved_elements(std::int64_t tokens) const;
  std::int64_t saved_elements() const { return saved_elements(max_tokens_); }
  std::int64_t max_tokens() const { return max_tokens_; }
  // Rows of the plan of a call of T tokens (a multiple of 128; capacity_factor's, or the worst case).
  std::int64_t capacity_rows(std::int64_t tokens) const;
  // T of the call being enqueued (set by each forward / backward; max_tokens() before one).
  std::int64_t tokens() const;
  DevicePlan& plan() { return *plan_; }
  const DevicePlan& plan() const { return *plan_; }

  // Synchronises `stream`, then throws mok::Error if the planner or a kernel recorded
  // an error (bad expert id, capacity, timeout). Cheap to call after any step.
  void check(cudaStream_t stream);
  // Throws if an earlier call already recorded an error (no synchronisation).
  void throw_if_failed() const;

  // Bytes of the scratch a forward / a backward with weight gradients of `grad_dtype`
  // (bf16 or f32) of T tokens takes (one GPU); no T: max_tokens(). The bf16 figure holds for
  // W_gate / W_up gradients that are contiguous or the two halves of one [E, 2I, H] tensor
  // (other strided views of them take the f32 figure); gate_up_adjacent (bf16): for W_up's
  // gradient directly after W_gate's in one block of 2 E I H elements (a contiguous [E, 2I, H]
  // gradient, or two contiguous [E, I, H] allocated together), where the routed dy rows and
  // w*h may span both, so the scratch is smaller still; dx_apart: for a dx that is contiguous,
  // 16-byte aligned and shares no byte with any other argument (scratch included), where the dy
  // rows that miss bf16 gradients continue, or else the shared expert's dx rows go, until the
  // kernel writes dx, so the scratch may be smaller again; fp8_dgrad (Precision::fp8): for a call
  // with BackwardArgs::fp8, whose E4M3 dy and dgate|dup rows need more; fp8_wgrad: and with
  // BackwardArgs::fp8_weight_gradients, whose transposed E4M3 operands need more again: their
  // scales, and what of them (capacity x (2H + I) bytes in all) fits in no room that is dead once
  // the dgrad has run — the x / dx rows', the dy rows' in the scratch, and the saved tensor's
  // routed pre-activations (4 capacity x I bytes), which the backward consumes. backward() checks
  // the scratch it is given against the figure of the gradients, dx, fp8 and
  // fp8_weight_gradients it is given.
  std::int64_t forward_scratch_bytes(std::int64_t tokens) const;
  std::int64_t backward_scratch_bytes(DType grad_dtype, std::int64_t tokens, bool gate_up_adjacent = false,
                                      bool dx_apart = false, bool fp8_dgrad = false, bool fp8_wgrad = false) const;
  std::int64_t forward_scratch_bytes() const { return forward_scratch_bytes(max_tokens_); }
  std::int64_t backward_scratch_bytes(DType grad_dtype) const { return backward_scratch_bytes(grad_dtype, max_tokens_); }
  // Before a call of T tokens: checks T <= max_tokens() (an EP rank: T == max_tokens()) and
  // sizes the plan for T. forward() and backward() call it.
  void begin_call(std::int64_t tokens, std::string_view where);

  // One GPU (rows_in_slots()): the forward's x rows lie under its bf16 slot rows, each
  // under its own (the scratch's first 2 capacity H bytes); a GEMM2 tile's slot rows
  // overwrite x rows only after GEMM1 has read them (the kernel waits for its M-tile's
  // h_ready). The backward's dx row tiles overwrite their x rows once their expert's
  // dW_gate|up tiles have read them.
  // An expert-parallel rank owns its buffers (below; its x rows have a buffer of their own:
  // peers' pushes land in separate slots, and the ring's dy rows stay put while dx rows
  // are written).
  bool rows_in_slots() const { return x_routed_ == nullptr; }
  int* counters() const { return counters_; }
  std::int64_t counter_count() const;
  KernelStatus* status_device() const { return status_device_; }
  float* dw_partial() const { return dw_partial_; }  // [capacity, ceil(I / 256)]

  // An EP rank's own buffers (null on one GPU, whose calls take scratch).
  // (Precision::fp8: during the forward these hold the E4M3 rows and their scales instead —
  // detail::rank_fp8_forward_buffers; the backward pulls bf16 x rows into x_routed again)
  void* x_routed() const { return x_routed_; }  // [capacity, H] bf16: routed rows in plan order
  void* hidden() const { return hidden_; }      // [capacity, I] bf16
  std::uint16_t* slots() const { return slots_; }  // [capacity, H] bf16 result rows, then [T_pad, H] of the shared expert
  // Backward buffers (training only), in the slot buffer (dead between the forward's
  // combine and the next forward; detail::rank_slot_rows).
  void* dy_routed() const { return slots_; }    // [capacity, H] bf16
  void* dx_rows() const {  // [capacity, H] bf16, or null: a bf16 rank with peers pushes its dx rows
    return slots_ && dx_row0_ >= 0 ? slots_ + dx_row0_ * shape_.hidden : nullptr;
  }
  void* shared_dx_rows() const {  // [T_pad, H]
    return slots_ ? slots_ + shared_dx_row0_ * shape_.hidden : nullptr;
  }
  void* recompute_buffer() const { return recompute_; }  // saved_elements() bf16 (recompute)
  // Device bytes the workspace holds (with its own scratch once allocated).
  std::int64_t bytes() const { return bytes_; }
  int rank() const { return rank_; }  // this workspace's rank in an EP group (0 on one GPU)
  // The graphs that replay this workspace's repeated one-GPU calls (Config::replay_launches).
  detail::LaunchCache& launch_cache() { return *launch_cache_; }
  // Calls served by a graph so far, and graphs made (captured) so far.
  std::int64_t replayed_calls() const;
  std::int64_t captured_calls() const;
  // What forward_rows() enqueued, kept for the forward that follows it; begin_call() (every
  // call) forgets it.
  struct EnqueuedRows {
    std::int64_t tokens;
    const void* x;
    const void* topk_ids;
    const void* scratch;
    cudaStream_t stream;
    bool operator==(const EnqueuedRows&) const = default;
  };
  const std::optional<EnqueuedRows>& enqueued_rows() const { return enqueued_rows_; }

 private:
  friend class VirtualRanks;
  friend class EpRank;
  friend void* detail::call_scratch(Workspace&, const std::optional<TensorView>&, std::int64_t, std::string_view,
                                    std::string_view, cudaStream_t);
  friend void forward_rows(const TensorView&, const TensorView&, Workspace&, cudaStream_t,
                           const std::optional<TensorView>&);
  // The workspace's own scratch for a call given none (allocated on its first such call).
  void* own_scratch(std::int64_t bytes, std::string_view where, cudaStream_t stream);
  // An EP rank's FP8 dgrad rows (Config::fp8_dgrad; detail::rank_fp8_dgrad_bytes: E4M3 dy and
  // dgate|dup rows, their scales, the FP8 weight gradients' exponents), or null.
  void* rank_fp8_dgrad_rows() const { return fp8_dgrad_rows_; }
  struct ForRank {
    int rank;
  };
  // One rank of an expert-parallel group (made by VirtualRanks).
  Workspace(const MoeShape& shape, std::int64_t tokens, const Config& config, Training training, ForRank rank);

  int rank_ = 0;
  MoeShape shape_;
  Config config_;
  Training training_;
  std::int64_t max_tokens_;
  std::unique_ptr<DevicePlan> plan_;
  std::unique_ptr<detail::LaunchCache> launch_cache_;
  void* x_routed_ = nullptr;
  void* hidden_ = nullptr;
  std::uint16_t* slots_ = nullptr;
  std::int64_t dx_row0_ = -1, shared_dx_row0_ = 0;  // an EP rank's rows in slots_ (detail::rank_slot_rows)
  float* dw_partial_ = nullptr;
  void* recompute_ = nullptr;
  void* scratch_ = nullptr;  // one GPU, when a call is given no scratch
  void* fp8_dgrad_rows_ = nullptr;  // an EP rank with Config::fp8_dgrad
  std::int64_t scratch_bytes_ = 0;
  int* counters_ = nullptr;
  KernelStatus* status_host_ = nullptr;
  KernelStatus* status_device_ = nullptr;
  std::int64_t bytes_ = 0;
  std::optional<EnqueuedRows> enqueued_rows_;
};

// y = shared(x) + sum_j w_j * expert_j(x), fused: plan on the device, then one persistent
// kernel (gather + GEMM1 + SwiGLU, GEMM2, fixed-order combine). Stream-ordered, no host
// synchronisation; bitwise identical across runs and SM counts. Throws mok::Error on
// invalid arguments; errors found on the device surface at Workspace::check() or the next call.
// `saved` (Training::save only): 1-D bf16 [workspace.saved_elements()], written with the
// gate/up pre-activations the backward reads; keep it until the backward has run.
// `scratch`: 1-D u8 of at least workspace.forward_scratch_bytes() (see Workspace), or none.
// rows_enqueued: forward_rows() has enqueued this call's plan and row copy (below).
void forward(const ForwardArgs& args, Workspace& workspace, cudaStream_t stream,
             const std::optional<TensorView>& saved = std::nullopt,
             const std::optional<TensorView>& scratch = std::nullopt, bool rows_enqueued = false);

// The forward in two enqueues, for a caller with host work of its own before the layer (the
// PyTorch op: allocating y and the saved tensor, autograd's bookkeeping): forward_rows() plans
// the routing and copies x's routed rows into the scratch — work that needs only x, topk_ids
// and the scratch — and forward(..., rows_enqueued = true) then checks the other arguments and
// launches the fused kernel. The GPU copies rows while the caller's host work runs, instead of
// waiting for all of it. The forward must name the same x, topk_ids, scratch and stream, with no
// other call on the workspace in between (it throws otherwise); the bits are those of one
// forward(). One GPU, bf16 workspaces.
void forward_rows(const TensorView& x, const TensorView& topk_ids, Workspace& workspace, cudaStream_t stream,
                  const std::optional<TensorView>& scratch = std::nullopt);

}  // namespace mok
