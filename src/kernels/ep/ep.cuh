// Expert parallelism in the kernels: the peer table (base pointers of every rank's
// symmetric buffers, wherever they came from: virtual ranks on one GPU, peer access,
// NCCL windows) and the push-combine fields of the forward.
#pragma once

#include <cstdint>

#include "mok/kernel_status.hpp"  // kMaxEpRanks: the ranks of an EP group (virtual ranks too)

namespace mok::kernels {

// A ring token buffer's shape and counters (forward: RingParams, backward: BackwardRing).
// comm_ctas > 0: the first comm_ctas CTAs of the rank pull the plan's rows into a ring of
// ring_rows rows, one minibatch of minibatch_rows plan rows at a time (landed[m] += rows);
// the compute side counts its reads of minibatch m in freed[m], and a slot is overwritten
// only once the minibatch that held it is read (kernels/ep/ring_copy.cuh: RingPull).
struct RingGeometry {
  int comm_ctas;
  int minibatch_rows;  // a multiple of 128 (an M-tile)
  int ring_rows;       // a multiple of minibatch_rows
  int* landed;         // [minibatches]
  int* freed;          // [minibatches]
};

// Push combine. With push set, result rows go to the slots of the rank that owns the
// token, at row t * k + j there, and each rank's combine waits until slots_done[q] (rows
// pushed by rank q, times column tiles) reaches what its own routing expects from q.
// Forward: slots are [T * k, H] bf16 (GEMM2 rows). Backward: the same memory holds the dx rows,
// [T * k, H] bf16, and the d_topk_weights partials follow them, [T * k, ceil(I / 256)] fp32
// (detail::ep_slot_bytes).
// Without push (the one-GPU path), rows stay in plan order in the workspace and the
// combine finds them through pair_row.

struct EpPeers {
  int rank, size;
  bool push;
  bool system_scope;             // peers are other GPUs (else: virtual ranks on this GPU)
  bool stalled;                  // tests: this rank does nothing, as a hung peer would
  std::uint16_t* slots[kMaxEpRanks];  // rank q's combine slots
  int* slots_done[kMaxEpRanks];    // rank q's counters [kMaxEpRanks]: entry r counts rank r's pushes
  const int* expected_rows;      // [kMaxEpRanks]: rows this rank's routing sends to each rank
  const std::int32_t* own_ids;   // [T, k] this rank's routing (-1: no expert)
  const void* plan_status[kMaxEpRanks];  // rank q's PlanStatus: a bad plan anywhere stops every rank
  const unsigned long long* saved_marker[kMaxEpRanks];  // backward: rank q's saved-tensor trailer, likewise
  // Separate launches per rank (kernels/ep/ep_sync.cuh): this rank's EpHeader, whose plan
  // flags carry every rank's plan (and saved-tensor) status instead of the pointers above.
  const void* header;
};

}  // namespace mok::kernels
