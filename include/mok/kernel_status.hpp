// What the kernels record for the host, shared by device and host code (this header
// includes nothing but <cstdint>): the planner's status, every bounded wait of the kernels
// by its site, and the status record the host reads without synchronising.
#pragma once

#include <cstdint>

namespace mok {

// Most ranks of one expert-parallel group (one NVLink node; the kernels' per-rank arrays).
inline constexpr int kMaxEpRanks = 8;

// Every bounded wait in the kernels. The host's message for each is wait_site_text() (in
// src/host/workspace.cpp); a timeout names the site, the rank, the peer and the counters.
enum class WaitSite : std::int32_t {
  none = 0,
  stage_full = 1,         // a filled pipeline stage (full barrier)
  stage_empty = 2,        // a free pipeline stage (empty barrier)
  hidden_ready = 3,       // forward: GEMM1 rows of an M-tile (h_ready)
  all_gemm2 = 4,          // forward: every GEMM2 tile before the combine (y_done)
  dh_ready = 5,           // backward: the dh tiles of an M-tile (dgu_ready)
  expert_dh_ready = 6,    // backward: every dh tile of an expert, before its weight gradients
  all_dx = 7,             // backward: every dx row tile before the combine (dx_done)
  forward_pushed = 8,     // forward: result rows a peer pushes into this rank's slots
  backward_pushed = 9,    // backward: dx rows and d_topk_weights partials a peer pushes
  forward_landed = 10,    // forward: a minibatch of rows in the ring
  forward_freed = 11,     // forward comm CTA: GEMM1 to free a ring slot
  exchange_flag = 12,     // a peer's routing exchange of this call
  plan_flag = 13,         // a peer's plan of this call
  forward_copy = 14,      // forward comm CTA: a bulk copy into its staging
  backward_landed = 15,   // backward: a minibatch of dy and x rows in the ring
  backward_freed = 16,    // backward comm CTA: the dh and weight-gradient tasks to free a ring slot
  backward_copy = 17,     // backward comm CTA: a bulk copy into its staging
  x_rows_read = 18,       // forward: GEMM1 to read the x rows a GEMM2 tile's slot rows overwrite
  grad_rows_read = 19,    // backward: every dW_down tile to read the rows kept in the gradients
  mainloop_turn = 20,     // ping-pong forward: the other consumer warpgroup's mainloop to reach its last stage
  x_rows_copied = 21,     // forward (MOK_DIAG_COPY_WARPS builds): the producer warps to copy an M-tile's x rows
};

// Written by the planner kernels; read by later kernels (which stop when code != 0)
// and by the host only when it asks (DevicePlan::check()).
struct PlanStatus {
  enum Code : std::int32_t { ok = 0, expert_out_of_range = 1, capacity_exceeded = 2, ring_too_small = 3 };
  std::int32_t code;
  std::int32_t pad;
  std::int64_t index;  // expert_out_of_range: first bad position in all_topk_ids; ring_too_small: the local expert
  std::int64_t value;  // expert_out_of_range: the bad id; capacity_exceeded, ring_too_small: its padded rows
  std::int64_t limit;  // capacity_exceeded: capacity_rows; ring_too_small: the ring's rows
};

// Device-side record of a failed wait or bad input, in host-mapped memory: the host can read
// it without synchronising, and it survives a kernel that stopped early.
struct KernelStatus {
  enum Code : std::int32_t { ok = 0, timeout = 1, bad_plan = 2, saved_not_valid = 3 };
  std::int32_t code;
  std::int32_t block;     // CTA that gave up
  std::int32_t task;      // task it was on
  WaitSite site;          // which wait
  std::int32_t peer;      // rank whose progress it waited for (expert parallelism), else -1
  std::int32_t pad;
  std::int64_t observed;  // counter value seen last
  std::int64_t expected;  // value it waited for
};

}  // namespace mok
