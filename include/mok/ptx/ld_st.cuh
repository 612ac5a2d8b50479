// Loads and stores with memory order and scope in the name.
#pragma once

#include <cstdint>

#include "mok/ptx/common.cuh"

namespace mok::ptx {

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// System scope: counters that other GPUs (expert-parallel peers) write or read.
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_sys_add(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Plain 32-bit global load/store the compiler keeps in program order with each other.
// An epilogue that loads next to 128 live accumulators uses them to load in small
// groups: left to itself, the compiler hoists every load to the top and spills.
__device__ __forceinline__ std::uint32_t ld_global_ordered(const void* p) {
  std::uint32_t v;
  asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_global_ordered(void* p, std::uint32_t v) {
  asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(v));
}
// 4 and 16 bytes of shared memory at a shared-window address (LDS, LDS.128; 16-byte aligned for the
// second), in program order with the other volatile asm (e.g. after an mbarrier wait).
__device__ __forceinline__ std::uint32_t ld_shared_u32(std::uint32_t address) {
  std::uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(address));
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4_u32(std::uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}
// A 16-byte shared-memory load kept in program order with st_global_ordered (p 16-byte aligned):
// copying rows from shared to global memory, one load and its store at a time.
__device__ __forceinline__ uint4 ld_shared_v4_ordered(const void* p) { return ld_shared_v4_u32(smem_address(p)); }
// A 4-byte shared-memory load at a shared-window address (smem_address): LDS, where a generic
// pointer into shared memory compiles to a generic LD.
__device__ __forceinline__ float ld_shared_f32(std::uint32_t address) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address));
  return v;
}
// A byte of shared memory at a shared-window address (LDS.U8), zero-extended.
__device__ __forceinline__ std::uint32_t ld_shared_u8(std::uint32_t address) {
  std::uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(address));
  return v;
}
// A 4-byte shared-memory store at a shared-window address (smem_address): a 32-bit address
// register where a generic store takes 64 bits.
__device__ __forceinline__ void st_shared_b32(std::uint32_t address, std::uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(address), "r"(v));
}
// The same store, 16 bytes (p 16-byte aligned).
__device__ __forceinline__ void st_global_v4_ordered(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// cp.async (LDGSTS): 16 bytes from global to shared memory with no registers in between,
// cached in L2 only; zero_fill writes 16 zero bytes instead (nothing is read). Completion:
// cp_async_commit() closes a group, cp_async_wait<N>() waits until at most N groups of
// this thread are pending (then a barrier makes every thread's copies visible).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool zero_fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(zero_fill ? 0 : 16) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory"); }

__device__ __forceinline__ std::uint64_t globaltimer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Hands registers back (producer) or takes more (consumers); warpgroup-uniform.
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace mok::ptx
