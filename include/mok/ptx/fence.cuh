// Fences between proxies and scopes.
#pragma once

namespace mok::ptx {

// Generic-proxy shared-memory writes -> later async-proxy (TMA, wgmma) reads; also makes
// freshly initialised mbarriers visible to the TMA unit.
__device__ __forceinline__ void fence_proxy_async_shared_cta() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Orders global-memory accesses between the generic and the async proxy.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Named barrier over `threads` threads (a multiple of 32) with id `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync kId, kThreads for the threads whose threadIdx.x lies in [kFirst, kEnd) (the others pass
// it), predicated in the instruction rather than branched around, with id and count as
// immediates: loops at their register budget spilled with a branch or registers for them.
template <int kId, int kThreads, unsigned kFirst, unsigned kEnd>
__device__ __forceinline__ void named_barrier_sync_if_thread_in() {
  static_assert(kId >= 1 && kId < 16 && kThreads % 32 == 0 && kFirst % 32 == 0 && kEnd % 32 == 0);
  asm volatile(
      "{\n\t.reg .pred p;\n\t.reg .u32 t;\n\t"
      "mov.u32 t, %%tid.x;\n\t"
      "setp.ge.u32 p, t, %0;\n\t"
      "setp.lt.and.u32 p, t, %1, p;\n\t"
      "@p bar.sync %2, %3;\n\t}" ::"n"(kFirst),
      "n"(kEnd), "n"(kId), "n"(kThreads)
      : "memory");
}
// Arrives at named barrier `id` without waiting (the other `threads` - 32k wait in bar.sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace mok::ptx
