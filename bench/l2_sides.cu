// Which SMs share the L2 lines another SM brought in, and where the CTAs of a persistent launch
// land (bench/NOTES.md: the fused backward's dx tiles share an operand tile through L2 when they
// run on CTAs of adjacent index, much less when they are 16 apart; the H100/H200 L2 is two
// partitions, each caching for the GPCs wired to it — the candidate reason). The measurements are
// the library's (mok::kernels::L2LatencyProbe, kernels/common/sm_sides.cu); this prints them.
//
//   l2_sides [--ref SM[,SM...]] [--lines N] [--repeats R]
//
// 1. The persistent launch's map: one CTA per SM, each recording %smid; three launches, printed
//    in blockIdx order, and whether the map was the same each time.
// 2. For each reference SM r (default: the SMs of the first and the last blockIdx): the cycles a
//    dependent load of every SM s takes walking a random chain of N 128-byte lines that SM r
//    walked right after an L2 flush (the least of R), beside r's own re-read and the chain after
//    the flush alone (DRAM). SMs near r's own latency read r's lines from the L2 they share.
// Prints the latencies per SM, a histogram (cycles rounded to 20), the SMs on r's side and the
// side of each blockIdx of the persistent launch: whether CTAs of adjacent index sit on one side.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "kernels/common/sm_sides.hpp"

namespace {

int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return std::atoi(argv[i + 1]);
  return fallback;
}

std::vector<int> arg_list(int argc, char** argv, const char* name) {
  std::vector<int> out;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) {
      const std::string s = argv[i + 1];
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
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::fprintf(stderr, "l2_sides: no CUDA device\n");
    return 1;
  }
  const mok::kernels::L2LatencyProbe probe(lines);
  if (!probe.ok()) {
    std::fprintf(stderr, "l2_sides: the probe's set-up failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  const int sms = probe.sms();
  std::printf("l2_sides: %s, %d SMs, L2 %d MB; chain of %d lines (%d KB), least of %d\n", prop.name, sms,
              prop.l2CacheSize >> 20, lines, lines * 128 / 1024, repeats);

  // 1. The persistent launch's blockIdx -> SM map.
  const std::vector<int> first = probe.block_sms();
  bool stable = !first.empty();
  for (int launch = 1; launch < 3 && stable; ++launch) stable = probe.block_sms() == first;
  if (first.empty()) {
    std::fprintf(stderr, "l2_sides: recording the SMs failed\n");
    return 1;
  }
  std::vector<int> distinct = first;
  std::sort(distinct.begin(), distinct.end());
  const bool one_each = std::unique(distinct.begin(), distinct.end()) == distinct.end() && distinct.front() >= 0;
  std::printf("\npersistent launch (grid %d, %d B shared): blockIdx -> SM%s%s\n", sms, probe.shared_bytes(),
              stable ? " (the same in 3 launches)" : " (CHANGED between launches; the first shown)",
              one_each ? "" : " (NOT one CTA an SM)");
  for (int b = 0; b < sms; ++b) std::printf("%4d%s", first[b], (b + 1) % 22 == 0 ? "\n" : "");
  std::printf("\n");

  // 2. Latency of reading lines another SM brought into L2.
  std::vector<int> refs = arg_list(argc, argv, "--ref");
  if (refs.empty()) refs = {first.front(), first.back()};
  const double dram = probe.latency(-1, refs.front(), repeats);
  std::printf("\nDRAM (after the flush alone, SM %d): %.0f cycles a load\n", refs.front(), dram);
  for (int ref : refs) {
    std::vector<double> lat(sms);
    std::map<int, int> histogram;
    for (int s = 0; s < sms; ++s) {
      lat[s] = probe.latency(ref, s, repeats);
      histogram[static_cast<int>(lat[s] / 20.0 + 0.5) * 20]++;
    }
    const double own = probe.latency(ref, ref, repeats), cut = mok::kernels::near_far_cut(lat);
    std::printf("\nreference SM %d (its own re-read: %.0f cycles; cut between its side and the rest, the middle of "
                "the widest gap: %.0f)\n", ref, own, cut);
    std::printf("cycles a load, by SM:\n");
    for (int s = 0; s < sms; ++s) std::printf("%4d:%4.0f%s", s, lat[s], (s + 1) % 11 == 0 ? "\n" : "  ");
    std::printf("\nhistogram (cycles ~ count):");
    for (const auto& [c, n] : histogram) std::printf("  %d~%d", c, n);
    std::vector<bool> near(sms);
    int near_count = 0;
    for (int s = 0; s < sms; ++s) {
      near[s] = lat[s] >= 0 && lat[s] < cut;
      near_count += near[s];
    }
    std::printf("\nSMs on SM %d's side: %d of %d\nsides in blockIdx order (N: SM %d's side, F: the other):\n", ref,
                near_count, sms, ref);
    int runs = 1;
    for (int b = 0; b < sms; ++b) {
      std::printf("%c%s", near[first[b]] ? 'N' : 'F', (b + 1) % 66 == 0 ? "\n" : "");
      if (b > 0 && near[first[b]] != near[first[b - 1]]) ++runs;
    }
    std::printf("\nruns of one side in blockIdx order: %d (adjacent CTAs on one side: %s)\n", runs,
                runs <= 4 ? "mostly" : runs >= sms / 2 ? "alternating" : "mixed");
  }
  return 0;
}
