// Which SMs share the L2 lines another SM brought in, and where the CTAs of a persistent launch
// land (bench/NOTES.md: the fused backward's dx tiles share an operand tile through L2 when they
// run on CTAs of adjacent index, much less when they are 16 apart; the H100/H200 L2 is two
// partitions, each caching for the GPCs wired to it — the candidate reason).
//
//   l2_sides [--ref SM[,SM...]] [--lines N] [--repeats R]
//
// 1. The persistent launch's map: one CTA per SM (grid = SM count, shared memory that admits one
//    CTA an SM, as the fused kernels), each CTA records %smid; three launches, printed in blockIdx
//    order, and whether the map was the same each time.
// 2. For each reference SM r (default: 0 and the SM of the last blockIdx): with L2 flushed (a
//    256 MB memset), one thread on SM r walks a random chain of N 128-byte lines (bringing them
//    into L2), then one thread on SM s walks it again, timing each dependent load (ld.global.cg:
//    L2, not L1) — for every SM s in turn, R times (median). A chain walked after the flush alone
//    gives the DRAM latency. SMs whose latency lies near r's own read r's lines from the L2 they
//    share; the rest from farther away.
// Prints the latencies per SM, a histogram (cycles rounded to 20), the sides each reference
// splits the SMs into, and the side of each blockIdx of the persistent launch: whether CTAs of
// adjacent index sit on one side.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    const cudaError_t e_ = (call);                                                                    \
    if (e_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "l2_sides: %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

constexpr int kLineWords = 32;  // 128 bytes of std::uint32_t

__device__ __forceinline__ unsigned smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Every CTA records its SM.
__global__ void record_smid(int* sm_of_block) {
  if (threadIdx.x == 0) sm_of_block[blockIdx.x] = static_cast<int>(smid());
}

// On SM `target` only (one thread): walks `steps` links of the chain from line 0. timed: the
// cycles of the walk and the end index into out[0..1]; ran: 1 into out[2] (that SM had a CTA).
__global__ void walk(const std::uint32_t* chain, int steps, int target, bool timed, long long* out) {
  if (threadIdx.x != 0 || static_cast<int>(smid()) != target) return;
  std::uint32_t i = 0;
  const long long t0 = clock64();
  for (int s = 0; s < steps; ++s) i = __ldcg(chain + static_cast<std::size_t>(i) * kLineWords);
  const long long t1 = clock64();
  if (timed) out[0] = t1 - t0;
  out[1] = i;  // (keeps the walk)
  out[2] = 1;
}

int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return std::atoi(argv[i + 1]);
  return fallback;
}

std::vector<int> arg_list(int argc, char** argv, const char* name) {
  std::vector<int> out;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) {
      std::string s = argv[i + 1];
      for (std::size_t at = 0; at <= s.size();) {
        const std::size_t comma = s.find(',', at);
        out.push_back(std::atoi(s.substr(at, comma - at).c_str()));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int lines = arg_int(argc, argv, "--lines", 16384), repeats = arg_int(argc, argv, "--repeats", 3);
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("l2_sides: %s, %d SMs, L2 %d MB; chain of %d lines (%d KB), %d repeats\n", prop.name, sms,
              prop.l2CacheSize >> 20, lines, lines * 128 / 1024, repeats);

  // One CTA an SM, as the fused kernels: more shared memory than half an SM holds.
  const int smem = static_cast<int>(prop.sharedMemPerBlockOptin);
  CHECK(cudaFuncSetAttribute(record_smid, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(walk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  // 1. The persistent launch's blockIdx -> SM map.
  int* d_map = nullptr;
  CHECK(cudaMalloc(&d_map, sms * sizeof(int)));
  std::vector<int> map(sms), first;
  bool stable = true;
  for (int launch = 0; launch < 3; ++launch) {
    CHECK(cudaMemset(d_map, 0xff, sms * sizeof(int)));
    record_smid<<<sms, 128, smem>>>(d_map);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(map.data(), d_map, sms * sizeof(int), cudaMemcpyDeviceToHost));
    if (launch == 0) first = map;
    else stable = stable && map == first;
  }
  std::vector<int> distinct = first;
  std::sort(distinct.begin(), distinct.end());
  const bool one_each = std::unique(distinct.begin(), distinct.end()) == distinct.end() && distinct.front() >= 0;
  std::printf("\npersistent launch (grid %d, %d B shared): blockIdx -> SM%s%s\n", sms, smem,
              stable ? " (the same in 3 launches)" : " (CHANGED between launches; the first shown)",
              one_each ? "" : " (NOT one CTA an SM)");
  for (int b = 0; b < sms; ++b) std::printf("%4d%s", first[b], (b + 1) % 22 == 0 ? "\n" : "");
  std::printf("\n");

  // 2. Latency of reading lines another SM brought into L2.
  std::vector<std::uint32_t> chain(static_cast<std::size_t>(lines) * kLineWords, 0);
  std::vector<std::uint32_t> order(lines);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin() + 1, order.end(), std::mt19937(7));  // a random cycle through every line, from line 0
  for (int i = 0; i < lines; ++i) chain[static_cast<std::size_t>(order[i]) * kLineWords] = order[(i + 1) % lines];
  std::uint32_t* d_chain = nullptr;
  long long* d_out = nullptr;
  void* d_flush = nullptr;
  const std::size_t flush_bytes = std::size_t{256} << 20;
  CHECK(cudaMalloc(&d_chain, chain.size() * sizeof(std::uint32_t)));
  CHECK(cudaMalloc(&d_out, 3 * sizeof(long long)));
  CHECK(cudaMalloc(&d_flush, flush_bytes));
  CHECK(cudaMemcpy(d_chain, chain.data(), chain.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice));

  // Cycles a load of SM `reader` after SM `writer` walked the chain (writer < 0: after the flush alone).
  const auto latency = [&](int writer, int reader) {
    std::vector<double> got;
    for (int r = 0; r < repeats; ++r) {
      CHECK(cudaMemset(d_flush, r & 1, flush_bytes));
      if (writer >= 0) walk<<<sms, 128, smem>>>(d_chain, lines, writer, false, d_out);
      CHECK(cudaMemset(d_out, 0, 3 * sizeof(long long)));
      walk<<<sms, 128, smem>>>(d_chain, lines, reader, true, d_out);
      CHECK(cudaGetLastError());
      long long out[3];
      CHECK(cudaMemcpy(out, d_out, sizeof(out), cudaMemcpyDeviceToHost));
      if (out[2] != 1) return -1.0;  // no CTA ran on that SM
      got.push_back(static_cast<double>(out[0]) / lines);
    }
    std::sort(got.begin(), got.end());
    return got[got.size() / 2];
  };

  std::vector<int> refs = arg_list(argc, argv, "--ref");
  if (refs.empty()) refs = {first.front(), first.back()};
  const double dram = latency(-1, refs.front());
  std::printf("\nDRAM (after the flush alone, SM %d): %.0f cycles a load\n", refs.front(), dram);
  std::vector<int> all_sms = first;
  std::sort(all_sms.begin(), all_sms.end());
  for (int ref : refs) {
    std::vector<double> lat(sms);
    std::map<int, int> histogram;
    for (int i = 0; i < sms; ++i) {
      lat[i] = latency(ref, all_sms[i]);
      histogram[static_cast<int>(lat[i] / 20.0 + 0.5) * 20]++;
    }
    const double own = latency(ref, ref), cut = (own + dram) / 2;
    std::printf("\nreference SM %d (its own re-read: %.0f cycles; cut between its side and the rest: %.0f)\n", ref, own, cut);
    std::printf("cycles a load, by SM:\n");
    for (int i = 0; i < sms; ++i) std::printf("%4d:%4.0f%s", all_sms[i], lat[i], (i + 1) % 11 == 0 ? "\n" : "  ");
    std::printf("\nhistogram (cycles ~ count):");
    for (const auto& [c, n] : histogram) std::printf("  %d~%d", c, n);
    std::map<int, bool> near;
    int near_count = 0;
    for (int i = 0; i < sms; ++i) near_count += near[all_sms[i]] = lat[i] >= 0 && lat[i] < cut;
    std::printf("\nSMs on SM %d's side: %d of %d\nsides in blockIdx order (N: SM %d's side, F: the other):\n", ref, near_count, sms, ref);
    int runs = 1;
    for (int b = 0; b < sms; ++b) {
      std::printf("%c%s", near[first[b]] ? 'N' : 'F', (b + 1) % 66 == 0 ? "\n" : "");
      if (b > 0 && near[first[b]] != near[first[b - 1]]) ++runs;
    }
    std::printf("\nruns of one side in blockIdx order: %d (adjacent CTAs on one side: %s)\n", runs,
                runs <= 4 ? "mostly" : runs >= sms / 2 ? "alternating" : "mixed");
  }
  CHECK(cudaFree(d_flush));
  CHECK(cudaFree(d_out));
  CHECK(cudaFree(d_chain));
  CHECK(cudaFree(d_map));
  return 0;
}
