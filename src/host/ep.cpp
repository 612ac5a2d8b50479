// VirtualRanks: an EP group of N ranks on one GPU. Each step below is what a rank of a
// multi-GPU group does on its own GPU; here one stream runs every rank's step in turn,
// and the forward kernel's one launch serves every rank (its CTAs split among them), so
// ranks that wait on each other are resident together.
#include "mok/ep.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda_check.hpp"
#include "kernels/exchange.cuh"
#include "kernels/forward.cuh"
#include "layer_launch.hpp"
#include "mok/error.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::VirtualRanks";

static_assert(kMaxEpRanks == kernels::kMaxRanks);

template <typename T>
T* allocate(std::int64_t count, const char* what) {
  T* ptr = nullptr;
  detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<std::int64_t>(count, 1) * sizeof(T)), kWhere,
                     what);
  return ptr;
}

}  // namespace

// One rank's buffers: its workspace (plan, routed rows, h, counters, status) and its part
// of the symmetric workspace that peers address through the peer table.
struct VirtualRanks::Rank {
  std::unique_ptr<Workspace> ws;
  std::int32_t* all_ids = nullptr;  // [ep, T, k]: every rank's routing (routing exchange)
  float* slots = nullptr;           // [T * k, H] fp32: combine slots, pushed by the ranks that own the experts
  int* slots_done = nullptr;        // [2 kMaxEpRanks]: rows x column tiles pushed by each rank, then
                                    // the rows this rank's routing sends to each rank

  ~Rank() {
    cudaFree(all_ids);
    cudaFree(slots);
    cudaFree(slots_done);
  }
};

VirtualRanks::VirtualRanks(const MoeShape& shape, std::int64_t tokens_per_rank, const Config& config)
    : shape_(shape), tokens_(tokens_per_rank), config_(config) {
  validate(shape);
  validate(config);
  const std::int64_t ep = shape.ep_size();
  if (ep > kMaxEpRanks)
    throw_argument_error(kWhere, "num_local_experts", "makes ", ep, " ranks (num_experts / num_local_experts); at most ",
                         kMaxEpRanks, " are supported");
  if (tokens_per_rank < 1) throw_argument_error(kWhere, "tokens_per_rank", "must be >= 1, got ", tokens_per_rank);
  if (ep * tokens_per_rank * shape.top_k > std::numeric_limits<std::int32_t>::max())
    throw_argument_error(kWhere, "tokens_per_rank", "ranks * T * k must fit in int32, got ", ep * tokens_per_rank * shape.top_k);
  const std::int64_t T = tokens_per_rank, k = shape.top_k, H = shape.hidden;
  for (int r = 0; r < ep; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->ws.reset(new Workspace(shape, T, config, Training::off, Workspace::ForRank{r}));
    rank->all_ids = allocate<std::int32_t>(ep * T * k, "cudaMalloc(all_ids)");
    rank->slots = allocate<float>(T * k * H, "cudaMalloc(combine slots)");
    rank->slots_done = allocate<int>(2 * kMaxEpRanks, "cudaMalloc(slots_done)");
    ranks_.push_back(std::move(rank));
  }
}

VirtualRanks::~VirtualRanks() = default;

Workspace& VirtualRanks::workspace(int rank) {
  if (rank < 0 || rank >= size()) throw_argument_error(kWhere, "rank", "must be in [0, ", size(), "), got ", rank);
  return *ranks_[rank]->ws;
}

void VirtualRanks::forward(std::span<const ForwardArgs> args, cudaStream_t stream) {
  const int ep = size();
  const std::int64_t T = tokens_, k = shape_.top_k;
  if (static_cast<int>(args.size()) != ep)
    throw_argument_error("mok::VirtualRanks::forward", "args", "must hold one call per rank (", ep, "), got ", args.size());
  int device = 0, sms = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  detail::cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kWhere, "cudaDeviceGetAttribute");
  const int compute = config_.compute_sms > 0 ? std::min(config_.compute_sms, sms) : sms;
  if (compute < ep)
    throw_argument_error(kWhere, "compute_sms", "must give every rank at least one SM: ", ep, " ranks, ", compute, " SMs");
  for (int r = 0; r < ep; ++r) {
    const std::string where = detail::concat("mok::VirtualRanks::forward (rank ", r, ")");
    ranks_[r]->ws->throw_if_failed();
    const std::int64_t t = validate_forward_args(where, shape_, args[r], Device::cuda(device));
    if (t != T) throw_argument_error(where, "x", "has ", t, " tokens but the group was made for ", T, " per rank");
    detail::check_locations(where, args[r], shape_, true);
  }

  // Routing exchange: every rank's ids into every rank's [ep, T, k] buffer. The counters
  // are zeroed first: no rank pushes before every rank's routing has arrived.
  kernels::ExchangeParams ex{};
  for (int r = 0; r < ep; ++r) {
    detail::cuda_check(cudaMemsetAsync(ranks_[r]->slots_done, 0, sizeof(int) * 2 * kMaxEpRanks, stream), kWhere,
                       "cudaMemsetAsync(slots_done)");
    ex.ids[r] = args[r].topk_ids.data;
    ex.ids_are_i64[r] = args[r].topk_ids.dtype == DType::i64;
    ex.all_ids[r] = ranks_[r]->all_ids;
    ex.expected_rows[r] = ranks_[r]->slots_done + kMaxEpRanks;
  }
  ex.ranks = ep, ex.first_rank = 0, ex.ep = ep, ex.pairs_per_rank = T * k;
  ex.num_local_experts = static_cast<int>(shape_.num_local_experts);
  kernels::launch_exchange(ex, stream);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the routing exchange");

  // Per rank: plan from every rank's routing, pull the rows it needs, the kernel's params.
  const void* x_peers[kMaxEpRanks] = {};
  for (int r = 0; r < ep; ++r) x_peers[r] = args[r].x.data;
  kernels::ForwardGroupParams group{};
  for (int r = 0; r < ep; ++r) {
    Rank& rank = *ranks_[r];
    const TensorView all_ids = TensorView::contiguous(rank.all_ids, DType::i32, Device::cuda(device), {ep, T, k});
    plan_device(all_ids, r, rank.ws->plan(), stream);
    detail::dispatch_rows(std::span<const void* const>(x_peers, ep), rank.ws->x_routed(), *rank.ws, stream);
    detail::cuda_check(cudaMemsetAsync(rank.ws->counters(), 0, 4 * rank.ws->counter_count(), stream), kWhere,
                       "cudaMemsetAsync(counters)");
    kernels::ForwardParams& p = group.rank[r];
    p = detail::forward_params(args[r], *rank.ws, nullptr, false);
    p.ep.push = true;
    p.ep.rank = r;
    p.ep.size = ep;
    for (int q = 0; q < ep; ++q) {
      p.ep.slots[q] = ranks_[q]->slots;
      p.ep.slots_done[q] = ranks_[q]->slots_done;
      p.ep.plan_status[q] = ranks_[q]->ws->plan().view().status;
    }
    p.ep.own_ids = rank.all_ids + r * T * k;
    p.ep.expected_rows = rank.slots_done + kMaxEpRanks;
    p.ep.system_scope = false;  // virtual ranks share this GPU
    p.ep.stalled = r == stalled_rank_;
  }
  group.ranks = ep;
  group.ctas_per_rank = compute / ep;
  // One rank (and, later, each process of a multi-GPU group) launches the plain kernel:
  // the group kernel's per-rank params are indexed at run time, which costs every access.
  if (ep == 1) kernels::launch_forward(group.rank[0], group.ctas_per_rank, stream);
  else kernels::launch_forward_group(group, stream);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the forward kernel");
}

void VirtualRanks::stall_rank_for_testing(int rank) {
  if (rank < -1 || rank >= size()) throw_argument_error(kWhere, "rank", "must be in [-1, ", size(), "), got ", rank);
  stalled_rank_ = rank;
}

void VirtualRanks::check(cudaStream_t stream) {
  const cudaError_t err = cudaStreamSynchronize(stream);
  for (auto& rank : ranks_) rank->ws->throw_if_failed();  // a timeout's record outlives the trap it ends with
  detail::cuda_check(err, kWhere, "cudaStreamSynchronize");
  for (int r = 0; r < size(); ++r) {
    try {
      ranks_[r]->ws->plan().check(stream);
    } catch (const Error& e) {
      throw Error(detail::concat("rank ", r, ": ", e.what()));
    }
  }
  for (auto& rank : ranks_) rank->ws->check(stream);
}

}  // namespace mok
