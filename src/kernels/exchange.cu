#include "kernels/exchange.cuh"

#include <cstdint>

namespace mok::kernels {
namespace {

constexpr int kCtasPerRank = 16;

__global__ void __launch_bounds__(256) exchange_kernel(const ExchangeParams p) {
  const int local = blockIdx.x / kCtasPerRank, cta = blockIdx.x % kCtasPerRank;
  const int rank = p.first_rank + local;
  const std::int64_t n = p.pairs_per_rank;
  int sent[kMaxRanks] = {};
  for (std::int64_t i = cta * blockDim.x + threadIdx.x; i < n; i += kCtasPerRank * blockDim.x) {
    // i64 ids outside int32 are clamped, not wrapped: the planner still sees them as out of range.
    const std::int32_t id =
        p.ids_are_i64[local]
            ? static_cast<std::int32_t>(min(max(static_cast<const std::int64_t*>(p.ids[local])[i],
                                                std::int64_t{INT32_MIN}),
                                            std::int64_t{INT32_MAX}))
            : static_cast<const std::int32_t*>(p.ids[local])[i];
    for (int q = 0; q < p.ep; ++q) p.all_ids[q][rank * n + i] = id;
    if (id >= 0 && id < p.ep * p.num_local_experts) ++sent[id / p.num_local_experts];
  }
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    int v = sent[q];
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && v != 0) atomicAdd(p.expected_rows[local] + q, v);  // integer: order-free
  }
}

}  // namespace

void launch_exchange(const ExchangeParams& params, cudaStream_t stream) {
  exchange_kernel<<<params.ranks * kCtasPerRank, 256, 0, stream>>>(params);
}

}  // namespace mok::kernels
