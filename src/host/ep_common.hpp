// Host pieces shared by the two EP front ends (VirtualRanks: every rank in one launch;
// EpRank: one rank per launch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include <span>
#include <string_view>

#include "kernels/backward/backward.cuh"
#include "kernels/forward/forward.cuh"
#include "mok/device_plan.hpp"
#include "mok/ep.hpp"
#include "mok/error.hpp"
#include "mok/forward.hpp"
#include "tensor_map.hpp"

namespace mok::detail {

// Minibatches of the largest plan the workspace can hold, and the ring's rows
// (Config::ring_rows, or room for every row).
inline std::int64_t ring_minibatches(const Workspace& ws) {
  return (ws.plan().capacity_rows() + ws.config().minibatch_rows - 1) / ws.config().minibatch_rows;
}

inline std::int64_t ring_rows(const Workspace& ws) {
  return ws.config().ring_rows > 0 ? ws.config().ring_rows : ring_minibatches(ws) * ws.config().minibatch_rows;
}

// A ring's shape for `comm_ctas` comm CTAs; counters: [2 * ring_minibatches] (landed, then
// freed), zeroed per call.
inline kernels::RingGeometry ring_geometry(const Workspace& ws, int comm_ctas, int* counters) {
  return {comm_ctas, static_cast<int>(ws.config().minibatch_rows), static_cast<int>(ring_rows(ws)), counters,
          counters + ring_minibatches(ws)};
}

// The forward's ring fields: `comm_ctas` CTAs pull rank q's rows from x[q] into `ring`
// ([ring_rows, H]).
inline void set_ring(kernels::ForwardParams& p, const Workspace& ws, int comm_ctas, std::uint16_t* ring, int* counters,
                     std::span<const void* const> x) {
  const std::int64_t rows = ring_rows(ws);
  static_cast<kernels::RingGeometry&>(p.ring) = ring_geometry(ws, comm_ctas, counters);
  p.ring.buffer = ring;
  for (std::size_t q = 0; q < x.size(); ++q) p.ring.x[q] = static_cast<const std::uint16_t*>(x[q]);
  p.maps.x_routed = make_bf16_tensor_map(ring, {std::uint64_t(ws.shape().hidden), std::uint64_t(rows)}, kernels::kBoxK, "ring");
}

// The backward's ring (kernels/backward/backward.cuh): the workspace's dy and x row buffers, used
// ring_rows rows at a time (rows never pass capacity, so a ring larger than that never
// wraps). The maps of the routed dy and x rows then cover them.
inline void set_backward_ring(kernels::BackwardParams& p, Workspace& ws, int comm_ctas, int* counters) {
  const std::int64_t rows = std::min(ring_rows(ws), ws.plan().capacity_rows());
  const std::uint64_t H = ws.shape().hidden;
  auto* dy = static_cast<std::uint16_t*>(ws.dy_routed());
  auto* x = static_cast<std::uint16_t*>(ws.x_routed());
  p.ring = {ring_geometry(ws, comm_ctas, counters), dy, x};
  p.routed_maps.dy_k = make_bf16_row_regions_map(dy, nullptr, H, std::uint64_t(rows), 0, kernels::kBoxK, "dy ring");
  p.routed_maps.dy_mn = make_bf16_row_regions_map(dy, nullptr, H, std::uint64_t(rows), 0, kernels::kBoxMN, "dy ring");
  p.routed_maps.x_mn = make_bf16_tensor_map(x, {H, std::uint64_t(rows)}, kernels::kBoxMN, "x ring");
}

// What the planner must check for the backward's ring (none without comm CTAs).
inline RingFit backward_ring_fit(const Workspace& ws, int comm_ctas) {
  if (comm_ctas == 0) return {};
  return {ws.config().minibatch_rows, ring_rows(ws)};
}

// Bytes of a rank's combine slot buffer: the forward's pushed bf16 result rows [T k, H], whose
// memory the EP backward's pushed dx rows reuse, then the backward's d_topk_weights partials
// [T k, ceil(I / 256)] fp32 (kernels/ep/ep.cuh). The same size with or without training, so
// that EpRank::region_bytes() needs no Training.
inline std::int64_t ep_slot_bytes(const MoeShape& s, std::int64_t tokens_per_rank) {
  const std::int64_t pairs = tokens_per_rank * s.top_k;
  return 2 * pairs * s.hidden + 4 * pairs * ((s.intermediate + 255) / 256);
}

// The checks both EP front ends make of a group's shape: ranks and tokens per rank.
// Returns the number of ranks.
inline std::int64_t check_ep_group(std::string_view where, const MoeShape& shape, const Config& config,
                                   std::int64_t tokens_per_rank) {
  validate(shape);
  validate(config);
  const std::int64_t ep = shape.ep_size();
  if (ep > kMaxEpRanks)
    throw_argument_error(where, "num_local_experts", "makes ", ep, " ranks (num_experts / num_local_experts); at most ",
                         kMaxEpRanks, " are supported");
  if (tokens_per_rank < 1) throw_argument_error(where, "tokens_per_rank", "must be >= 1, got ", tokens_per_rank);
  if (ep * tokens_per_rank * shape.top_k > std::numeric_limits<std::int32_t>::max())
    throw_argument_error(where, "tokens_per_rank", "ranks * T * k must fit in int32, got ",
                         ep * tokens_per_rank * shape.top_k);
  return ep;
}

// Whether the forward pulls rows through the ring (comm CTAs beside the GEMM tiles): only
// when asked for, by Config::comm_sms or Config::ring_rows. Otherwise every SM pulls the
// rows before the fused kernel, which measured faster on an H200 (EP = 1: the ring with
// comm CTAs 1.13x / 1.57x the one-GPU forward on deepseek-v3 / qwen3-30b-a3b; docs/ep.md).
inline bool uses_ring(const Config& config) { return config.comm_sms > 0 || config.ring_rows > 0; }

// Comm CTAs of a rank with `ctas` CTAs: Config::comm_sms, or one in 32 when only ring_rows
// asks for the ring; none without the ring or for a rank of one CTA (its rows are then
// pulled before the launch).
inline int comm_ctas(std::string_view where, const Config& config, int ctas) {
  if (config.comm_sms > 0 && config.comm_sms >= ctas)
    throw_argument_error(where, "comm_sms", "must leave each rank compute SMs: ", ctas, " SMs per rank, comm_sms = ",
                         config.comm_sms);
  if (!uses_ring(config)) return 0;
  return config.comm_sms > 0 ? config.comm_sms : ctas >= 2 ? std::max(1, ctas / 32) : 0;
}

}  // namespace mok::detail
