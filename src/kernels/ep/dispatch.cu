// One warp per row, 16-byte vectors, four loads in flight per lane before the stores
// (one at a time left the copy latency-bound); rows in plan order, so writes are contiguous.
#include <cstdint>

#include "kernels/ep/dispatch.cuh"
#include "kernels/common/load.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "mok/device_plan.hpp"

namespace mok::kernels {
namespace {

__global__ void __launch_bounds__(256) dispatch_kernel(const __grid_constant__ DispatchParams p) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  const int vectors = p.hidden / 8;  // uint4 of bf16 per row
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const std::int32_t pair = p.row_pair[row];
    uint4* dst = reinterpret_cast<uint4*>(row < p.split ? p.x_routed + row * p.hidden
                                                        : p.x_routed_hi + (row - p.split) * p.hidden);
    if (pair < 0) {
      for (int v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    } else {
      const int token = (pair % p.pairs_per_rank) / p.top_k;
      const uint4* src =
          reinterpret_cast<const uint4*>(p.x[pair / p.pairs_per_rank] + static_cast<std::int64_t>(token) * p.hidden);
      warp_copy_row(dst, src, vectors, lane);
    }
  }
}

// One warp per peer token: its lanes read the token's k expert ids; if any is one of this
// rank's experts, the warp copies the row.
__global__ void __launch_bounds__(256) pull_tokens_kernel(const __grid_constant__ TokenPullParams p) {
  const int lane = threadIdx.x % 32, vectors = p.hidden / 8;
  const int first = p.rank * p.num_local_experts, last = first + p.num_local_experts;
  const std::int64_t tokens = (p.ep - 1) * p.tokens;  // the peers' tokens, skipping this rank's
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < tokens; i += warps) {
    const int q = static_cast<int>(i / p.tokens) + (i / p.tokens >= p.rank ? 1 : 0);
    const std::int64_t token = q * p.tokens + i % p.tokens;  // global token of rank q
    bool here = false;
    for (int j = lane; j < p.top_k; j += 32) {
      const std::int32_t id = p.ids[token * p.top_k + j];
      here = here || (id >= first && id < last);
    }
    if (!__any_sync(0xffffffffu, here)) continue;
    warp_copy_row(reinterpret_cast<uint4*>(p.recv + token * p.hidden),
                  reinterpret_cast<const uint4*>(p.x[q] + (i % p.tokens) * p.hidden), vectors, lane);
  }
}

}  // namespace

void load_dispatch_kernels() {
  load_kernel(dispatch_kernel);
  load_kernel(pull_tokens_kernel);
}

void launch_pull_tokens(const TokenPullParams& params, int num_ctas, cudaStream_t stream) {
  pull_tokens_kernel<<<num_ctas, 256, 0, stream>>>(params);
}

void launch_dispatch(const DispatchParams& params, int num_ctas, cudaStream_t stream) {
  dispatch_kernel<<<num_ctas, 256, 0, stream>>>(params);
}

}  // namespace mok::kernels
