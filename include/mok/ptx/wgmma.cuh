// wgmma (sm_90a): warpgroup matrix multiply-accumulate, bf16 x bf16 or e4m3 x e4m3 -> fp32, both
// operands in shared memory with the 128-byte swizzle, K-major or MN-major, described by
// 64-bit descriptors.
#pragma once

#include <cstdint>

#include "mok/ptx/common.cuh"

namespace mok::ptx {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle: rows of
// 128 bytes, 8-row core groups 1024 bytes apart. Advancing along K by 16 elements (32
// bytes) inside the swizzle atom adds 2 to the address field.
// The low 32 bits are the tile's own (start address, leading byte offset); the high 32 bits,
// kSw128DescriptorHigh, are the same for every such tile.
inline constexpr std::uint32_t kSw128DescriptorHigh = (1024 >> 4)  // stride byte offset: 8 rows x 128 bytes
                                                      | (1u << 30);  // (bit 62) layout: 128-byte swizzle
__device__ __forceinline__ std::uint32_t wgmma_descriptor_sw128_lo(const void* tile) {
  return ((smem_address(tile) & 0x3FFFF) >> 4)  // start address, 16-byte units
         | (1u << 16);                          // leading byte offset (unused with swizzle)
}
__device__ __forceinline__ std::uint64_t wgmma_descriptor_sw128(const void* tile) {
  return (std::uint64_t{kSw128DescriptorHigh} << 32) | wgmma_descriptor_sw128_lo(tile);
}

// Descriptor of an MN-major tile with the 128-byte swizzle, as TMA writes boxes of
// {64 MN elements, K rows}: each K row is 128 bytes (64 elements of M or N), 8-row core
// groups are 1024 bytes apart (stride byte offset) and the next 64 MN elements start
// `mn_group_bytes` further (leading byte offset). Advancing along K by 16 rows (2048
// bytes) adds 128 to the address field.
__device__ __forceinline__ std::uint64_t wgmma_descriptor_sw128_mn(const void* tile, std::uint32_t mn_group_bytes) {
  const std::uint64_t address = smem_address(tile);
  return ((address & 0x3FFFF) >> 4)                             // start address, 16-byte units
         | (std::uint64_t{(mn_group_bytes >> 4) & 0x3FFF} << 16)  // leading byte offset: next 64 MN elements
         | (std::uint64_t{1024 >> 4} << 32)                      // stride byte offset: next 8 K rows
         | (std::uint64_t{1} << 62);                             // layout: 128-byte swizzle
}

// The 128 accumulator operands of an m64n256 MMA (d: float[128]), as the asm's register list
// (%0 .. %127) and its constraints.
#define MOK_WGMMA_ACC128_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define MOK_WGMMA_ACC128(d) MOK_WGMMA_ACC64_AT(d, 0), MOK_WGMMA_ACC64_AT(d, 64)

// The 64 accumulator operands of an m64n128 MMA (d: float[64]), likewise (%0 .. %63).
#define MOK_WGMMA_ACC64_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// (the constraints of d[o] .. d[o + 63])
#define MOK_WGMMA_ACC64_AT(d, o) \
    "+f"(d[(o) + 0]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3]), "+f"(d[(o) + 4]), "+f"(d[(o) + 5]), "+f"(d[(o) + 6]), "+f"(d[(o) + 7]), \
    "+f"(d[(o) + 8]), "+f"(d[(o) + 9]), "+f"(d[(o) + 10]), "+f"(d[(o) + 11]), "+f"(d[(o) + 12]), "+f"(d[(o) + 13]), "+f"(d[(o) + 14]), "+f"(d[(o) + 15]), \
    "+f"(d[(o) + 16]), "+f"(d[(o) + 17]), "+f"(d[(o) + 18]), "+f"(d[(o) + 19]), "+f"(d[(o) + 20]), "+f"(d[(o) + 21]), "+f"(d[(o) + 22]), "+f"(d[(o) + 23]), \
    "+f"(d[(o) + 24]), "+f"(d[(o) + 25]), "+f"(d[(o) + 26]), "+f"(d[(o) + 27]), "+f"(d[(o) + 28]), "+f"(d[(o) + 29]), "+f"(d[(o) + 30]), "+f"(d[(o) + 31]), \
    "+f"(d[(o) + 32]), "+f"(d[(o) + 33]), "+f"(d[(o) + 34]), "+f"(d[(o) + 35]), "+f"(d[(o) + 36]), "+f"(d[(o) + 37]), "+f"(d[(o) + 38]), "+f"(d[(o) + 39]), \
    "+f"(d[(o) + 40]), "+f"(d[(o) + 41]), "+f"(d[(o) + 42]), "+f"(d[(o) + 43]), "+f"(d[(o) + 44]), "+f"(d[(o) + 45]), "+f"(d[(o) + 46]), "+f"(d[(o) + 47]), \
    "+f"(d[(o) + 48]), "+f"(d[(o) + 49]), "+f"(d[(o) + 50]), "+f"(d[(o) + 51]), "+f"(d[(o) + 52]), "+f"(d[(o) + 53]), "+f"(d[(o) + 54]), "+f"(d[(o) + 55]), \
    "+f"(d[(o) + 56]), "+f"(d[(o) + 57]), "+f"(d[(o) + 58]), "+f"(d[(o) + 59]), "+f"(d[(o) + 60]), "+f"(d[(o) + 61]), "+f"(d[(o) + 62]), "+f"(d[(o) + 63])
#define MOK_WGMMA_ACC64(d) MOK_WGMMA_ACC64_AT(d, 0)

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T; d holds this thread's 128 accumulators.
// scale_d = 0 overwrites D (first K step), 1 accumulates. kMnMajorA / kMnMajorB select the
// transposed (MN-major) shared-memory layout of each operand.
template <int kMnMajorA = 0, int kMnMajorB = 0>
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b,
                                                      int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MOK_WGMMA_ACC128_REGS ", %128, %129, p, 1, 1, %131, %132;\n}"
      : MOK_WGMMA_ACC128(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kMnMajorA), "n"(kMnMajorB));
}

// D[64 x 256] (+)= A[64 x 32] * B[256 x 32]^T, E4M3 x E4M3 -> fp32, both K-major (full 64-bit
// descriptors; FP8 operands are K-major only). Not used by the kernels: bench/mma_rate.cu's
// comparison with the n128 MMAs they issue.
__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b,
                                                      int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " MOK_WGMMA_ACC128_REGS ", %128, %129, p, 1, 1;\n}"
      : MOK_WGMMA_ACC128(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// An ordering point for the compiler, no instruction: every register of r is read and rewritten
// here, so no read of an MMA's accumulators moves above the wait that completes them (CUTLASS's
// warpgroup_fence_operand).
template <int kN>
__device__ __forceinline__ void wgmma_fence_operands(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, bf16, both operands K-major; d: this thread's 64
// accumulators (the m64nN layout). The ping-pong forward's MMA (kernels/forward/pingpong.cu).
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b,
                                                      int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MOK_WGMMA_ACC64_REGS ", %64, %65, p, 1, 1, 0, 0;\n}"
      : MOK_WGMMA_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, E4M3 x E4M3 -> fp32; D is this thread's 64
// accumulators (the m64nN layout: acc_row / acc_col of kernels/common/persistent.cuh). FP8
// operands are K-major only: 32 K elements are 32 bytes, so advancing a K-major sw128
// descriptor by one instruction adds 2, as for bf16's k16.
// The descriptors are given as their low 32 bits (wgmma_descriptor_sw128_lo): the high word is
// a constant, so a K step adds to 32 bits (no carry: the address field cannot overflow inside
// shared memory) and a descriptor takes one register, not two (the FP8 mainloop runs at the
// register limit).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], std::uint32_t desc_a_lo, std::uint32_t desc_b_lo,
                                                      int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 da, db;\n setp.ne.b32 p, %66, 0;\n"
      " cvt.u64.u32 da, %64;\n or.b64 da, da, %67;\n"
      " cvt.u64.u32 db, %65;\n or.b64 db, db, %67;\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MOK_WGMMA_ACC64_REGS ", da, db, p, 1, 1;\n}"
      : MOK_WGMMA_ACC64(d)
      : "r"(desc_a_lo), "r"(desc_b_lo), "r"(scale_d), "n"(std::uint64_t{kSw128DescriptorHigh} << 32));
}

// The same with A from registers (the RS form): a, this thread's fragment of A[64 x 32], four
// registers of four E4M3 — rows lane / 4 and lane / 4 + 8 of its warp's 16, K bytes (lane % 4) * 4
// of 0-15, then of 16-31 (ldmatrix.x4 over those four 8 x 16-byte matrices; used by
// bench/fp8_tile_rate for timing, its results not checked).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const std::uint32_t (&a)[4],
                                                         std::uint32_t desc_b_lo, int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 db;\n setp.ne.b32 p, %68, 0;\n"
      " cvt.u64.u32 db, %69;\n or.b64 db, db, %70;\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MOK_WGMMA_ACC64_REGS ", {%64, %65, %66, %67}, db, p, 1, 1;\n}"
      : MOK_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "r"(desc_b_lo),
        "n"(std::uint64_t{kSw128DescriptorHigh} << 32));
}

}  // namespace mok::ptx
