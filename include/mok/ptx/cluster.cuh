// Thread-block clusters (sm_90): this CTA's rank in its cluster, the cluster barrier, a peer
// CTA's shared memory, and TMA loads multicast into several CTAs' shared memory (inside one
// GPU: not NVLink multicast). Used by bench/fp8_tile_rate's clustered variant (the BF16 forward's
// MOK_DIAG_CLUSTER2 build that first used them was measured and removed: bench/NOTES.md).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "mok/ptx/common.cuh"

namespace mok::ptx {

__device__ __forceinline__ std::uint32_t cluster_ctarank() {
  std::uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster (warp-aligned), with release / acquire semantics.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Makes this thread's mbarrier initialisations visible to the cluster's other CTAs.
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The shared::cluster address of `p`'s counterpart in the cluster's CTA `rank`.
__device__ __forceinline__ std::uint32_t cluster_address(const void* p, std::uint32_t rank) {
  std::uint32_t address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(address) : "r"(smem_address(p)), "r"(rank));
  return address;
}

// Arrives on an mbarrier of another CTA of the cluster (address from cluster_address), with the
// instruction's default semantics (badb625's `.release.cluster` made the clustered forward 1.39x
// slower than the default; this form is the one CUTLASS's cluster barriers use).
__device__ __forceinline__ void mbarrier_arrive_remote(std::uint32_t cluster_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_bar) : "memory");
}

// Global -> the shared memory of every CTA in `cta_mask` at dst's offset, each CTA's mbarrier
// at bar's offset counting the bytes it receives (a 2D tensor map).
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, std::uint64_t* bar, int c0,
                                                      int c1, std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_address(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

}  // namespace mok::ptx
