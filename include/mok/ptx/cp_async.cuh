// Non-bulk asynchronous copies (cp.async), for gathers whose rows TMA cannot address.
#pragma once

#include <cstdint>

#include "mok/ptx/common.cuh"

namespace mok::ptx {

// 16 bytes global -> shared, L2 only; src_bytes = 0 writes 16 zero bytes instead.
__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, std::uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}

// The barrier's pending count drops by one when this thread's earlier cp.asyncs complete
// (the arrival is part of the barrier's initial count: .noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(bar)) : "memory");
}

}  // namespace mok::ptx
