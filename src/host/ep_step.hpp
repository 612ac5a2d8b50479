// One rank's step of an EP forward or backward, once the group's routing is exchanged and
// this rank's plan made: the rows pulled (or the ring set up), the counters zeroed, the
// recompute (backward without saved pre-activations) and the kernel's params. Both EP front
// ends run it — VirtualRanks for every rank of its one-launch group, EpRank for its own
// rank — and differ only in the peer table (RankPeers): where the peers' x and dy rows live
// and how this rank's EpPeers and row pulls are made.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <span>

#include "cuda_check.hpp"
#include "ep_common.hpp"
#include "kernels/backward/backward.cuh"
#include "kernels/forward/forward.cuh"
#include "layer_launch.hpp"

namespace mok::detail {

// One rank's view of its group.
struct RankPeers {
  std::span<const void* const> x, dy;  // every rank's [T, H] x rows and (backward) dy rows
  std::uint16_t* ring = nullptr;       // this rank's forward ring ([ring_rows, H]; null without one)
  int* ring_counters = nullptr;        // its counters ([2 ring_minibatches], zeroed per call)
  std::function<void(kernels::EpPeers&)> set_peers;                            // the kernel's peer table
  std::function<void(std::span<const void* const>, void*, cudaStream_t)> pull;  // peers' rows -> routed rows
  // Precision::fp8: peers' rows -> routed rows quantized (E4M3 values and their scales' E8M0 bytes;
  // launch_quantize_rows) and, when the fourth argument is not null, copied there in bf16 too (one read)
  std::function<void(std::span<const void* const>, std::uint8_t*, std::uint8_t*, void*, cudaStream_t)> pull_fp8;
  // Config::pull_fp8_rows: peers' E4M3 tokens (kernels/fp8/quantize_rows.cuh's layout) -> routed rows
  // (values, scale bytes)
  std::function<void(std::span<const void* const>, std::uint8_t*, std::uint8_t*, cudaStream_t)> gather_fp8;
};

// The routed rows of bf16 tokens (sources[q]: rank q's) quantized into values / exps, and, when bf16 is
// not null, copied there too (every row: no split) — RankPeers::pull_fp8's body.
inline void pull_rows_fp8(Workspace& ws, std::span<const void* const> sources, std::uint8_t* values, std::uint8_t* exps,
                          void* bf16, int ctas, cudaStream_t stream, std::string_view where) {
  kernels::QuantizeRowsParams q = quantize_rows_params(ws, sources, values, exps);
  q.rows_bf16 = static_cast<std::uint16_t*>(bf16), q.split = kernels::kNoSplit;
  kernels::launch_quantize_rows(q, ctas, stream);
  cuda_check(cudaGetLastError(), where, "launching the FP8 row gather");
}

// The routed rows of E4M3 tokens (sources[q]: rank q's, Config::pull_fp8_rows) into values / exps.
inline void gather_fp8_rows(Workspace& ws, std::span<const void* const> sources, std::uint8_t* values, std::uint8_t* exps,
                            int ctas, cudaStream_t stream, std::string_view where) {
  const MoeShape& s = ws.shape();
  const DevicePlanView& v = ws.plan().view();
  kernels::GatherFp8RowsParams g{};
  for (std::size_t q = 0; q < sources.size(); ++q) g.sources[q] = static_cast<const std::uint8_t*>(sources[q]);
  g.pairs_per_rank = ws.tokens() * s.top_k;
  g.tokens = ws.tokens();
  g.values = values, g.exps = exps;
  g.row_pair = v.row_pair, g.expert_offset = v.expert_offset, g.plan_status = v.status;
  g.capacity = ws.plan().capacity_rows();
  g.hidden = static_cast<int>(s.hidden), g.top_k = static_cast<int>(s.top_k);
  g.num_local_experts = static_cast<int>(s.num_local_experts);
  kernels::launch_gather_fp8_rows(g, ctas, stream);
  cuda_check(cudaGetLastError(), where, "launching the E4M3 row gather");
}

inline void zero_ring_counters(const Workspace& ws, int* counters, cudaStream_t stream, std::string_view where) {
  cuda_check(cudaMemsetAsync(counters, 0, sizeof(int) * 2 * ring_minibatches(ws), stream), where,
             "cudaMemsetAsync(ring counters)");
}

// The forward's step: with comm CTAs (comm > 0) they pull the rows through the ring inside
// the kernel; otherwise every row is pulled here, before the launch. saved: the pre-activations
// to keep for the backward, or null.
inline kernels::ForwardParams forward_step(const RankPeers& peers, const ForwardArgs& a, Workspace& ws,
                                           std::uint16_t* saved, int comm, cudaStream_t stream,
                                           std::string_view where) {
  if (comm == 0) peers.pull(peers.x, ws.x_routed(), stream);
  zero_counters(ws, stream, where);
  zero_ring_counters(ws, peers.ring_counters, stream, where);
  kernels::ForwardParams p = forward_params(a, ws, saved, false);
  peers.set_peers(p.ep);
  if (comm > 0) set_ring(p, ws, comm, peers.ring, peers.ring_counters, peers.x);
  return p;
}

// The FP8 forward's step (Precision::fp8; no ring): every routed row pulled from the rank that
// owns its token and quantized per 1 x 128 before the launch, into the rank's x rows' buffer —
// or, with Config::pull_fp8_rows, pulled as E4M3 from peers.x, its owners' quantized tokens.
inline kernels::Fp8ForwardParams forward_step_fp8(const RankPeers& peers, const ForwardArgs& a, Workspace& ws,
                                                  std::uint16_t* saved, cudaStream_t stream, std::string_view where) {
  const CallBuffers buffers = rank_buffers(ws);
  if (ws.config().pull_fp8_rows) peers.gather_fp8(peers.x, buffers.x_fp8, buffers.x_exps, stream);
  else peers.pull_fp8(peers.x, buffers.x_fp8, buffers.x_exps, nullptr, stream);
  zero_counters(ws, stream, where);
  kernels::Fp8ForwardParams p = fp8_forward_params(a, ws, buffers, saved);
  peers.set_peers(p.base.ep);
  return p;
}

// The backward's step. saved: the forward's pre-activations, or null (Training::recompute:
// GEMM1 runs again here on recompute_ctas CTAs, into the workspace's recompute buffer).
// all_weights: every rank's routing weights (the dh epilogue reads the weight of a global
// pair). With comm CTAs the dy and x rows stream through the rings; otherwise every row is
// pulled here. Returns the params and the saved tensor's marker (cleared after the launch).
struct BackwardStep {
  kernels::BackwardParams params;
  unsigned long long* marker;
};

inline BackwardStep backward_step(const RankPeers& peers, const ForwardArgs& a, const BackwardArgs& b, Workspace& ws,
                                  std::uint16_t* saved, const float* all_weights, int comm, int recompute_ctas,
                                  cudaStream_t stream, std::string_view where) {
  const bool ring = comm > 0;
  auto* gu = saved ? saved : static_cast<std::uint16_t*>(ws.recompute_buffer());
  if (!ring || !saved) peers.pull(peers.x, ws.x_routed(), stream);  // (the recompute's GEMM1 reads every x row)
  if (!saved) {
    zero_counters(ws, stream, where);
    kernels::launch_forward(forward_params(a, ws, gu, true), recompute_ctas, stream);
    cuda_check(cudaGetLastError(), where, "launching the recompute");
  }
  if (!ring) peers.pull(peers.dy, ws.dy_routed(), stream);
  zero_counters(ws, stream, where);
  BackwardStep step{backward_params(a, b, ws, gu), saved_marker(gu, ws)};
  kernels::BackwardParams& p = step.params;
  p.topk_weights = all_weights;
  peers.set_peers(p.ep);
  p.ep.push = p.ep.size > 1;  // one rank has no peer: dx rows leave by TMA stores in plan order
  if (ring) {
    zero_ring_counters(ws, peers.ring_counters, stream, where);
    set_backward_ring(p, ws, comm, peers.ring_counters);
  }
  return step;
}

// The backward's step with the FP8 dgrad (Precision::fp8 with BackwardArgs::fp8; no ring, no
// recompute): the x rows pulled (the weight gradients read them), the dy rows pulled once into
// E4M3 rows for the dh tiles and bf16 ones for the weight gradients, the dgate|dup rows' room in
// fp8_rows (Workspace::rank_fp8_dgrad_rows). With BackwardArgs::fp8_weight_gradients the launch
// runs no routed weight tile (launch_rank_fp8_wgrad then does). Returns the FP8 kernel's params
// and the saved tensor's marker.
struct Fp8BackwardStep {
  kernels::Fp8BackwardParams params;
  unsigned long long* marker;
};

inline Fp8BackwardStep backward_step_fp8(const RankPeers& peers, const ForwardArgs& a, const BackwardArgs& b,
                                         Workspace& ws, std::uint16_t* saved, const float* all_weights, void* fp8_rows,
                                         cudaStream_t stream, std::string_view where) {
  CallBuffers buffers = rank_buffers(ws);
  rank_fp8_dgrad_buffers(buffers, ws, fp8_rows);
  peers.pull(peers.x, ws.x_routed(), stream);
  peers.pull_fp8(peers.dy, buffers.dy_fp8, buffers.dy_exps, ws.dy_routed(), stream);
  zero_counters(ws, stream, where);
  kernels::BackwardParams p = backward_params(a, b, ws, buffers, saved);
  p.topk_weights = all_weights;
  peers.set_peers(p.ep);
  p.ep.push = p.ep.size > 1;  // (as backward_step)
  Fp8BackwardStep step{backward_fp8_params(b, ws, buffers, p), saved_marker(saved, ws)};
  if (b.fp8_weight_gradients) step.params.routed_weights = false, step.params.base.dx_over_x = false;
  return step;
}

// After the FP8 dgrad launch of a step with BackwardArgs::fp8_weight_gradients: the four operands
// transposed and quantized from the rank's own rows (the pulled x and dy rows, w h, and dgate|dup in
// the saved tensor: plan rows, no gather; the same bytes as one GPU's gathers), then the FP8
// weight-gradient launch (the rank's experts' gradients: no peer involved).
inline void launch_rank_fp8_wgrad(Workspace& ws, const kernels::BackwardParams& p, std::uint16_t* saved,
                                  void* fp8_rows, int ctas, cudaStream_t stream, std::string_view where) {
  const std::int64_t H = ws.shape().hidden, I = ws.shape().intermediate;
  CallBuffers w = rank_buffers(ws);
  rank_fp8_wgrad_buffers(w, ws, fp8_rows);
  quantize_transposed(ws, saved, 2 * I, false, w.dgu_t, w.dgu_t_exps, nullptr, stream, where);
  quantize_transposed(ws, w.hidden, I, false, w.hw_t, nullptr, w.hw_t_exponents, stream, where);
  quantize_transposed(ws, ws.dy_routed(), H, false, w.dy_t, w.dy_t_exps, nullptr, stream, where);
  quantize_transposed(ws, ws.x_routed(), H, false, w.x_t, nullptr, w.x_t_exponents, stream, where);
  kernels::launch_wgrad_fp8(wgrad_fp8_params(ws, w, p), ctas, stream);
  cuda_check(cudaGetLastError(), where, "launching the FP8 weight-gradient kernel");
}

}  // namespace mok::detail
