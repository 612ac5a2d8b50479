#include "kernels/ep/exchange.cuh"
#include "kernels/common/load.cuh"
#include "kernels/fp8/quantize_rows.cuh"

#include <cstdint>

#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"

namespace mok::kernels {
namespace {

constexpr int kCtasPerRank = 16;

__global__ void __launch_bounds__(256) exchange_kernel(const ExchangeParams p) {
  const int local = blockIdx.x / kCtasPerRank, cta = blockIdx.x % kCtasPerRank;
  const int rank = p.first_rank + local;
  const std::int64_t n = p.pairs_per_rank;
  __shared__ int sent[kMaxEpRanks];  // rows this block's ids send to each rank
  if (threadIdx.x < kMaxEpRanks) sent[threadIdx.x] = 0;
  __syncthreads();
  for (std::int64_t i = cta * blockDim.x + threadIdx.x; i < n; i += kCtasPerRank * blockDim.x) {
    // i64 ids outside int32 are clamped, not wrapped: the planner still sees them as out of range.
    const std::int32_t id =
        p.ids_are_i64[local]
            ? static_cast<std::int32_t>(min(max(static_cast<const std::int64_t*>(p.ids[local])[i],
                                                std::int64_t{INT32_MIN}),
                                            std::int64_t{INT32_MAX}))
            : static_cast<const std::int32_t*>(p.ids[local])[i];
    for (int q = 0; q < p.ep; ++q) p.all_ids[q][rank * n + i] = id;
    if (p.weights[local] != nullptr) {
      const float w = p.weights[local][i];
      for (int q = 0; q < p.ep; ++q) p.all_weights[q][rank * n + i] = w;
    }
    if (id >= 0 && id < p.ep * p.num_local_experts) atomicAdd(&sent[id / p.num_local_experts], 1);
  }
  for (int c = 0; c < 2; ++c) {  // this rank's rows into its symmetric buffers (separate launches)
    if (p.rows_src[c] == nullptr) continue;
    if (c == 0 && p.rows_fp8) {  // (E4M3 rows for the peers: the bytes the row gathers would make)
      constexpr int kWarps = 256 / 32;
      quantize_token_rows(p.rows_src[0], reinterpret_cast<std::uint8_t*>(p.rows_dst[0]), p.row_elements / p.hidden,
                          p.hidden, cta * kWarps + threadIdx.x / 32, kCtasPerRank * kWarps);
      continue;
    }
    const uint4* src = reinterpret_cast<const uint4*>(p.rows_src[c]);
    uint4* dst = reinterpret_cast<uint4*>(p.rows_dst[c]);
    for (std::int64_t v = cta * blockDim.x + threadIdx.x; v < p.row_elements / 8; v += kCtasPerRank * blockDim.x)
      dst[v] = src[v];
  }
  __syncthreads();
  if (threadIdx.x < p.ep && sent[threadIdx.x] != 0)
    atomicAdd(p.expected_rows[local] + threadIdx.x, sent[threadIdx.x]);  // integer counts: order-free
  if (p.flags[0] == nullptr) return;
  // The last block to finish tells every rank that this rank's routing and rows are in place.
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    ptx::fence_acq_rel_sys();  // this block's writes (remote ones included) before its count
    last = atomicAdd(p.blocks_done, 1) == kCtasPerRank - 1;
    if (last) {
      ptx::fence_acq_rel_sys();  // every block's writes, observed through blocks_done, before the flags
      for (int q = 0; q < p.ep; ++q) ptx::st_release_sys(p.flags[q], static_cast<int>(*p.epoch));
    }
  }
}

}  // namespace

void load_exchange_kernels() { load_kernel(exchange_kernel); }

void launch_exchange(const ExchangeParams& params, cudaStream_t stream) {
  exchange_kernel<<<params.ranks * kCtasPerRank, 256, 0, stream>>>(params);
}

}  // namespace mok::kernels
