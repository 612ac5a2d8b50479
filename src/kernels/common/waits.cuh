// Bounded waits: every wait of the kernels gives up after the params' timeout_ns, records
// where (a WaitSite), what it saw and what it waited for in the host-mapped KernelStatus, and
// traps: a stalled wait never hangs silently (the host names rank, peer, site and counters).
//
// A kernel's params type P provides: counters.abort (int*: the first CTA to give up sets it),
// status (KernelStatus*), timeout_ns.
#pragma once

#include <cstdint>

#include "mok/kernel_status.hpp"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"

namespace mok::kernels {

// Records the first failure in the host-mapped status and stops the kernel: a stalled
// wait must never hang silently.
template <typename P>
__device__ __noinline__ void give_up(const P& p, int task, WaitSite site, int observed, int expected, int peer = -1) {
  if (atomicCAS(p.counters.abort, 0, 1) == 0) {
    volatile KernelStatus* s = p.status;
    s->block = blockIdx.x;
    s->task = task;
    s->site = site;
    s->peer = peer;
    s->observed = observed;
    s->expected = expected;
    __threadfence_system();
    s->code = KernelStatus::timeout;
    __threadfence_system();
  }
  __trap();
}

// The waits' clock: %globaltimer in units of 1024 ns, 32 bits. It wraps after 73 minutes;
// Config::timeout_seconds is at most an hour (mok::validate). One register where 64-bit
// nanoseconds took two, in slow paths inlined beside a producer that has 40.
__device__ __forceinline__ std::uint32_t wait_clock() { return static_cast<std::uint32_t>(ptx::globaltimer_ns() >> 10); }
template <typename P>
__device__ __forceinline__ bool expired(const P& p, std::uint32_t start) {
  return wait_clock() - start > static_cast<std::uint32_t>(p.timeout_ns >> 10);
}

template <typename P>
__device__ __forceinline__ void wait_barrier(const P& p, std::uint64_t* bar, std::uint32_t parity, int task, WaitSite site) {
  const std::uint32_t address = ptx::smem_address(bar);  // (32 bits across the loop)
  if (ptx::mbarrier_try_wait_parity(address, parity)) return;
  const std::uint32_t start = wait_clock();
  for (std::uint32_t spin = 1;; ++spin) {
    if (ptx::mbarrier_try_wait_parity(address, parity)) return;
    if ((spin & 1023) == 0 && expired(p, start))
      give_up(p, task, site, static_cast<int>(parity ^ 1u), static_cast<int>(parity));
  }
}

template <typename P>
__device__ __forceinline__ void wait_counter(const P& p, const int* counter, int expected, int task, WaitSite site) {
  int seen = ptx::ld_acquire_gpu(counter);
  if (seen >= expected) return;
  const std::uint32_t start = wait_clock();
  while ((seen = ptx::ld_acquire_gpu(counter)) < expected) {
    __nanosleep(128);
    if (expired(p, start)) give_up(p, task, site, seen, expected);
  }
}

// The same for a counter that rank `peer` advances (system scope: it may be another GPU).
template <typename P>
__device__ __forceinline__ void wait_peer_counter(const P& p, const int* counter, int expected, int task, WaitSite site,
                                                  int peer) {
  int seen = ptx::ld_acquire_sys(counter);
  if (seen >= expected) return;
  const std::uint32_t start = wait_clock();
  while ((seen = ptx::ld_acquire_sys(counter)) < expected) {
    __nanosleep(256);
    if (expired(p, start))
      give_up(p, task, site, seen, expected, peer);
  }
}

}  // namespace mok::kernels
