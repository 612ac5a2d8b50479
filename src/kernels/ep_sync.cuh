// Synchronisation of an EP group whose ranks run separate launches (other GPUs, or other
// streams): per-rank call numbers (epochs) kept on the device, never reset by the host, so
// that CUDA-graph replays work; flags carry them between ranks (release/acquire, system
// scope); every wait is bounded and names the peer it waited for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/ep.cuh"
#include "mok/forward.hpp"

namespace mok::kernels {

// The header of a rank's symmetric region (ints): epoch; blocks_done (exchange); the
// exchange flag and the plan flag of every rank.
struct EpHeader {
  int epoch;
  int blocks_done;
  int pad[6];
  int exchange_flag[kMaxRanks];  // = epoch of rank q's last exchange into this rank
  int plan_flag[kMaxRanks];      // = 16 * epoch + code of rank q's last plan (see publish_plan)
};

// epoch += 1; zeroes blocks_done and `counters` (count ints): the start of a call.
void launch_begin_call(EpHeader* header, int* counters, int count, cudaStream_t stream);

// Waits until every rank's exchange flag in `header` has reached this rank's epoch.
// On timeout: `status` names the phase (12) and the peer, and the kernel traps.
void launch_wait_exchange(const EpHeader* header, int ranks, long long timeout_ns, KernelStatus* status,
                          cudaStream_t stream);

// plan_flag[this rank] = 16 * epoch + code at every rank q (peer_flags[q]); code = the
// plan's code (0 ok), + 8 if `saved_marker` (the backward's) is not valid.
struct PeerFlags {
  int* at[kMaxRanks];  // rank q's plan_flag of this rank
};
void launch_publish_plan(const EpHeader* header, const void* plan_status, const unsigned long long* saved_marker,
                         const PeerFlags& peer_flags, int ranks, cudaStream_t stream);

}  // namespace mok::kernels
