// The ring's row copy alone: how many GB/s a few SMs move when they gather rows the way the
// forward's comm CTAs do (row r of the destination = row order[r] of the source), so that
// the number of comm SMs can be chosen from a measurement instead of a guess.
//
//   ring_copy_bench [--tokens T] [--hidden H] [--top-k K] [--iters N]
//
// Variants: `registers` (one warp a row, 4 x 16 B per lane in flight: the dispatch kernel's
// copy, and the first ring copy)
// and `bulk W/S/L/P` (BulkCopyPipe with W warps, S slots, lag L, pieces of P bytes; the
// forward uses bulk 8/6/2/4096). Prints GB/s written (reads are the same bytes) and GB/s
// per SM for 1, 4, 8, 16 CTAs and one CTA per SM.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/ep/ring_copy.cuh"
#include "mok/forward.hpp"
#include "mok/ptx/fence.cuh"
#include "standalone.cuh"

namespace {

using mok::kernels::BulkCopyPipe;
using mok::kernels::warp_copy_row;

// What wait_barrier needs to report a timeout.
struct WaitParams {
  struct {
    int* abort;
  } counters;
  mok::KernelStatus* status;
  long long timeout_ns;
};

struct Copy {
  const std::uint16_t* src;  // [tokens, H]
  std::uint16_t* dst;        // [rows, H]
  const int* order;          // [rows]: source row of each destination row
  int rows, hidden;
};

__global__ void __launch_bounds__(384) copy_registers(const Copy c) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int vectors = c.hidden / 8;
  for (int r = blockIdx.x * warps + warp; r < c.rows; r += gridDim.x * warps) {
    warp_copy_row(reinterpret_cast<uint4*>(c.dst + static_cast<std::int64_t>(r) * c.hidden),
                  reinterpret_cast<const uint4*>(c.src + static_cast<std::int64_t>(c.order[r]) * c.hidden), vectors, lane);
  }
}

template <int kWarps, int kSlots, int kLag, int kPiece>
constexpr std::size_t bulk_smem_bytes() {
  return std::size_t(kWarps) * kSlots * (kPiece + sizeof(std::uint64_t) + sizeof(void*) + sizeof(int));
}

template <int kWarps, int kSlots, int kLag, int kPiece>
__global__ void __launch_bounds__(384) copy_bulk(const Copy c, const WaitParams p) {
  extern __shared__ __align__(1024) std::uint8_t smem[];
  constexpr int kSlotsAll = kWarps * kSlots;
  std::uint8_t* staging = smem;
  auto* loaded = reinterpret_cast<std::uint64_t*>(smem + std::size_t(kSlotsAll) * kPiece);
  auto* dst = reinterpret_cast<std::uint16_t**>(loaded + kSlotsAll);
  auto* bytes = reinterpret_cast<int*>(dst + kSlotsAll);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlotsAll; ++i) mok::ptx::mbarrier_init(&loaded[i], 1);
    mok::ptx::fence_proxy_async_shared_cta();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= kWarps) return;
  const int worker = blockIdx.x * kWarps + warp, workers = gridDim.x * kWarps, row_bytes = c.hidden * 2;
  BulkCopyPipe<kSlots, kLag, kPiece> pipe{staging + std::size_t(warp) * kSlots * kPiece, &loaded[warp * kSlots],
                                          &dst[warp * kSlots], &bytes[warp * kSlots]};
  int source_of_lane = 0;
  for (int i = 0, r = worker; r < c.rows; ++i, r += workers) {
    if (i % 32 == 0) {  // as the forward: the next 32 rows' sources, one load per lane
      const int mine = r + lane * workers;
      source_of_lane = mine < c.rows ? c.order[mine] : 0;
    }
    const int source = __shfl_sync(0xffffffffu, source_of_lane, i % 32);
    if (lane == 0) {
      const std::uint16_t* s = c.src + static_cast<std::int64_t>(source) * c.hidden;
      std::uint16_t* d = c.dst + static_cast<std::int64_t>(r) * c.hidden;
      for (int b = 0; b < row_bytes; b += kPiece) pipe.copy(p, d + b / 2, s + b / 2, min(kPiece, row_bytes - b), r, mok::WaitSite::forward_copy);
    }
  }
  if (lane == 0) pipe.drain(p, -1, mok::WaitSite::forward_copy);
}

struct Variant {
  std::string name;
  std::function<void(const Copy&, const WaitParams&, int ctas)> launch;
};

template <int kWarps, int kSlots, int kLag, int kPiece>
Variant bulk_variant() {
  constexpr std::size_t smem = bulk_smem_bytes<kWarps, kSlots, kLag, kPiece>();
  static_assert(smem <= 232448 - 1024);
  CUDA_OK(cudaFuncSetAttribute(copy_bulk<kWarps, kSlots, kLag, kPiece>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem)));
  return {"bulk " + std::to_string(kWarps) + "/" + std::to_string(kSlots) + "/" + std::to_string(kLag) + "/" +
              std::to_string(kPiece),
          [](const Copy& c, const WaitParams& p, int ctas) {
            copy_bulk<kWarps, kSlots, kLag, kPiece><<<ctas, 384, smem>>>(c, p);
          }};
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 16384, hidden = 2048, top_k = 8, iters = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ring_copy_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::stoi(argv[++i]);
    };
    if (a == "--tokens") tokens = next();
    else if (a == "--hidden") hidden = next();
    else if (a == "--top-k") top_k = next();
    else if (a == "--iters") iters = next();
    else {
      std::printf("usage: ring_copy_bench [--tokens T] [--hidden H] [--top-k K] [--iters N]\n");
      return 2;
    }
  }
  if (hidden % 8 != 0 || tokens < 1 || top_k < 1 || iters < 1) {
    std::fprintf(stderr, "ring_copy_bench: hidden must be a multiple of 8, the rest positive\n");
    return 2;
  }
  cudaDeviceProp prop{};
  if (!hopper_gpu("ring_copy_bench", prop)) return 1;  // (bulk copies are sm_90)
  const int sms = prop.multiProcessorCount;
  const int rows = tokens * top_k;
  std::vector<int> order(rows);
  std::mt19937 rng(1);
  for (int& o : order) o = static_cast<int>(rng() % tokens);  // a random gather, like the plan's order
  Copy c{};
  c.rows = rows, c.hidden = hidden;
  std::uint16_t *src, *dst;
  int* order_d;
  CUDA_OK(cudaMalloc(&src, std::size_t(tokens) * hidden * 2));
  CUDA_OK(cudaMalloc(&dst, std::size_t(rows) * hidden * 2));
  CUDA_OK(cudaMalloc(&order_d, sizeof(int) * rows));
  std::vector<std::uint16_t> source(std::size_t(tokens) * hidden);  // element (t, i) = t * 31 + i (mod 2^16)
  for (std::size_t e = 0; e < source.size(); ++e) source[e] = static_cast<std::uint16_t>((e / hidden) * 31 + e % hidden);
  CUDA_OK(cudaMemcpy(src, source.data(), source.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(order_d, order.data(), sizeof(int) * rows, cudaMemcpyHostToDevice));
  c.src = src, c.dst = dst, c.order = order_d;
  WaitParams p{};
  mok::KernelStatus* status;
  CUDA_OK(cudaMallocManaged(&status, sizeof(mok::KernelStatus)));
  CUDA_OK(cudaMalloc(&p.counters.abort, sizeof(int)));
  CUDA_OK(cudaMemset(p.counters.abort, 0, sizeof(int)));
  p.status = status, p.timeout_ns = 10'000'000'000LL;

  std::vector<Variant> variants{
      {"registers", [](const Copy& c, const WaitParams&, int ctas) { copy_registers<<<ctas, 384>>>(c); }},
      bulk_variant<8, 6, 2, 4096>(),   // the forward's
      bulk_variant<8, 6, 1, 4096>(),
      bulk_variant<12, 4, 1, 4096>(),
      bulk_variant<4, 12, 4, 4096>(),
      bulk_variant<8, 3, 1, 8192>(),
      bulk_variant<12, 8, 3, 2048>(),
  };
  const std::vector<int> cta_counts{1, 4, 8, 16, sms};
  const double gbytes = double(rows) * hidden * 2 / 1e9;
  std::printf("gather of %d rows x %d bf16 (%.2f GB written) on %d SMs; GB/s written (GB/s per SM)\n", rows, hidden,
              gbytes, sms);
  std::printf("%-20s", "variant \\ CTAs");
  for (int n : cta_counts) std::printf(" %18d", n);
  std::printf("\n");
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (const Variant& v : variants) {
    std::printf("%-20s", v.name.c_str());
    for (int n : cta_counts) {
      v.launch(c, p, n);  // warm-up
      CUDA_OK(cudaGetLastError());
      std::vector<float> ms(iters);
      for (float& m : ms) {
        CUDA_OK(cudaMemset(dst, 0, std::size_t(rows) * hidden * 2));
        CUDA_OK(cudaEventRecord(start));
        v.launch(c, p, n);
        CUDA_OK(cudaEventRecord(stop));
        CUDA_OK(cudaEventSynchronize(stop));
        CUDA_OK(cudaEventElapsedTime(&m, start, stop));
      }
      std::sort(ms.begin(), ms.end());
      const double gbs = gbytes / (ms[iters / 2] / 1e3);
      std::printf(" %9.0f (%6.1f)", gbs, gbs / n);
      std::fflush(stdout);
    }
    // The copy must be exact: every row against its source row.
    std::vector<std::uint16_t> out(std::size_t(rows) * hidden);
    CUDA_OK(cudaMemcpy(out.data(), dst, out.size() * 2, cudaMemcpyDeviceToHost));
    for (int r = 0; r < rows; ++r) {
      if (!std::equal(out.begin() + std::size_t(r) * hidden, out.begin() + std::size_t(r + 1) * hidden,
                      source.begin() + std::size_t(order[r]) * hidden)) {
        std::fprintf(stderr, "\nring_copy_bench: %s copied row %d wrong\n", v.name.c_str(), r);
        return 1;
      }
    }
    std::printf("\n");
  }
  if (status->code != mok::KernelStatus::ok) {
    std::fprintf(stderr, "ring_copy_bench: a copy timed out\n");
    return 1;
  }
  return 0;
}
