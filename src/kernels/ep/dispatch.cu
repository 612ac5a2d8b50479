// Two copies of the routed rows into plan order. The gather (any number of sources: expert
// parallelism) takes one warp per plan row, 16-byte vectors, four loads in flight per lane before
// the stores (one at a time left the copy latency-bound). The scatter (one GPU) takes one warp per
// token: it reads the token's row once and writes it to each of its k plan rows.
#include <cstdint>

#include "kernels/ep/dispatch.cuh"
#include "kernels/common/load.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "mok/device_plan.hpp"

namespace mok::kernels {
namespace {

// The columns a copy moves (DispatchParams::column0: a column block, or the whole row).
struct Columns {
  int first, count, stride;  // first source column, columns, routed rows' stride
  __device__ explicit Columns(const DispatchParams& p)
      : first(p.column0), count(p.columns ? p.columns : p.hidden), stride(p.routed_stride ? p.routed_stride : p.hidden) {}
};

__global__ void __launch_bounds__(256) dispatch_kernel(const __grid_constant__ DispatchParams p) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  const Columns cols(p);
  const int vectors = cols.count / 8;  // uint4 of bf16 per row
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const std::int32_t pair = p.row_pair[row];
    uint4* dst = reinterpret_cast<uint4*>(row < p.split ? p.x_routed + row * cols.stride
                                                        : p.x_routed_hi + (row - p.split) * cols.stride);
    if (pair < 0) {
      for (int v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    } else {
      const int token = (pair % p.pairs_per_rank) / p.top_k;
      const uint4* src = reinterpret_cast<const uint4*>(p.x[pair / p.pairs_per_rank] +
                                                        static_cast<std::int64_t>(token) * p.hidden + cols.first);
      warp_copy_row(dst, src, vectors, lane);
    }
  }
}

// One GPU: x crosses DRAM once. The gather reads a token's row once per pair, at k times far
// apart (the rows of expert 0, then of expert 1, ...), and x (T * H * 2 bytes, 117 MB on
// deepseek-v3) does not stay in the L2 between them under the copy's own writes: k reads of x
// from DRAM beside one write of the rows. Here each warp reads 2 KB of a token's row and stores
// it to the token's k rows, pairs in order; then the padding rows of its share of the plan
// become zeros. The same bytes land in the same rows as the gather's.
__global__ void __launch_bounds__(256) scatter_kernel(const __grid_constant__ DispatchParams p) {
  constexpr int kInFlight = 4;
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  const Columns cols(p);
  const int vectors = cols.count / 8, lane = threadIdx.x % 32, k = p.top_k;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const std::int64_t warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  auto row_at = [&](std::int64_t row) {
    return reinterpret_cast<uint4*>(row < p.split ? p.x_routed + row * cols.stride : p.x_routed_hi + (row - p.split) * cols.stride);
  };
  const std::int64_t tokens = p.pairs_per_rank / k;
  for (std::int64_t token = warp; token < tokens; token += warps) {
    const uint4* src = reinterpret_cast<const uint4*>(p.x[0] + token * p.hidden + cols.first);
    const std::int32_t* rows_of_token = p.pair_row + token * k;
    // (v0 the same in every lane: the shuffles below need the whole warp, whatever H)
    for (int v0 = 0; v0 < vectors; v0 += 32 * kInFlight) {
      uint4 chunk[kInFlight] = {};
#pragma unroll
      for (int i = 0; i < kInFlight; ++i)
        if (v0 + lane + 32 * i < vectors) chunk[i] = __ldg(src + v0 + lane + 32 * i);
      for (int j0 = 0; j0 < k; j0 += 32) {  // (lane j holds pair j0 + j's row)
        const std::int32_t mine = j0 + lane < k ? rows_of_token[j0 + lane] : -1;
        for (int j = 0; j < min(32, k - j0); ++j) {
          const std::int32_t row = __shfl_sync(0xffffffffu, mine, j);
          if (row < 0) continue;  // (a pair routed nowhere: no row)
          uint4* dst = row_at(row);
#pragma unroll
          for (int i = 0; i < kInFlight; ++i)
            if (v0 + lane + 32 * i < vectors) dst[v0 + lane + 32 * i] = chunk[i];
        }
      }
    }
  }
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  for (std::int64_t base = warp * 32; base < rows; base += warps * 32) {
    unsigned padding = __ballot_sync(0xffffffffu, base + lane < rows && p.row_pair[base + lane] < 0);
    for (; padding; padding &= padding - 1) {
      uint4* dst = row_at(base + __ffs(padding) - 1);
      for (int v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
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
  load_kernel(scatter_kernel);
  load_kernel(pull_tokens_kernel);
}

void launch_pull_tokens(const TokenPullParams& params, int num_ctas, cudaStream_t stream) {
  pull_tokens_kernel<<<num_ctas, 256, 0, stream>>>(params);
}

void launch_dispatch(const DispatchParams& params, int num_ctas, cudaStream_t stream) {
  if (params.pair_row)
    scatter_kernel<<<num_ctas, 256, 0, stream>>>(params);
  else
    dispatch_kernel<<<num_ctas, 256, 0, stream>>>(params);
}

}  // namespace mok::kernels
