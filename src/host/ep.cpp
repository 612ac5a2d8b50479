// VirtualRanks: an EP group of N ranks on one GPU. Each step below is what a rank of a
// multi-GPU group does on its own GPU; here one stream runs every rank's step in turn,
// and each fused kernel's one launch serves every rank (its CTAs split among them), so
// ranks that wait on each other are resident together.
#include "mok/ep.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <string>

#include "cuda_check.hpp"
#include "ep_common.hpp"
#include "ep_step.hpp"
#include "kernels/backward/backward.cuh"
#include "kernels/ep/exchange.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/forward/forward_fp8.cuh"
#include "kernels/fp8/quantize.cuh"
#include "layer_launch.hpp"
#include "mok/error.hpp"
#include "tensor_map.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::VirtualRanks";


template <typename T>
T* allocate(std::int64_t count, const char* what) {
  T* ptr = nullptr;
  detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<std::int64_t>(count, 1) * sizeof(T)), kWhere,
                     what);
  return ptr;
}

int current_device() {
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  return device;
}

}  // namespace

// One rank's buffers: its workspace (plan, routed rows, h, counters, status) and its part
// of the symmetric workspace that peers address through the peer table.
struct VirtualRanks::Rank {
  std::unique_ptr<Workspace> ws;
  std::int32_t* all_ids = nullptr;  // [ep, T, k]: every rank's routing (routing exchange)
  float* all_weights = nullptr;     // [ep, T, k]: every rank's routing weights (backward)
  std::uint8_t* slots = nullptr;    // ep_slot_bytes(): [T * k, H] bf16 combine slots (forward), in the backward
                                    // the dx rows; then the backward's partials [T * k, ceil(I / 256)] fp32
  int* slots_done = nullptr;        // [2 kMaxEpRanks]: rows x column tiles pushed by each rank, then
                                    // the rows this rank's routing sends to each rank
  std::uint16_t* ring = nullptr;    // [ring_rows, H]: the forward's received rows (ring token buffer)
  std::uint8_t* fp8_tokens = nullptr;  // Config::pull_fp8_rows: its tokens quantized (fp8_token_bytes)
  int* ring_counters = nullptr;     // [2 minibatches]: landed, then freed

  ~Rank() {
    cudaFree(fp8_tokens);
    cudaFree(ring);
    cudaFree(ring_counters);
    cudaFree(all_ids);
    cudaFree(all_weights);
    cudaFree(slots);
    cudaFree(slots_done);
  }
};

// What prepare() leaves for the kernels' launch.
struct VirtualRanks::Launch {
  int device, ctas_per_rank, comm_ctas;
};

VirtualRanks::VirtualRanks(const MoeShape& shape, std::int64_t tokens_per_rank, const Config& config, Training training)
    : shape_(shape), tokens_(tokens_per_rank), config_(config), training_(training) {
  const std::int64_t ep = detail::check_ep_group(kWhere, shape, config, tokens_per_rank);
  if (config.pull_tokens_once)
    throw_argument_error(kWhere, "config.pull_tokens_once", "is for EpRank (ranks on other GPUs); virtual ranks share "
                         "one GPU's memory and pull nothing across a fabric");
  if (config.fp8_dgrad)  // (its rows would be held by every rank and never read)
    throw_argument_error(kWhere, "config.fp8_dgrad", "the FP8 dgrad of an EP group runs in mok::EpRank (one launch "
                         "cannot hold virtual ranks' FP8 parameters); virtual ranks run the bf16 backward");
  const std::int64_t T = tokens_per_rank, k = shape.top_k, H = shape.hidden;
  for (int r = 0; r < ep; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->ws.reset(new Workspace(shape, T, config, training, Workspace::ForRank{r}));
    rank->all_ids = allocate<std::int32_t>(ep * T * k, "cudaMalloc(all_ids)");
    if (training != Training::off) rank->all_weights = allocate<float>(ep * T * k, "cudaMalloc(all_weights)");
    rank->slots = allocate<std::uint8_t>(detail::ep_slot_bytes(shape, T), "cudaMalloc(combine slots)");
    rank->slots_done = allocate<int>(2 * kMaxEpRanks, "cudaMalloc(slots_done)");
    if (detail::uses_ring(config))
      rank->ring = allocate<std::uint16_t>(detail::ring_rows(*rank->ws) * H, "cudaMalloc(ring)");
    rank->ring_counters = allocate<int>(2 * detail::ring_minibatches(*rank->ws), "cudaMalloc(ring counters)");
    if (config.pull_fp8_rows)
      rank->fp8_tokens = allocate<std::uint8_t>(kernels::fp8_token_bytes(T, H), "cudaMalloc(E4M3 tokens)");
    ranks_.push_back(std::move(rank));
  }
}

VirtualRanks::~VirtualRanks() = default;

Workspace& VirtualRanks::workspace(int rank) {
  if (rank < 0 || rank >= size()) throw_argument_error(kWhere, "rank", "must be in [0, ", size(), "), got ", rank);
  return *ranks_[rank]->ws;
}

std::int64_t VirtualRanks::saved_elements() const { return ranks_.front()->ws->saved_elements(); }

// Rank r's peer table: every rank's slots, counters and plan status.
void VirtualRanks::set_peers(kernels::EpPeers& e, int r) const {
  const int ep = size();
  e.push = true;
  e.rank = r;
  e.size = ep;
  for (int q = 0; q < ep; ++q) {
    e.slots[q] = reinterpret_cast<std::uint16_t*>(ranks_[q]->slots);
    e.slots_done[q] = ranks_[q]->slots_done;
    e.plan_status[q] = ranks_[q]->ws->plan().view().status;
  }
  e.own_ids = ranks_[r]->all_ids + r * tokens_ * shape_.top_k;
  e.expected_rows = ranks_[r]->slots_done + kMaxEpRanks;
  e.system_scope = false;  // virtual ranks share this GPU
  e.stalled = r == stalled_rank_;
}

// Rank r's peer table for the shared rank step (ep_step.hpp): every rank's rows on this GPU,
// rank r's ring, its EpPeers, and the row pull straight from the peers' tensors.
detail::RankPeers VirtualRanks::peers(int r, std::span<const void* const> x, std::span<const void* const> dy) {
  Rank& rank = *ranks_[r];
  return {x,
          dy,
          rank.ring,
          rank.ring_counters,
          [this, r](kernels::EpPeers& e) { set_peers(e, r); },
          [&rank](std::span<const void* const> rows, void* routed, cudaStream_t s) {
            detail::dispatch_rows(rows, routed, *rank.ws, s);
          },
          [&rank](std::span<const void* const> rows, std::uint8_t* values, std::uint8_t* exps, void* bf16, cudaStream_t s) {
            detail::pull_rows_fp8(*rank.ws, rows, values, exps, bf16, 4 * detail::persistent_ctas(*rank.ws, kWhere), s,
                                  kWhere);
          },
          [&rank](std::span<const void* const> tokens, std::uint8_t* values, std::uint8_t* exps, cudaStream_t s) {
            detail::gather_fp8_rows(*rank.ws, tokens, values, exps, 4 * detail::persistent_ctas(*rank.ws, kWhere), s,
                                    kWhere);
          }};
}

void VirtualRanks::stall_rank_for_testing(int rank) {
  if (rank < -1 || rank >= size()) throw_argument_error(kWhere, "rank", "must be in [-1, ", size(), "), got ", rank);
  stalled_rank_ = rank;
}

// Checks every rank's call, then: zero the cross-rank counters, exchange the routing (and
// the routing weights), plan every rank from the routing of all.
VirtualRanks::Launch VirtualRanks::prepare(std::span<const ForwardArgs> args, const char* where, bool weights) {
  const int ep = size();
  if (static_cast<int>(args.size()) != ep)
    throw_argument_error(where, "args", "must hold one call per rank (", ep, "), got ", args.size());
  Launch launch{current_device(), 0, 0};
  int sms = 0;
  detail::cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, launch.device), kWhere,
                     "cudaDeviceGetAttribute");
  const int compute = config_.compute_sms > 0 ? std::min(config_.compute_sms, sms) : sms;
  if (compute < ep)
    throw_argument_error(kWhere, "compute_sms", "must give every rank at least one SM: ", ep, " ranks, ", compute, " SMs");
  launch.ctas_per_rank = compute / ep;
  launch.comm_ctas = detail::comm_ctas(kWhere, config_, launch.ctas_per_rank);  // (the forward's)
  for (int r = 0; r < ep; ++r) {
    const std::string at = detail::concat(where, " (rank ", r, ")");
    ranks_[r]->ws->throw_if_failed();
    const std::int64_t t = validate_forward_args(at, shape_, args[r], Device::cuda(launch.device), !weights);
    if (t != tokens_) throw_argument_error(at, "x", "has ", t, " tokens but the group was made for ", tokens_, " per rank");
    if (!weights) detail::check_forward_precision(at, *ranks_[r]->ws, args[r]);  // (a backward's ForwardArgs::fp8: unread)
    detail::check_locations(at, args[r], shape_, !weights);
  }
  return launch;
}

namespace {

// The routing exchange and the per-rank plans, on `stream`.
struct ExchangeAndPlan {
  template <typename Ranks>
  static void run(Ranks& ranks, std::span<const ForwardArgs> args, const MoeShape& shape, std::int64_t T, int device,
                  bool weights, cudaStream_t stream, int backward_comm_ctas = 0) {
    const int ep = static_cast<int>(ranks.size());
    const std::int64_t k = shape.top_k;
    kernels::ExchangeParams ex{};
    for (int r = 0; r < ep; ++r) {
      // The counters are zeroed first: no rank pushes before every rank's routing has arrived.
      detail::cuda_check(cudaMemsetAsync(ranks[r]->slots_done, 0, sizeof(int) * 2 * kMaxEpRanks, stream), kWhere,
                         "cudaMemsetAsync(slots_done)");
      ex.ids[r] = args[r].topk_ids.data;
      ex.ids_are_i64[r] = args[r].topk_ids.dtype == DType::i64;
      ex.all_ids[r] = ranks[r]->all_ids;
      ex.expected_rows[r] = ranks[r]->slots_done + kMaxEpRanks;
      ex.weights[r] = weights ? static_cast<const float*>(args[r].topk_weights.data) : nullptr;
      ex.all_weights[r] = ranks[r]->all_weights;
    }
    ex.ranks = ep, ex.first_rank = 0, ex.ep = ep, ex.pairs_per_rank = T * k;
    ex.num_local_experts = static_cast<int>(shape.num_local_experts);
    kernels::launch_exchange(ex, stream);
    detail::cuda_check(cudaGetLastError(), kWhere, "launching the routing exchange");
    for (int r = 0; r < ep; ++r) {
      const TensorView all_ids = TensorView::contiguous(ranks[r]->all_ids, DType::i32, Device::cuda(device), {ep, T, k});
      plan_device(all_ids, r, ranks[r]->ws->plan(), stream, detail::backward_ring_fit(*ranks[r]->ws, backward_comm_ctas));
    }
  }
};

}  // namespace

void VirtualRanks::forward(std::span<const ForwardArgs> args, cudaStream_t stream, std::span<const TensorView> saved) {
  constexpr const char* where = "mok::VirtualRanks::forward";
  const Launch launch = prepare(args, where, false);
  const int ep = size();
  const std::int64_t T = tokens_;
  // (none on a Training::save group: a forward that saves nothing, for evaluation — as one GPU's)
  if (!saved.empty() && static_cast<int>(saved.size()) != ep)
    throw_argument_error(where, "saved", "must hold one tensor per rank (", ep, "), got ", saved.size());
  if (!saved.empty() && training_ != Training::save)
    throw_argument_error(where, "saved", "needs a group made with Training::save");
  for (std::size_t r = 0; r < saved.size(); ++r)
    detail::check_saved(detail::concat(where, " (rank ", r, ")"), saved[r], *ranks_[r]->ws, Device::cuda(launch.device));
  ExchangeAndPlan::run(ranks_, args, shape_, T, launch.device, false, stream);

  const void* x_peers[kMaxEpRanks] = {};
  for (int r = 0; r < ep; ++r) x_peers[r] = args[r].x.data;
  if (config_.precision == Precision::fp8) {  // (no ring: Workspace refuses one with fp8)
    if (config_.pull_fp8_rows)  // every rank's tokens quantized once; the ranks pull E4M3 rows of them
      for (int r = 0; r < ep; ++r) {
        kernels::launch_quantize_tokens(static_cast<const std::uint16_t*>(args[r].x.data), ranks_[r]->fp8_tokens, T,
                                        static_cast<int>(shape_.hidden), 4 * launch.ctas_per_rank, stream);
        detail::cuda_check(cudaGetLastError(), kWhere, "launching the token quantization");
        x_peers[r] = ranks_[r]->fp8_tokens;
      }
    kernels::Fp8ForwardGroupParams group{};
    for (int r = 0; r < ep; ++r)
      group.rank[r] = detail::forward_step_fp8(peers(r, {x_peers, std::size_t(ep)}, {}), args[r], *ranks_[r]->ws,
                                               saved.empty() ? nullptr : static_cast<std::uint16_t*>(saved[r].data),
                                               stream, kWhere);
    group.ranks = ep;
    group.ctas_per_rank = launch.ctas_per_rank;
    if (ep == 1) kernels::launch_forward_fp8(group.rank[0], group.ctas_per_rank, stream);
    else kernels::launch_forward_fp8_group(group, stream);
    detail::cuda_check(cudaGetLastError(), kWhere, "launching the FP8 forward kernel");
    return;
  }

  // Per rank: the kernel's params with the peer table; its comm CTAs pull the rows.
  kernels::ForwardGroupParams group{};
  for (int r = 0; r < ep; ++r)
    group.rank[r] = detail::forward_step(peers(r, {x_peers, std::size_t(ep)}, {}), args[r], *ranks_[r]->ws,
                                         saved.empty() ? nullptr : static_cast<std::uint16_t*>(saved[r].data),
                                         launch.comm_ctas, stream, kWhere);
  group.ranks = ep;
  group.ctas_per_rank = launch.ctas_per_rank;
  // One rank (and each process of a multi-GPU group) launches the plain kernel: the group
  // kernel's per-rank params are indexed at run time, which costs every access.
  if (ep == 1) kernels::launch_forward(group.rank[0], group.ctas_per_rank, stream);
  else kernels::launch_forward_group(group, stream);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the forward kernel");
}

void VirtualRanks::backward(std::span<const ForwardArgs> fwd, std::span<const BackwardArgs> bwd, cudaStream_t stream,
                            std::span<const TensorView> saved) {
  constexpr const char* where = "mok::VirtualRanks::backward";
  const Launch launch = prepare(fwd, where, true);
  const int ep = size();
  const std::int64_t T = tokens_;
  if (static_cast<int>(bwd.size()) != ep)
    throw_argument_error(where, "bwd", "must hold one call per rank (", ep, "), got ", bwd.size());
  if (!saved.empty() && static_cast<int>(saved.size()) != ep)
    throw_argument_error(where, "saved", "must hold one tensor per rank (", ep, "), got ", saved.size());
  for (int r = 0; r < ep; ++r) {
    const std::string at = detail::concat(where, " (rank ", r, ")");
    detail::check_virtual_ranks_backward_precision(at, bwd[r]);
    detail::check_backward_call(at, fwd[r], bwd[r], *ranks_[r]->ws,
                                saved.empty() ? std::nullopt : std::optional<TensorView>(saved[r]), launch.device);
  }
  const bool grad_fp32 = bwd[0].d_w_gate.dtype == DType::f32;
  for (int r = 1; r < ep; ++r)
    if ((bwd[r].d_w_gate.dtype == DType::f32) != grad_fp32)
      throw_argument_error(where, "bwd", "weight gradients must have one dtype on every rank (rank 0: ",
                           dtype_name(bwd[0].d_w_gate.dtype), ", rank ", r, ": ", dtype_name(bwd[r].d_w_gate.dtype), ")");
  ExchangeAndPlan::run(ranks_, fwd, shape_, T, launch.device, true, stream, launch.comm_ctas);

  // With comm CTAs the dy and x rows stream through the rings (pulled from these sources);
  // otherwise every row is pulled before the launch (detail::backward_step).
  const void* x_peers[kMaxEpRanks] = {};
  const void* dy_peers[kMaxEpRanks] = {};
  kernels::BackwardGroupParams group{};
  for (int r = 0; r < ep; ++r) {
    x_peers[r] = fwd[r].x.data, dy_peers[r] = bwd[r].dy.data;
    group.sources.x[r] = static_cast<const std::uint16_t*>(x_peers[r]);
    group.sources.dy[r] = static_cast<const std::uint16_t*>(dy_peers[r]);
  }
  unsigned long long* markers[kMaxEpRanks] = {};
  for (int r = 0; r < ep; ++r) {
    const detail::BackwardStep step =
        detail::backward_step(peers(r, {x_peers, std::size_t(ep)}, {dy_peers, std::size_t(ep)}), fwd[r], bwd[r],
                              *ranks_[r]->ws, saved.empty() ? nullptr : static_cast<std::uint16_t*>(saved[r].data),
                              ranks_[r]->all_weights, launch.comm_ctas, launch.ctas_per_rank * ep, stream, kWhere);
    group.rank[r] = step.params;
    markers[r] = step.marker;
  }
  for (int r = 0; r < ep; ++r)
    for (int q = 0; q < ep; ++q) group.rank[r].ep.saved_marker[q] = markers[q];
  group.ranks = ep;
  group.ctas_per_rank = launch.ctas_per_rank;
  if (ep == 1) kernels::launch_backward(group.rank[0], group.ctas_per_rank, stream, group.sources);
  else kernels::launch_backward_group(group, stream);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the backward kernel");
  for (int r = 0; r < ep; ++r)  // consumed: the pre-activations were replaced by their gradients
    detail::cuda_check(cudaMemsetAsync(markers[r], 0, sizeof(*markers[r]), stream), kWhere,
                       "cudaMemsetAsync(saved marker)");
}

void VirtualRanks::check(cudaStream_t stream) {
  const cudaError_t err = cudaStreamSynchronize(stream);
  for (auto& rank : ranks_) rank->ws->throw_if_failed();  // a timeout's record outlives the trap it ends with
  detail::cuda_check(err, kWhere, "cudaStreamSynchronize");
  for (int r = 0; r < size(); ++r) {
    try {
      ranks_[r]->ws->plan().check(stream);
    } catch (const Error& e) {
      e.rethrow_with_prefix(detail::concat("rank ", r, ": "));
    }
  }
}

}  // namespace mok
