// The tensor cores' rate from shared memory alone, per kind of MMA and number of warpgroups
// issuing it (bench/NOTES.md, eleventh session): no loads, no epilogues, one CTA an SM, every SM.
// What the kernels' structure can reach at most: whether one warpgroup alone keeps the tensor
// cores busy (the ping-pong forward, the padding skip), what the FP8 mainloop's promotion costs
// by itself, and what an n256 FP8 MMA would gain over the two n128 halves the FP8 kernels issue.
//
// "overlapped": a 64 x 128 warpgroup tile with two block accumulators, each 128-K block's MMAs
// issued into one while the other (the previous block's) is promoted (the redesign issue 19's
// promotion needs: MMAs in flight while the warpgroup promotes).
//
//   mma_rate [--iters N] [--repeats R]
//
// Each warpgroup multiplies the same swizzled tiles over and over (values pseudo-random, so the
// power drawn is a real GEMM's): K steps of four MMAs (bf16 k16 or e4m3 k32: 64 or 128 of K),
// committed as a group, waiting for the previous group (wait_group 1), as the kernels' mainloop
// does. "promoted": the FP8 kernels' pattern, per 128-K block and per N half of 128 columns, four
// MMAs into a block accumulator, wait_group 0, then acc += block * scale (64 FFMA a thread).
// Prints TFLOP/s (median of the repeats) per case; the FLOPs are the MMAs' (2 x M x N x K).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mok/ptx/common.cuh"
#include "mok/ptx/wgmma.cuh"

namespace {

using namespace mok::ptx;

// D[64 x 256] (+)= A[64 x 32] * B[256 x 32]^T, E4M3 -> fp32, both K-major (sw128 descriptors).
__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b,
                                                      int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// An ordering point for the compiler: the registers are read and rewritten here (no instruction).
template <int kN>
__device__ __forceinline__ void fence_operands(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

enum class Kind : int { bf16_n256, bf16_n128, e4m3_n128, e4m3_n256, e4m3_n128_promoted, e4m3_n128_overlapped };

const char* name(Kind k) {
  switch (k) {
    case Kind::bf16_n256: return "bf16 m64n256k16";
    case Kind::bf16_n128: return "bf16 m64n128k16";
    case Kind::e4m3_n128: return "e4m3 m64n128k32";
    case Kind::e4m3_n256: return "e4m3 m64n256k32";
    case Kind::e4m3_n128_promoted: return "e4m3 m64n128k32 promoted";
    default: return "e4m3 m64n128k32 overlapped";
  }
}

// Shared memory: per warpgroup its own A (64 rows x 128 bytes), one B of 256 rows x 128 bytes
// that every warpgroup reads (as both of the kernels' consumer warpgroups read one stage's B).
constexpr int kA = 64 * 128, kB = 256 * 128, kMaxWarpgroups = 3;
constexpr int kSmem = kMaxWarpgroups * kA + kB + 1024;
// Forces one CTA an SM (the kernels' occupancy) whatever the warpgroup count.
constexpr int kLaunchSmem = 200 * 1024;

template <Kind K, int kWarpgroups>
__global__ void __launch_bounds__(128 * kWarpgroups, 1) mma_kernel(int iters, float* sink) {
  extern __shared__ std::uint8_t raw[];
  std::uint8_t* base = reinterpret_cast<std::uint8_t*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) & ~std::uintptr_t{1023});
  // Pseudo-random bytes everywhere (finite bf16 and e4m3 values: the exponent bits kept small).
  for (int i = threadIdx.x; i < (kSmem - 1024) / 4; i += blockDim.x) {
    std::uint32_t v = (i + 1) * 2654435761u ^ (blockIdx.x * 40503u);
    v ^= v >> 13;
    reinterpret_cast<std::uint32_t*>(base)[i] = v & 0x3f3f3f3fu;
  }
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const std::uint8_t* a = base + wg * kA;
  const std::uint8_t* b = base + kMaxWarpgroups * kA;
  const std::uint64_t da = wgmma_descriptor_sw128(a), db = wgmma_descriptor_sw128(b);
  float out = 0.0f;
  if constexpr (K == Kind::bf16_n256 || K == Kind::e4m3_n256) {
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int it = 0; it < iters; ++it) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (K == Kind::bf16_n256) wgmma_m64n256k16_bf16(acc, da + 2 * kk, db + 2 * kk, 1);
        else wgmma_m64n256k32_e4m3(acc, da + 2 * kk, db + 2 * kk, 1);
      }
      wgmma_commit_group();
      wgmma_wait_group<1>();
    }
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) out += acc[i];
  } else if constexpr (K == Kind::bf16_n128 || K == Kind::e4m3_n128) {
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const std::uint32_t la = static_cast<std::uint32_t>(da), lb = static_cast<std::uint32_t>(db);
    for (int it = 0; it < iters; ++it) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (K == Kind::bf16_n128) wgmma_m64n128k16_bf16(acc, da + 2 * kk, db + 2 * kk, 1);
        else wgmma_m64n128k32_e4m3(acc, la + 2 * kk, lb + 2 * kk, 1);
      }
      wgmma_commit_group();
      wgmma_wait_group<1>();
    }
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) out += acc[i];
  } else if constexpr (K == Kind::e4m3_n128_overlapped) {
    // Eight 128-K blocks a loop iteration, straight-line: block b's MMAs are issued into one
    // accumulator, then the previous block's (now complete: wait_group 1) is promoted from the
    // other; the iteration ends with wait_group 0 and the last promotion (a loop back-edge with
    // MMAs in flight made ptxas serialize every wgmma, C7514).
    float acc[64], block0[64], block1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const std::uint32_t la = static_cast<std::uint32_t>(da), lb = static_cast<std::uint32_t>(db);
    const float scale = 1.0f + 1e-7f * threadIdx.x;
    const auto issue = [&](float (&block)[64]) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(block, la + 2 * kk, lb + 2 * kk, kk != 0);
      wgmma_commit_group();
    };
    const auto promote = [&](float (&block)[64]) {
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = fmaf(block[i], scale, acc[i]);
    };
    for (int it = 0; it < iters; it += 8) {  // (iters: 128-K blocks)
      issue(block0);
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        issue(block1);
        wgmma_wait_group<1>();
        promote(block0);
        issue(block0);
        wgmma_wait_group<1>();
        promote(block1);
      }
      issue(block1);
      wgmma_wait_group<1>();
      promote(block0);
      wgmma_wait_group<0>();
      promote(block1);
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) out += acc[i];
  } else {  // promoted: per 128-K block and N half, four MMAs into block, then acc += block * scale
    float acc[128], block[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    const std::uint32_t la = static_cast<std::uint32_t>(da), lb = static_cast<std::uint32_t>(db);
    const float scale = 1.0f + 1e-7f * threadIdx.x;
    for (int it = 0; it < iters; it += 2) {  // (two halves: iters counts K steps of one N half's four MMAs)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(block, la + 2 * kk, lb + half * 128 * 128 / 16 + 2 * kk, kk != 0);
        wgmma_commit_group();
        wgmma_wait_group<0>();
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[64 * half + i] = fmaf(block[i], scale, acc[64 * half + i]);
      }
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) out += acc[i];
  }
  if (out == 12345.678f) sink[blockIdx.x] = out;  // (keeps the work; never true in practice)
}

template <Kind K>
double flops_per_iter() {
  switch (K) {
    case Kind::bf16_n256: return 2.0 * 64 * 256 * 64;
    case Kind::bf16_n128: return 2.0 * 64 * 128 * 64;
    case Kind::e4m3_n128: return 2.0 * 64 * 128 * 128;
    case Kind::e4m3_n256: return 2.0 * 64 * 256 * 128;
    default: return 2.0 * 64 * 128 * 128;  // one N half's (one tile's) 128-K block
  }
}

template <Kind K, int kWarpgroups>
void run(int iters, int repeats, int sms, float* sink) {
  constexpr int warpgroups = kWarpgroups;
  auto kernel = mma_kernel<K, kWarpgroups>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLaunchSmem);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  kernel<<<sms, 128 * warpgroups, kLaunchSmem>>>(iters / 4, sink);  // warm-up (clocks up)
  std::vector<double> tflops;
  for (int r = 0; r < repeats; ++r) {
    cudaEventRecord(start);
    kernel<<<sms, 128 * warpgroups, kLaunchSmem>>>(iters, sink);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    tflops.push_back(flops_per_iter<K>() * iters * warpgroups * sms / (ms * 1e-3) / 1e12);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "mma_rate: %s: %s\n", name(K), cudaGetErrorString(err));
    std::exit(1);
  }
  std::sort(tflops.begin(), tflops.end());
  std::printf("%-28s %d warpgroup(s)  %7.1f TFLOP/s  [%.1f, %.1f]\n", name(K), warpgroups, tflops[tflops.size() / 2],
              tflops.front(), tflops.back());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20000, repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: mma_rate [--iters N] [--repeats R]\n");
      return 2;
    }
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  std::printf("# %s, %d SMs, %d K steps a warpgroup, median of %d\n", prop.name, sms, iters, repeats);
  float* sink = nullptr;
  cudaMalloc(&sink, sizeof(float) * sms);
  run<Kind::bf16_n256, 1>(iters, repeats, sms, sink);
  run<Kind::bf16_n256, 2>(iters, repeats, sms, sink);
  run<Kind::bf16_n256, 3>(iters, repeats, sms, sink);
  run<Kind::bf16_n128, 1>(iters, repeats, sms, sink);
  run<Kind::bf16_n128, 2>(iters, repeats, sms, sink);
  run<Kind::e4m3_n128, 1>(iters, repeats, sms, sink);
  run<Kind::e4m3_n128, 2>(iters, repeats, sms, sink);
  run<Kind::e4m3_n256, 1>(iters, repeats, sms, sink);
  run<Kind::e4m3_n256, 2>(iters, repeats, sms, sink);
  run<Kind::e4m3_n128_promoted, 1>(iters, repeats, sms, sink);
  run<Kind::e4m3_n128_promoted, 2>(iters, repeats, sms, sink);
  run<Kind::e4m3_n128_overlapped, 1>(iters, repeats, sms, sink);
  run<Kind::e4m3_n128_overlapped, 2>(iters, repeats, sms, sink);
  cudaFree(sink);
  return 0;
}
