// Which side of the L2 each SM reads near, measured (bench/l2_sides.cu is the standalone probe
// with its full printout): for the timing variant MOK_DIAG_SIDE_RANKS, which numbers the CTAs of
// a persistent launch side by side so that tasks adjacent in the task order share L2 lines
// (bench/NOTES.md, "the long-K dx tiles' sharing").
#include "kernels/common/sm_sides.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>

namespace mok::kernels {
namespace {

constexpr int kLineWords = 32;  // 128 bytes of std::uint32_t

// On SM `target` only (one thread): `steps` dependent loads along the chain (L2, not L1); the
// cycles into out[0] when timed, and 1 into out[1] (the SM had a CTA).
__global__ void side_walk(const std::uint32_t* chain, int steps, int target, bool timed, long long* out) {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  if (threadIdx.x != 0 || static_cast<int>(id) != target) return;
  std::uint32_t i = 0;
  const long long t0 = clock64();
  for (int s = 0; s < steps; ++s) i = __ldcg(chain + static_cast<std::size_t>(i) * kLineWords);
  const long long t1 = clock64();
  if (timed) out[0] = t1 - t0;
  out[1] = i == 0xffffffffu ? 2 : 1;  // (stored whether timed or not: else the untimed walk is dead code)
}

std::vector<int> measure() {
  // (Nothing else may run meanwhile: the walks need every SM to themselves, one CTA each.)
  if (cudaDeviceSynchronize() != cudaSuccess) return {};
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) return {};
  const int sms = prop.multiProcessorCount, smem = static_cast<int>(prop.sharedMemPerBlockOptin), lines = 2048;
  if (cudaFuncSetAttribute(side_walk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return {};
  std::vector<std::uint32_t> chain(static_cast<std::size_t>(lines) * kLineWords, 0), order(lines);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin() + 1, order.end(), std::mt19937(7));
  for (int i = 0; i < lines; ++i) chain[static_cast<std::size_t>(order[i]) * kLineWords] = order[(i + 1) % lines];
  std::uint32_t* d_chain = nullptr;
  long long* d_out = nullptr;
  void* d_flush = nullptr;
  const std::size_t flush_bytes = std::size_t{128} << 20;
  std::vector<int> rank;
  if (cudaMalloc(&d_chain, chain.size() * 4) == cudaSuccess && cudaMalloc(&d_out, 16) == cudaSuccess &&
      cudaMalloc(&d_flush, flush_bytes) == cudaSuccess &&
      cudaMemcpy(d_chain, chain.data(), chain.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess) {
    // Cycles a load on SM `reader` after SM `writer` walked the chain (writer < 0: after the flush alone).
    const auto latency = [&](int writer, int reader) {
      long long best = -1;
      for (int r = 0; r < 2; ++r) {
        cudaMemset(d_flush, r, flush_bytes);
        if (writer >= 0) side_walk<<<sms, 128, smem>>>(d_chain, lines, writer, false, d_out);
        cudaMemset(d_out, 0, 16);
        side_walk<<<sms, 128, smem>>>(d_chain, lines, reader, true, d_out);
        long long out[2] = {0, 0};
        if (cudaMemcpy(out, d_out, 16, cudaMemcpyDeviceToHost) != cudaSuccess || out[1] != 1) return -1.0;
        best = best < 0 ? out[0] : std::min(best, out[0]);
      }
      return static_cast<double>(best) / lines;
    };
    const double own = latency(0, 0), dram = latency(-1, 0), cut = (own + dram) / 2;
    std::vector<int> near, far;
    bool ok = own > 0 && dram > own;
    for (int s = 0; s < sms && ok; ++s) {
      const double l = latency(0, s);
      ok = l > 0;
      (l < cut ? near : far).push_back(s);
    }
    if (ok) {
      rank.assign(sms, 0);
      int next = 0;
      for (int s : near) rank[s] = next++;
      for (int s : far) rank[s] = next++;
      std::fprintf(stderr, "MOK_DIAG_SIDE_RANKS: %zu SMs read SM 0's L2 lines near (own %.0f, DRAM %.0f cycles a load), "
                   "%zu farther; CTAs numbered side by side\n", near.size(), own, dram, far.size());
    }
  }
  cudaFree(d_flush);
  cudaFree(d_out);
  cudaFree(d_chain);
  (void)cudaGetLastError();
  if (rank.empty()) std::fprintf(stderr, "MOK_DIAG_SIDE_RANKS: the measurement failed; CTAs keep blockIdx\n");
  return rank;
}

}  // namespace

const std::vector<int>& l2_side_rank_of_sm() {
  static const std::vector<int> rank = measure();
  return rank;
}

}  // namespace mok::kernels
