// Blockwise FP8 quantization (kernels/fp8/quantize.cuh).
#include "kernels/fp8/quantize.cuh"

#include "kernels/fp8/fp8_math.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "mok/device_plan.hpp"

namespace mok::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float bf16_value(std::uint16_t bits) { return __bfloat162float(__ushort_as_bfloat16(bits)); }

__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(QuantizeParams p) {
  const int cb = blockIdx.x, rb = blockIdx.y, e = blockIdx.z;
  const int r0 = rb * kFp8Block, c0 = cb * kFp8Block;
  const int rows = min(kFp8Block, p.rows - r0), cols = min(kFp8Block, p.cols - c0);
  const std::uint16_t* w = p.w + e * p.expert_stride + static_cast<std::int64_t>(r0) * p.row_stride + c0;
  float amax = 0.0f;
  for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) amax = fmaxf(amax, fabsf(bf16_value(w[static_cast<std::int64_t>(r) * p.row_stride + c])));
  }
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
  for (int i = 1; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const int exponent = fp8_scale_exponent(amax);
  const InverseScale inverse(exponent);
  auto value = [&](int r, int c) {
    const float x = inverse(bf16_value(w[static_cast<std::int64_t>(r) * p.row_stride + c]));
    return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  };
  if (!p.transpose) {
    if (threadIdx.x == 0) p.exponents[e * p.exponents_expert_stride + rb * p.exponents_row_stride + cb] = exponent;
    std::uint8_t* out = p.values + e * p.values_expert_stride + r0 * p.values_row_stride + c0;
    for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
      const int r = i / kFp8Block, c = i % kFp8Block;
      if (c < cols) out[r * p.values_row_stride + c] = value(r, c);
    }
    return;
  }
  // Transposed: the block's bytes through shared memory, then written as rows of W^T.
  __shared__ std::uint8_t tile[kFp8Block][kFp8Block + 4];
  if (threadIdx.x == 0) p.exponents[e * p.exponents_expert_stride + cb * p.exponents_row_stride + rb] = exponent;
  for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) tile[c][r] = value(r, c);
  }
  __syncthreads();
  std::uint8_t* out = p.values + e * p.values_expert_stride + c0 * p.values_row_stride + r0;
  for (int i = threadIdx.x; i < cols * kFp8Block; i += kThreads) {
    const int c = i / kFp8Block, r = i % kFp8Block;
    if (r < rows) out[c * p.values_row_stride + r] = tile[c][r];
  }
}

// The routed rows in plan order, quantized per 1 x 128 block as they are gathered: one warp
// a row, a lane 4 columns of each block (its amax is a warp max: the same in any order).
// Padding rows become zeros of scale 1; rows past the plan's last are not written. With
// rows_bf16, each lane also stores the bf16 values it read there.
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const __grid_constant__ QuantizeRowsParams p) {
  if (static_cast<const PlanStatus*>(p.plan_status)->code != PlanStatus::ok) return;
  const std::int64_t rows = p.expert_offset[p.num_local_experts];
  const int lane = threadIdx.x % 32, blocks = p.hidden / kFp8Block;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  for (std::int64_t row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const std::int32_t pair = p.row_pair[row];
    std::uint32_t* values = reinterpret_cast<std::uint32_t*>(p.values + row * p.hidden) + lane;
    uint2* copy = nullptr;  // the bf16 copy's row (optional)
    if (p.rows_bf16 != nullptr)
      copy = reinterpret_cast<uint2*>(row < p.split ? p.rows_bf16 + row * p.hidden : p.rows_bf16_hi + (row - p.split) * p.hidden) + lane;
    if (pair < 0) {
      for (int b = 0; b < blocks; ++b) {
        values[b * 32] = 0;
        if (copy != nullptr) copy[b * 32] = make_uint2(0, 0);
        if (lane == 0) p.scales[b * p.capacity + row] = 1.0f;
      }
      continue;
    }
    const uint2* x = reinterpret_cast<const uint2*>(p.x + static_cast<std::int64_t>(pair / p.top_k) * p.hidden) + lane;
    for (int b0 = 0; b0 < blocks; b0 += 4) {
      uint2 bits[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) bits[j] = b0 + j < blocks ? x[(b0 + j) * 32] : make_uint2(0, 0);  // loads in flight
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (b0 + j >= blocks) break;
        if (copy != nullptr) copy[(b0 + j) * 32] = bits[j];
        const float v[4] = {bf16_value(bits[j].x & 0xffff), bf16_value(bits[j].x >> 16), bf16_value(bits[j].y & 0xffff),
                            bf16_value(bits[j].y >> 16)};
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        const int e = fp8_scale_exponent(amax);
        const InverseScale inverse(e);
        values[(b0 + j) * 32] = pack_e4m3x4(inverse(v[0]), inverse(v[1]), inverse(v[2]), inverse(v[3]));
        if (lane == 0) p.scales[(b0 + j) * p.capacity + row] = exp2_int(e);
      }
    }
  }
}

}  // namespace

void launch_quantize_rows(const QuantizeRowsParams& p, int num_ctas, cudaStream_t stream) {
  quantize_rows_kernel<<<num_ctas, kThreads, 0, stream>>>(p);
}

void launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream) {
  if (p.experts == 0 || p.rows == 0 || p.cols == 0) return;
  const dim3 grid((p.cols + kFp8Block - 1) / kFp8Block, (p.rows + kFp8Block - 1) / kFp8Block, p.experts);
  quantize_blocks_kernel<<<grid, kThreads, 0, stream>>>(p);
}

}  // namespace mok::kernels
