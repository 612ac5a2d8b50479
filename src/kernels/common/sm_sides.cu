// Which SMs read each other's L2 lines near, measured (sm_sides.hpp), for bench/l2_sides.cu,
// which prints it all (bench/NOTES.md, "the long-K dx tiles' sharing" and the eighth session's
// side-ranked CTAs, measured and dropped).
#include "kernels/common/sm_sides.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

namespace mok::kernels {
namespace {

constexpr int kLineWords = 32;                              // 128 bytes of std::uint32_t
constexpr std::size_t kFlushBytes = std::size_t{256} << 20;  // more than any L2

__device__ __forceinline__ int this_sm() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return static_cast<int>(id);
}

// On SM `target` only (one thread): `steps` dependent loads along the chain (L2, not L1); the
// cycles into out[0] when timed, and 1 into out[1] (the SM had a CTA).
__global__ void side_walk(const std::uint32_t* chain, int steps, int target, bool timed, long long* out) {
  if (threadIdx.x != 0 || this_sm() != target) return;
  std::uint32_t i = 0;
  const long long t0 = clock64();
  for (int s = 0; s < steps; ++s) i = __ldcg(chain + static_cast<std::size_t>(i) * kLineWords);
  const long long t1 = clock64();
  if (timed) out[0] = t1 - t0;
  out[1] = i == 0xffffffffu ? 2 : 1;  // (stored whether timed or not: else the untimed walk is dead code)
}

__global__ void record_sm(int* sm_of_block) {
  if (threadIdx.x == 0) sm_of_block[blockIdx.x] = this_sm();
}

}  // namespace

L2LatencyProbe::L2LatencyProbe(int lines) : lines_(lines) {
  int device = 0;
  cudaDeviceProp prop{};
  if (lines < 1 || cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) return;
  sms_ = prop.multiProcessorCount, smem_ = static_cast<int>(prop.sharedMemPerBlockOptin);
  std::vector<std::uint32_t> chain(static_cast<std::size_t>(lines) * kLineWords, 0), order(lines);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin() + 1, order.end(), std::mt19937(7));  // a random cycle through every line, from line 0
  for (int i = 0; i < lines; ++i) chain[static_cast<std::size_t>(order[i]) * kLineWords] = order[(i + 1) % lines];
  ok_ = cudaFuncSetAttribute(side_walk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_) == cudaSuccess &&
        cudaFuncSetAttribute(record_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_) == cudaSuccess &&
        cudaMalloc(&chain_, chain.size() * 4) == cudaSuccess && cudaMalloc(&out_, 16) == cudaSuccess &&
        cudaMalloc(&flush_, kFlushBytes) == cudaSuccess && cudaMalloc(&map_, sms_ * sizeof(int)) == cudaSuccess &&
        cudaMemcpy(chain_, chain.data(), chain.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess;
}

L2LatencyProbe::~L2LatencyProbe() {
  cudaFree(map_);
  cudaFree(flush_);
  cudaFree(out_);
  cudaFree(chain_);
  (void)cudaGetLastError();
}

double L2LatencyProbe::latency(int writer, int reader, int repeats) const {
  long long best = -1;
  for (int r = 0; ok_ && r < repeats; ++r) {
    cudaMemset(flush_, r & 1, kFlushBytes);
    if (writer >= 0) side_walk<<<sms_, 128, smem_>>>(chain_, lines_, writer, false, out_);
    cudaMemset(out_, 0, 16);
    side_walk<<<sms_, 128, smem_>>>(chain_, lines_, reader, true, out_);
    long long out[2] = {0, 0};
    if (cudaMemcpy(out, out_, 16, cudaMemcpyDeviceToHost) != cudaSuccess || out[1] != 1) return -1.0;
    best = best < 0 ? out[0] : std::min(best, out[0]);
  }
  return best < 0 ? -1.0 : static_cast<double>(best) / lines_;
}

std::vector<int> L2LatencyProbe::block_sms() const {
  std::vector<int> map(sms_, -1);
  if (!ok_ || cudaMemset(map_, 0xff, sms_ * sizeof(int)) != cudaSuccess) return {};
  record_sm<<<sms_, 128, smem_>>>(map_);
  if (cudaMemcpy(map.data(), map_, sms_ * sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) return {};
  return map;
}

}  // namespace mok::kernels
