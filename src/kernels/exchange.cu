#include "kernels/exchange.cuh"

#include <cstdint>

namespace mok::kernels {
namespace {

constexpr int kCtasPerRank = 16;

__global__ void __launch_bounds__(256) exchange_kernel(const ExchangeParams p) {
  const int local = blockIdx.x / kCtasPerRank, cta = blockIdx.x % kCtasPerRank;
  const int rank = p.first_rank + local;
  const std::int64_t n = p.pairs_per_rank;
  __shared__ int sent[kMaxRanks];  // rows this block's ids send to each rank
  if (threadIdx.x < kMaxRanks) sent[threadIdx.x] = 0;
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
  __syncthreads();
  if (threadIdx.x < p.ep && sent[threadIdx.x] != 0)
    atomicAdd(p.expected_rows[local] + threadIdx.x, sent[threadIdx.x]);  // integer counts: order-free
}

}  // namespace

void launch_exchange(const ExchangeParams& params, cudaStream_t stream) {
  exchange_kernel<<<params.ranks * kCtasPerRank, 256, 0, stream>>>(params);
}

}  // namespace mok::kernels
