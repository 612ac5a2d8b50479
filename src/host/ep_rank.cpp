// EpRank: one rank of an EP group that runs its own launches (another GPU, or another
// stream of this GPU). A call: begin (call number += 1, counters zeroed) -> exchange (this
// rank's routing into every rank's region, its rows into its own region, then a flag at
// every rank) -> wait for every rank's flag -> plan -> publish the plan's status to every
// rank -> the fused kernel, which first waits for every rank's plan status. No step waits
// on the host; every wait is bounded.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "cuda_check.hpp"
#include "ep_common.hpp"
#include "ep_step.hpp"
#include "kernels/backward/backward.cuh"
#include "kernels/ep/dispatch.cuh"
#include "kernels/ep/ep_sync.cuh"
#include "kernels/ep/exchange.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/forward/forward_fp8.cuh"
#include "kernels/fp8/quantize.cuh"
#include "kernels/common/load.cuh"
#include "layer_launch.hpp"
#include "mok/ep.hpp"
#include "mok/error.hpp"
#include "tensor_map.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::EpRank";

std::int64_t align_up(std::int64_t v) { return (v + 255) / 256 * 256; }

int sm_count(int device) {
  int sms = 0;
  detail::cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kWhere,
                     "cudaDeviceGetAttribute");
  return sms;
}

}  // namespace

// Byte offsets of the buffers in every rank's region (the same on every rank).
struct EpRank::Layout {
  std::int64_t header, slots_done, x, dy, ids, weights, slots, bytes;

  static Layout of(const MoeShape& s, std::int64_t T) {
    const std::int64_t ep = s.ep_size(), k = s.top_k, H = s.hidden;
    Layout l{};
    std::int64_t at = 0;
    auto take = [&](std::int64_t bytes) {
      const std::int64_t here = at;
      at = align_up(at + bytes);
      return here;
    };
    l.header = take(sizeof(kernels::EpHeader));
    l.slots_done = take(sizeof(int) * 2 * kMaxEpRanks);  // pushes per rank, then the rows expected from each
    l.x = take(2 * T * H);                                // this rank's x rows, pulled by the ranks that need them
    l.dy = take(2 * T * H);                               // its dy rows (backward)
    l.ids = take(4 * ep * T * k);                         // every rank's routing
    l.weights = take(4 * ep * T * k);                     // every rank's routing weights (backward)
    l.slots = take(detail::ep_slot_bytes(s, T));           // combine slots: pushed bf16 result rows (and the backward's)
    l.bytes = at;
    return l;
  }
};

std::int64_t EpRank::region_bytes(const MoeShape& shape, std::int64_t tokens_per_rank) {
  detail::check_ep_group("mok::EpRank::region_bytes", shape, Config{}, tokens_per_rank);  // (as the EpRank it sizes)
  return Layout::of(shape, tokens_per_rank).bytes;
}

EpRank::EpRank(const MoeShape& shape, std::int64_t tokens_per_rank, int rank, std::span<void* const> region_bases,
               const Config& config, Training training, bool peers_on_other_gpus)
    : shape_(shape), tokens_(tokens_per_rank), rank_(rank), config_(config), training_(training),
      system_scope_(peers_on_other_gpus) {
  const std::int64_t ep = detail::check_ep_group(kWhere, shape, config, tokens_per_rank);
  if (static_cast<std::int64_t>(region_bases.size()) != ep)
    throw_argument_error(kWhere, "region_bases", "must hold one region per rank (", ep, "), got ", region_bases.size());
  if (rank < 0 || rank >= ep) throw_argument_error(kWhere, "rank", "must be in [0, ", ep, "), got ", rank);
  for (std::size_t q = 0; q < region_bases.size(); ++q) {
    if (region_bases[q] == nullptr)
      throw_argument_error(kWhere, "region_bases", "entry ", q, " is null");
    if (reinterpret_cast<std::uintptr_t>(region_bases[q]) % 256 != 0)
      throw_argument_error(kWhere, "region_bases", "entry ", q, " must be 256-byte aligned");
    for (std::size_t p = 0; p < q; ++p)  // (two ranks on one region would write over each other)
      if (region_bases[p] == region_bases[q])
        throw_argument_error(kWhere, "region_bases", "entries ", p, " and ", q, " are the same region");
    bases_.push_back(static_cast<char*>(region_bases[q]));
  }
  kernels::load_ep_kernels();  // before any call: see kernels/common/load.cuh
  ws_.reset(new Workspace(shape, tokens_per_rank, config, training, Workspace::ForRank{rank}));
  if (config.pull_tokens_once && ep > 1)
    detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&recv_), ep * tokens_per_rank * shape.hidden * 2), kWhere,
                       "cudaMalloc(received tokens)");
  if (detail::uses_ring(config))
    detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&ring_), detail::ring_rows(*ws_) * shape.hidden * 2), kWhere,
                       "cudaMalloc(ring)");
  detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&ring_counters_), sizeof(int) * 2 * detail::ring_minibatches(*ws_)),
                     kWhere, "cudaMalloc(ring counters)");
}

EpRank::~EpRank() {
  cudaFree(recv_);
  cudaFree(ring_);
  cudaFree(ring_counters_);
}

// The start of a call: call number, routing exchange (and rows), the plan, and the plan's
// status at every rank. bwd: the backward's call (weights and dy rows exchanged too);
// saved_marker: its saved tensor's trailer (null in the forward).
void EpRank::begin(const ForwardArgs& a, const BackwardArgs* bwd, const unsigned long long* saved_marker,
                   cudaStream_t stream, int backward_comm_ctas) {
  const Layout l = Layout::of(shape_, tokens_);
  const int ep = size();
  const std::int64_t T = tokens_, k = shape_.top_k, H = shape_.hidden;
  char* own = bases_[rank_];
  auto* header = reinterpret_cast<kernels::EpHeader*>(own + l.header);
  auto* slots_done = reinterpret_cast<int*>(own + l.slots_done);
  kernels::launch_begin_call(header, slots_done, 2 * kMaxEpRanks, stream);
  kernels::ExchangeParams ex{};
  ex.ids[0] = a.topk_ids.data;
  ex.ids_are_i64[0] = a.topk_ids.dtype == DType::i64;
  ex.expected_rows[0] = slots_done + kMaxEpRanks;
  ex.weights[0] = bwd ? static_cast<const float*>(a.topk_weights.data) : nullptr;
  for (int q = 0; q < ep; ++q) {
    ex.all_ids[q] = reinterpret_cast<std::int32_t*>(bases_[q] + l.ids);
    ex.all_weights[q] = reinterpret_cast<float*>(bases_[q] + l.weights);
    ex.flags[q] = reinterpret_cast<int*>(&reinterpret_cast<kernels::EpHeader*>(bases_[q] + l.header)->exchange_flag[rank_]);
  }
  ex.num_local_experts = static_cast<int>(shape_.num_local_experts);
  ex.ranks = 1, ex.first_rank = rank_, ex.ep = ep, ex.pairs_per_rank = T * k;
  ex.rows_src[0] = static_cast<const std::uint16_t*>(a.x.data);
  ex.rows_dst[0] = reinterpret_cast<std::uint16_t*>(own + l.x);
  ex.rows_fp8 = !bwd && config_.pull_fp8_rows;  // (the FP8 forward's peers pull E4M3 rows: 2 T H bytes hold them)
  ex.hidden = static_cast<int>(H);
  if (bwd) {
    ex.rows_src[1] = static_cast<const std::uint16_t*>(bwd->dy.data);
    ex.rows_dst[1] = reinterpret_cast<std::uint16_t*>(own + l.dy);
  }
  ex.row_elements = T * H;
  ex.epoch = &header->epoch;
  ex.blocks_done = &header->blocks_done;
  kernels::launch_exchange(ex, stream);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the routing exchange");
  kernels::launch_wait_exchange(header, ep, static_cast<long long>(config_.timeout_seconds * 1e9), ws_->status_device(),
                                stream);
  const int device = [] {
    int d = 0;
    cudaGetDevice(&d);
    return d;
  }();
  plan_device(TensorView::contiguous(own + l.ids, DType::i32, Device::cuda(device), {ep, T, k}), rank_, ws_->plan(),
              stream, detail::backward_ring_fit(*ws_, backward_comm_ctas));
  kernels::PeerFlags flags{};
  for (int q = 0; q < ep; ++q) flags.header[q] = reinterpret_cast<kernels::EpHeader*>(bases_[q] + l.header);
  flags.rank = rank_;
  kernels::launch_publish_plan(header, ws_->plan().view().status, saved_marker, flags, ep, stream);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the plan's publication");
}

void EpRank::set_peers(kernels::EpPeers& e) const {
  const Layout l = Layout::of(shape_, tokens_);
  e.push = true;
  e.rank = rank_;
  e.size = size();
  for (int q = 0; q < size(); ++q) {
    e.slots[q] = reinterpret_cast<std::uint16_t*>(bases_[q] + l.slots);
    e.slots_done[q] = reinterpret_cast<int*>(bases_[q] + l.slots_done);
  }
  e.own_ids = reinterpret_cast<const std::int32_t*>(bases_[rank_] + l.ids) + rank_ * tokens_ * shape_.top_k;
  e.expected_rows = reinterpret_cast<const int*>(bases_[rank_] + l.slots_done) + kMaxEpRanks;
  e.system_scope = system_scope_;
  e.header = bases_[rank_] + l.header;
}

int EpRank::ctas() const {
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  const int sms = sm_count(device);
  return config_.compute_sms > 0 ? std::min(config_.compute_sms, sms) : sms;
}

// Where the row copies before the kernel read rank q's [T, H] rows (rows[q], in the symmetric
// regions): there, once per (token, expert) pair straight from the peers, or, with
// Config::pull_tokens_once, each needed peer token pulled once into recv_ here and every row then
// read from local memory. `local`: room for size() pointers.
std::span<const void* const> EpRank::row_sources(std::span<const void* const> rows, const void** local,
                                                 cudaStream_t stream) {
  if (recv_ == nullptr) return rows;
  const Layout l = Layout::of(shape_, tokens_);
  kernels::TokenPullParams t{};
  for (int q = 0; q < size(); ++q) t.x[q] = static_cast<const std::uint16_t*>(rows[q]);
  t.recv = recv_;
  t.ids = reinterpret_cast<const std::int32_t*>(bases_[rank_] + l.ids);
  t.tokens = tokens_;
  t.ep = size(), t.rank = rank_, t.top_k = static_cast<int>(shape_.top_k), t.hidden = static_cast<int>(shape_.hidden);
  t.num_local_experts = static_cast<int>(shape_.num_local_experts);
  kernels::launch_pull_tokens(t, 4 * detail::persistent_ctas(*ws_, kWhere), stream);  // (the dispatch's grid)
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the token pull");
  for (int q = 0; q < size(); ++q) local[q] = q == rank_ ? rows[q] : recv_ + q * tokens_ * shape_.hidden;
  return {local, static_cast<std::size_t>(size())};
}

// This rank's peer table for the shared rank step (ep_step.hpp): its symmetric regions' rows,
// its ring, its EpPeers and its row pulls (bf16, or quantized: Precision::fp8) from row_sources.
detail::RankPeers EpRank::peers(std::span<const void* const> x, std::span<const void* const> dy) {
  return {x,
          dy,
          ring_,
          ring_counters_,
          [this](kernels::EpPeers& e) { set_peers(e); },
          [this](std::span<const void* const> rows, void* routed, cudaStream_t s) {
            const void* local[kMaxEpRanks] = {};
            detail::dispatch_rows(row_sources(rows, local, s), routed, *ws_, s);
          },
          [this](std::span<const void* const> rows, std::uint8_t* values, std::uint8_t* exps, void* bf16, cudaStream_t s) {
            const void* local[kMaxEpRanks] = {};
            detail::pull_rows_fp8(*ws_, row_sources(rows, local, s), values, exps, bf16, 4 * ctas(), s, kWhere);
          },
          [this](std::span<const void* const> tokens, std::uint8_t* values, std::uint8_t* exps, cudaStream_t s) {
            detail::gather_fp8_rows(*ws_, tokens, values, exps, 4 * ctas(), s, kWhere);
          }};
}

void EpRank::forward(const ForwardArgs& a, cudaStream_t stream, const std::optional<TensorView>& saved) {
  const std::string where = detail::concat("mok::EpRank::forward (rank ", rank_, ")");
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  // No check of earlier device errors here: whether one is visible yet depends on timing,
  // and a rank that skipped this call would leave its peers waiting. check() reports them.
  const std::int64_t T = validate_forward_args(where, shape_, a, Device::cuda(device));
  if (T != tokens_) throw_argument_error(where, "x", "has ", T, " tokens but the rank was made for ", tokens_);
  detail::check_forward_precision(where, *ws_, a);
  detail::check_locations(where, a, shape_, true);
  if (saved) {
    if (training_ != Training::save) throw_argument_error(where, "saved", "needs a rank made with Training::save");
    detail::check_saved(where, *saved, *ws_, Device::cuda(device));
  }  // (none on a Training::save rank: a forward that saves nothing, for evaluation — as one GPU's)
  const int ctas = this->ctas();
  const int comm = detail::comm_ctas(where, config_, ctas);
  begin(a, nullptr, nullptr, stream);

  const Layout l = Layout::of(shape_, tokens_);
  const void* x_peers[kMaxEpRanks] = {};
  for (int q = 0; q < size(); ++q) x_peers[q] = bases_[q] + l.x;
  if (config_.precision == Precision::fp8) {  // (no ring: Workspace refuses one with fp8)
    const kernels::Fp8ForwardParams p =
        detail::forward_step_fp8(peers({x_peers, std::size_t(size())}, {}), a, *ws_,
                                 saved ? static_cast<std::uint16_t*>(saved->data) : nullptr, stream, kWhere);
    kernels::launch_forward_fp8(p, ctas, stream);
    detail::cuda_check(cudaGetLastError(), kWhere, "launching the FP8 forward kernel");
    return;
  }
  const kernels::ForwardParams p =
      detail::forward_step(peers({x_peers, std::size_t(size())}, {}), a, *ws_,
                           saved ? static_cast<std::uint16_t*>(saved->data) : nullptr, comm, stream, kWhere);
  kernels::launch_forward(p, ctas, stream);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the forward kernel");
}

void EpRank::backward(const ForwardArgs& a, const BackwardArgs& b, cudaStream_t stream,
                      const std::optional<TensorView>& saved) {
  const std::string where = detail::concat("mok::EpRank::backward (rank ", rank_, ")");
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), kWhere, "cudaGetDevice");
  detail::check_backward_call(where, a, b, *ws_, saved, device);
  const int ctas = this->ctas();
  const int comm = detail::comm_ctas(where, config_, ctas);
  auto* gu = static_cast<std::uint16_t*>(saved ? saved->data : ws_->recompute_buffer());
  unsigned long long* marker = detail::saved_marker(gu, *ws_);
  void* fp8_rows = ws_->rank_fp8_dgrad_rows();
  if (b.fp8 && fp8_rows == nullptr)
    throw_argument_error(where, "fp8", "was given, but the rank holds no FP8 dgrad rows: make it with "
                                       "Config::fp8_dgrad = true (and Precision::fp8, Training::save)");
  begin(a, &b, saved ? marker : nullptr, stream, comm);

  const Layout l = Layout::of(shape_, tokens_);
  const void* x_peers[kMaxEpRanks] = {};
  const void* dy_peers[kMaxEpRanks] = {};
  kernels::RingSources sources{};
  for (int q = 0; q < size(); ++q) {
    x_peers[q] = bases_[q] + l.x, dy_peers[q] = bases_[q] + l.dy;
    sources.x[q] = static_cast<const std::uint16_t*>(x_peers[q]);
    sources.dy[q] = static_cast<const std::uint16_t*>(dy_peers[q]);
  }
  if (b.fp8) {  // (Precision::fp8: Training::save, no ring; its weight gradients bf16 here, or after it in E4M3)
    const detail::Fp8BackwardStep step = detail::backward_step_fp8(
        peers({x_peers, std::size_t(size())}, {dy_peers, std::size_t(size())}), a, b, *ws_, gu,
        reinterpret_cast<const float*>(bases_[rank_] + l.weights), fp8_rows, stream, kWhere);
    kernels::launch_backward_fp8(step.params, ctas, stream);
    detail::cuda_check(cudaGetLastError(), kWhere, "launching the FP8 dgrad backward kernel");
    if (b.fp8_weight_gradients) detail::launch_rank_fp8_wgrad(*ws_, step.params.base, gu, fp8_rows, ctas, stream, kWhere);
    detail::cuda_check(cudaMemsetAsync(marker, 0, sizeof(*marker), stream), kWhere, "cudaMemsetAsync(saved marker)");
    return;
  }
  const detail::BackwardStep step = detail::backward_step(
      peers({x_peers, std::size_t(size())}, {dy_peers, std::size_t(size())}), a, b, *ws_,
      saved ? static_cast<std::uint16_t*>(saved->data) : nullptr,
      reinterpret_cast<const float*>(bases_[rank_] + l.weights), comm, ctas, stream, kWhere);
  kernels::launch_backward(step.params, ctas, stream, sources);
  detail::cuda_check(cudaGetLastError(), kWhere, "launching the backward kernel");
  detail::cuda_check(cudaMemsetAsync(marker, 0, sizeof(*marker), stream), kWhere, "cudaMemsetAsync(saved marker)");
}

void EpRank::check(cudaStream_t stream) {
  const cudaError_t err = cudaStreamSynchronize(stream);
  ws_->throw_if_failed();  // names this rank (and the peer of a timed-out wait)
  detail::cuda_check(err, kWhere, "cudaStreamSynchronize");
  try {
    ws_->plan().check(stream);
  } catch (const Error& e) {
    e.rethrow_with_prefix(detail::concat("rank ", rank_, ": "));
  }
}

}  // namespace mok
