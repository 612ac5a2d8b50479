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
#include "mok/ptx/fence.cuh"
#include "mok/ptx/wgmma.cuh"
#include "mok_bench/support.cuh"  // (time_iterations)

namespace {

using namespace mok::ptx;

enum class Kind : int { bf16_n256, bf16_n256_skewed, bf16_n256_ordered, bf16_n128, e4m3_n128, e4m3_n256, e4m3_n128_promoted, e4m3_n128_skewed, e4m3_n128_overlapped, e4m3_n128_promoted64 };

const char* name(Kind k) {
  switch (k) {
    case Kind::bf16_n256: return "bf16 m64n256k16";
    case Kind::bf16_n128: return "bf16 m64n128k16";
    case Kind::e4m3_n128: return "e4m3 m64n128k32";
    case Kind::e4m3_n256: return "e4m3 m64n256k32";
    case Kind::bf16_n256_skewed: return "bf16 m64n256k16 skewed";
    case Kind::bf16_n256_ordered: return "bf16 m64n256k16 ordered";
    case Kind::e4m3_n128_promoted: return "e4m3 m64n128k32 promoted";
    case Kind::e4m3_n128_skewed: return "e4m3 m64n128k32 skewed";
    case Kind::e4m3_n128_promoted64: return "e4m3 m64n128k32 promoted 64";
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
  if constexpr (K != Kind::e4m3_n128_promoted && K != Kind::e4m3_n128_skewed && K != Kind::e4m3_n128_overlapped &&
                K != Kind::e4m3_n128_promoted64) {
    // (skewed: warpgroup 1 starts once warpgroup 0 has issued its first batch; ordered: every
    // batch of warpgroup 1 waits until warpgroup 0 has issued its batch of that iteration — so the
    // tensor cores take each warpgroup's four MMAs back to back, not the two interleaved)
    constexpr bool kN256 = K == Kind::bf16_n256 || K == Kind::bf16_n256_skewed || K == Kind::bf16_n256_ordered;
    constexpr int kAcc = kN256 || K == Kind::e4m3_n256 ? 128 : 64;
    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;  // (indexed: range-for loops here made ptxas serialize the n256 MMAs)
    const std::uint32_t la = static_cast<std::uint32_t>(da), lb = static_cast<std::uint32_t>(db);
    if (K == Kind::bf16_n256_skewed && wg == 1) mok::ptx::named_barrier_sync(1, 256);
    for (int it = 0; it < iters; ++it) {
      if (K == Kind::bf16_n256_ordered && wg == 1) mok::ptx::named_barrier_sync(1 + it % 2, 256);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (kN256) wgmma_m64n256k16_bf16(acc, da + 2 * kk, db + 2 * kk, 1);
        else if constexpr (K == Kind::e4m3_n256) wgmma_m64n256k32_e4m3(acc, da + 2 * kk, db + 2 * kk, 1);
        else if constexpr (K == Kind::bf16_n128) wgmma_m64n128k16_bf16(acc, da + 2 * kk, db + 2 * kk, 1);
        else wgmma_m64n128k32_e4m3(acc, la + 2 * kk, lb + 2 * kk, 1);
      }
      wgmma_commit_group();
      if (K == Kind::bf16_n256_skewed && wg == 0 && it == 0) mok::ptx::named_barrier_arrive(1, 256);
      if (K == Kind::bf16_n256_ordered && wg == 0) mok::ptx::named_barrier_arrive(1 + it % 2, 256);
      wgmma_wait_group<1>();
    }
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) out += acc[i];
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
  } else if constexpr (K == Kind::e4m3_n128_promoted64) {
    // promoted on a 64 x 128 warpgroup tile (one block accumulator beside acc: 128 registers, so
    // three consumer warpgroups fit an SM): per 128-K block four MMAs into block, wait_group 0,
    // acc += block * scale. With three warpgroups, two may keep the tensor cores busy while the
    // third promotes.
    float acc[64], block[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const std::uint32_t la = static_cast<std::uint32_t>(da), lb = static_cast<std::uint32_t>(db);
    const float scale = 1.0f + 1e-7f * threadIdx.x;
    for (int it = 0; it < iters; ++it) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(block, la + 2 * kk, lb + 2 * kk, kk != 0);
      wgmma_commit_group();
      wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = fmaf(block[i], scale, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) out += acc[i];
  } else {  // promoted: per 128-K block and N half, four MMAs into block, then acc += block * scale
    // (skewed: warpgroup 1 starts once warpgroup 0's first half is complete, so that, if the
    // tensor cores take the two warpgroups' MMAs in issue order, each promotes while the
    // other's MMAs run; nothing keeps them apart after that)
    float acc[128], block[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    const std::uint32_t la = static_cast<std::uint32_t>(da), lb = static_cast<std::uint32_t>(db);
    const float scale = 1.0f + 1e-7f * threadIdx.x;
    if (K == Kind::e4m3_n128_skewed && wg == 1) mok::ptx::named_barrier_sync(1, 256);
    for (int it = 0; it < iters; it += 2) {  // (two halves: iters counts K steps of one N half's four MMAs)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(block, la + 2 * kk, lb + half * 128 * 128 / 16 + 2 * kk, kk != 0);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        if (K == Kind::e4m3_n128_skewed && wg == 0 && it == 0 && half == 0) mok::ptx::named_barrier_arrive(1, 256);
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
    case Kind::bf16_n256:
    case Kind::bf16_n256_skewed:
    case Kind::bf16_n256_ordered: return 2.0 * 64 * 256 * 64;
    case Kind::bf16_n128: return 2.0 * 64 * 128 * 64;
    case Kind::e4m3_n128: return 2.0 * 64 * 128 * 128;
    case Kind::e4m3_n256: return 2.0 * 64 * 256 * 128;
    default: return 2.0 * 64 * 128 * 128;  // one N half's (one tile's) 128-K block
  }
}

template <Kind K, int kWarpgroups>
void run(int iters, int repeats, int sms, float* sink) {
  auto kernel = mma_kernel<K, kWarpgroups>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLaunchSmem);
  // (the warm-up launch brings the clocks up; the L2 flush before each repeat changes nothing here)
  const std::vector<float> ms = mok_bench::time_iterations(
      1, repeats, nullptr, [&] { kernel<<<sms, 128 * kWarpgroups, kLaunchSmem>>>(iters, sink); });
  const double tflop = flops_per_iter<K>() * iters * kWarpgroups * sms / 1e12;  // (ms: ascending)
  std::printf("%-28s %d warpgroup(s)  %7.1f TFLOP/s  [%.1f, %.1f]\n", name(K), kWarpgroups,
              tflop / (ms[ms.size() / 2] * 1e-3), tflop / (ms.back() * 1e-3), tflop / (ms.front() * 1e-3));
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
  try {  // (time_iterations throws mok::Error on a CUDA error)
    run<Kind::bf16_n256, 1>(iters, repeats, sms, sink);
    run<Kind::bf16_n256, 2>(iters, repeats, sms, sink);
    run<Kind::bf16_n256, 3>(iters, repeats, sms, sink);
    run<Kind::bf16_n256_skewed, 2>(iters, repeats, sms, sink);
    run<Kind::bf16_n256_ordered, 2>(iters, repeats, sms, sink);
    run<Kind::bf16_n128, 1>(iters, repeats, sms, sink);
    run<Kind::bf16_n128, 2>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128, 1>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128, 2>(iters, repeats, sms, sink);
    run<Kind::e4m3_n256, 1>(iters, repeats, sms, sink);
    run<Kind::e4m3_n256, 2>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_promoted, 1>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_promoted, 2>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_skewed, 2>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_promoted64, 1>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_promoted64, 2>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_promoted64, 3>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_overlapped, 1>(iters, repeats, sms, sink);
    run<Kind::e4m3_n128_overlapped, 2>(iters, repeats, sms, sink);
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "mma_rate: %s\n", e.what());
    return 1;
  }
  cudaFree(sink);
  return 0;
}
