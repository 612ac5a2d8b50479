// The forward's combine alone: how many GB/s a given number of CTAs pull when they sum each
// token's k slot rows (and its shared-expert row) into y, the kernel's loop against a loop that
// keeps more bytes in flight. The fused forward's combine runs at ~20 GB/s a CTA (bench/NOTES.md,
// forty-seventh session: 32 of 132 CTAs took the FP8 forward 1.16-1.20x as long), so spreading it
// under GEMM2 would take as much SM-time as it hides. This asks whether a CTA can pull several
// times that before anyone rebuilds the forward around it.
//
//   combine_rate [--tokens T] [--hidden H] [--top-k K] [--shared 0|1] [--iters N] [--json PATH]
//   (defaults: deepseek-v3's forward, T 8192, H 7168, k 8, no shared expert)
//
// Variants, each on 8, 16, 32, 64 CTAs and one CTA per SM, 256 threads a CTA (the fused kernel's
// two consumer warpgroups), tasks of 32 tokens taken round-robin as in the kernel:
//   loop        the kernel's combine_tokens (kernels/common/persistent.cuh): register loads, two
//               column sets and 8 slots a round, each row's address a dependent load;
//   staged D    kernels/common/combine_staged.cuh (the forward's combine in a MOK_DIAG_FWD_STAGED_COMBINE
//               build): each thread copies its own 16-byte columns of the next D units (a unit: one
//               column round of one token, all its rows) into its own part of shared memory with
//               cp.async, D - 1 units ahead, and sums unit u once its group has landed. No thread
//               reads another's bytes, so no barrier; the sums run in the kernel's order (shared
//               row first, then slot j = 0 .. k-1, fp32 fma), so y is bitwise the loop's.
// Prints GB/s moved (slot rows read + shared rows read + y written) and GB/s per CTA; checks every
// variant's y bitwise against the loop's.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/combine_staged.cuh"
#include "kernels/common/persistent.cuh"
#include "mok/bf16.hpp"
#include "mok/ptx/ld_st.cuh"
#include "standalone.cuh"

namespace {

constexpr int kThreads = 256;      // the fused kernel's two consumer warpgroups
constexpr int kTaskTokens = 32;    // kCombineTokens

struct Combine {
  const std::uint16_t* slots;   // [T k, H] bf16, rows in plan order
  const std::uint16_t* shared;  // [T, H] or null
  const std::int32_t* pair_row; // [T k]: the slot row of pair t k + j
  const float* weights;         // [T k]
  std::uint16_t* y;             // [T, H]
  int tokens, hidden, top_k;
};

__global__ void __launch_bounds__(kThreads) combine_loop(const Combine c) {
  const int tasks = (c.tokens + kTaskTokens - 1) / kTaskTokens;
  for (int task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int begin = task * kTaskTokens, end = min(c.tokens, begin + kTaskTokens);
    mok::kernels::combine_tokens<true, false>(begin, end, c.hidden, c.top_k, c.pair_row, nullptr, c.weights, c.slots,
                                              c.shared, c.y, threadIdx.x, kThreads);
  }
}

// The staged combine of kernels/common/combine_staged.cuh (the kernel's, in a MOK_DIAG_FWD_STAGED_COMBINE
// build) over the same round-robin tasks, its staging area the dynamic shared memory.
template <int kDepth>
__global__ void __launch_bounds__(kThreads) combine_staged(const Combine c) {
  extern __shared__ __align__(128) uint4 staging[];
  const int tasks = (c.tokens + kTaskTokens - 1) / kTaskTokens;
  for (int task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int begin = task * kTaskTokens, end = min(c.tokens, begin + kTaskTokens);
    mok::kernels::combine_tokens_staged<kDepth>(begin, end, c.hidden, c.top_k, c.pair_row, c.weights, c.slots, c.shared,
                                                c.y, threadIdx.x, kThreads, staging);
  }
}

struct Variant {
  std::string name;
  int depth;  // 0: the loop
};

template <int kDepth>
void launch_staged(const Combine& c, int ctas, std::size_t smem) {
  combine_staged<kDepth><<<ctas, kThreads, smem>>>(c);
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 8192, hidden = 7168, top_k = 8, shared = 0, iters = 20;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "combine_rate: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--tokens") tokens = std::stoi(value());
    else if (a == "--hidden") hidden = std::stoi(value());
    else if (a == "--top-k") top_k = std::stoi(value());
    else if (a == "--shared") shared = std::stoi(value());
    else if (a == "--iters") iters = std::stoi(value());
    else if (a == "--json") json = value();
    else {
      std::printf("usage: combine_rate [--tokens T] [--hidden H] [--top-k K] [--shared 0|1] [--iters N] [--json PATH]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (tokens <= 0 || hidden <= 0 || hidden % mok::kernels::kStagedColumns != 0 || top_k <= 0 || iters <= 0) {
    std::fprintf(stderr, "combine_rate: hidden must be a positive multiple of 8, the rest positive\n");
    return 2;
  }
  cudaDeviceProp prop{};
  if (!hopper_gpu("combine_rate", prop)) return 1;
  const int sms = prop.multiProcessorCount;
  const std::int64_t pairs = static_cast<std::int64_t>(tokens) * top_k;

  // Inputs: random bf16 rows, a random plan order, weights in (0, 1).
  std::mt19937 rng(20261208);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f), weight(0.0f, 1.0f);
  std::vector<std::uint16_t> slots_h(pairs * hidden), shared_h(shared ? static_cast<std::size_t>(tokens) * hidden : 0);
  for (auto& v : slots_h) v = mok::bf16::from_float(value(rng)).bits;
  for (auto& v : shared_h) v = mok::bf16::from_float(value(rng)).bits;
  std::vector<std::int32_t> pair_row_h(pairs);
  std::iota(pair_row_h.begin(), pair_row_h.end(), 0);
  std::shuffle(pair_row_h.begin(), pair_row_h.end(), rng);
  std::vector<float> weights_h(pairs);
  for (auto& w : weights_h) w = weight(rng);

  std::uint16_t *slots, *shared_rows = nullptr, *y;
  std::int32_t* pair_row;
  float* weights;
  CUDA_OK(cudaMalloc(&slots, slots_h.size() * 2));
  CUDA_OK(cudaMemcpy(slots, slots_h.data(), slots_h.size() * 2, cudaMemcpyHostToDevice));
  if (shared) {
    CUDA_OK(cudaMalloc(&shared_rows, shared_h.size() * 2));
    CUDA_OK(cudaMemcpy(shared_rows, shared_h.data(), shared_h.size() * 2, cudaMemcpyHostToDevice));
  }
  CUDA_OK(cudaMalloc(&pair_row, pairs * 4));
  CUDA_OK(cudaMemcpy(pair_row, pair_row_h.data(), pairs * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMalloc(&weights, pairs * 4));
  CUDA_OK(cudaMemcpy(weights, weights_h.data(), pairs * 4, cudaMemcpyHostToDevice));
  const std::size_t y_bytes = static_cast<std::size_t>(tokens) * hidden * 2;
  CUDA_OK(cudaMalloc(&y, y_bytes));
  const Combine c{slots, shared_rows, pair_row, weights, y, tokens, hidden, top_k};

  const std::size_t unit_bytes = mok::kernels::staged_unit_bytes(top_k, shared != 0, kThreads);
  const std::vector<Variant> all = {{"loop", 0}, {"staged 2", 2}, {"staged 4", 4}, {"staged 6", 6}, {"staged 8", 8}};
  std::vector<Variant> variants;
  for (const Variant& v : all) {
    const std::size_t smem = v.depth * unit_bytes;
    if (smem > static_cast<std::size_t>(prop.sharedMemPerBlockOptin)) {
      std::printf("(%s left out: %zu bytes of shared memory, over the %zu a CTA may have)\n", v.name.c_str(), smem,
                  static_cast<std::size_t>(prop.sharedMemPerBlockOptin));
      continue;
    }
    variants.push_back(v);
  }
  CUDA_OK(cudaFuncSetAttribute(combine_staged<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, prop.sharedMemPerBlockOptin));
  CUDA_OK(cudaFuncSetAttribute(combine_staged<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, prop.sharedMemPerBlockOptin));
  CUDA_OK(cudaFuncSetAttribute(combine_staged<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, prop.sharedMemPerBlockOptin));
  CUDA_OK(cudaFuncSetAttribute(combine_staged<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, prop.sharedMemPerBlockOptin));

  auto run = [&](const Variant& v, int ctas) {
    if (v.depth == 0) combine_loop<<<ctas, kThreads>>>(c);
    else if (v.depth == 2) launch_staged<2>(c, ctas, 2 * unit_bytes);
    else if (v.depth == 4) launch_staged<4>(c, ctas, 4 * unit_bytes);
    else if (v.depth == 6) launch_staged<6>(c, ctas, 6 * unit_bytes);
    else launch_staged<8>(c, ctas, 8 * unit_bytes);
  };
  const double bytes = static_cast<double>(pairs) * hidden * 2 + (shared ? 2.0 : 1.0) * y_bytes;
  std::vector<int> cta_counts;
  for (int n : {8, 16, 32, 64}) if (n < sms) cta_counts.push_back(n);
  cta_counts.push_back(sms);

  std::printf("combine of %d tokens x k %d x H %d%s (%.2f GB moved) on %s, %d SMs; GB/s (GB/s per CTA), median of %d\n",
              tokens, top_k, hidden, shared ? " + shared rows" : "", bytes / 1e9, prop.name, sms, iters);
  std::printf("%-12s", "variant");
  for (int n : cta_counts) std::printf(" %17d", n);
  std::printf("\n");
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::vector<std::uint16_t> reference(static_cast<std::size_t>(tokens) * hidden), got(reference.size());
  std::string records;
  bool all_equal = true;
  for (const Variant& v : variants) {
    std::printf("%-12s", v.name.c_str());
    for (int n : cta_counts) {
      CUDA_OK(cudaMemset(y, 0xff, y_bytes));  // (poisoned: a column left unwritten shows)
      run(v, n);
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaDeviceSynchronize());
      auto& out = (v.depth == 0 && n == cta_counts.front()) ? reference : got;
      CUDA_OK(cudaMemcpy(out.data(), y, y_bytes, cudaMemcpyDeviceToHost));
      const bool equal = &out == &reference || out == reference;
      all_equal = all_equal && equal;
      std::vector<float> ms(iters);
      for (int i = 0; i < iters; ++i) {
        CUDA_OK(cudaEventRecord(start));
        run(v, n);
        CUDA_OK(cudaEventRecord(stop));
        CUDA_OK(cudaEventSynchronize(stop));
        CUDA_OK(cudaEventElapsedTime(&ms[i], start, stop));
      }
      std::sort(ms.begin(), ms.end());
      const double median = ms[iters / 2], gbs = bytes / (median * 1e-3) / 1e9;
      std::printf(" %8.0f (%5.1f)%s", gbs, gbs / n, equal ? "  " : " !");
      char record[256];
      std::snprintf(record, sizeof record,
                    "%s    {\"variant\": \"%s\", \"ctas\": %d, \"median_ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f, "
                    "\"gb_per_s\": %.1f, \"bitwise_equal\": %s}",
                    records.empty() ? "" : ",\n", v.name.c_str(), n, median, ms.front(), ms.back(), gbs,
                    equal ? "true" : "false");
      records += record;
    }
    std::printf("\n");
  }
  std::printf("y bitwise equal to the loop's on every variant and CTA count: %s\n", all_equal ? "yes" : "NO (! above)");
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "combine_rate: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\"gpu\": \"%s\", \"sms\": %d, \"tokens\": %d, \"hidden\": %d, \"top_k\": %d, \"shared\": %s, "
                 "\"iters\": %d, \"gb_moved\": %.4f,\n  \"records\": [\n%s\n  ]}\n",
                 prop.name, sms, tokens, hidden, top_k, shared ? "true" : "false", iters, bytes / 1e9, records.c_str());
    std::fclose(f);
  }
  return all_equal ? 0 : 1;
}
