// Synchronisation of an EP group whose ranks run separate launches (other GPUs, or other
// streams): per-rank call numbers (epochs) kept on the device, never reset by the host, so
// that CUDA-graph replays work; flags carry them between ranks (release/acquire, system
// scope); every wait is bounded and names the peer it waited for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/ep/ep.cuh"
#include "mok/kernel_status.hpp"

namespace mok::kernels {

// The header of a rank's symmetric region: epoch (wraps around; compared by signed
// difference, see reached()); blocks_done (exchange); the exchange flag, plan flag and
// plan code of every rank.
struct EpHeader {
  unsigned epoch;
  int blocks_done;
  int pad[6];
  unsigned exchange_flag[kMaxEpRanks];  // = epoch of rank q's last exchange into this rank
  unsigned plan_flag[kMaxEpRanks];      // = epoch of rank q's last published plan
  int plan_code[kMaxEpRanks];           // its code, written before the flag (see publish_plan)
};

// Whether a flag holding `seen` has reached call `epoch` (modulo 2^32).
__host__ __device__ inline bool reached(unsigned seen, unsigned epoch) { return static_cast<int>(seen - epoch) >= 0; }

// epoch += 1; zeroes blocks_done and `counters` (count ints): the start of a call.
void launch_begin_call(EpHeader* header, int* counters, int count, cudaStream_t stream);

// Waits until every rank's exchange flag in `header` has reached this rank's epoch.
// On timeout: `status` names the site (WaitSite::exchange_flag) and the peer, and the kernel traps.
void launch_wait_exchange(const EpHeader* header, int ranks, long long timeout_ns, KernelStatus* status,
                          cudaStream_t stream);

// At every rank q: plan_code[this rank] = code, then plan_flag[this rank] = epoch (release);
// code = the plan's code (0 ok), + 8 if `saved_marker` (the backward's) is not valid.
struct PeerFlags {
  EpHeader* header[kMaxEpRanks];  // rank q's header
  int rank;                     // this rank
};
void launch_publish_plan(const EpHeader* header, const void* plan_status, const unsigned long long* saved_marker,
                         const PeerFlags& peer_flags, int ranks, cudaStream_t stream);

}  // namespace mok::kernels
