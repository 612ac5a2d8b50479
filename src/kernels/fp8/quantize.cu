// Blockwise FP8 quantization (kernels/fp8/quantize.cuh).
#include "kernels/fp8/quantize.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace mok::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float bf16_value(std::uint16_t bits) { return __bfloat162float(__ushort_as_bfloat16(bits)); }

// The smallest e with amax / 2^e <= 448 (the largest E4M3): with amax = m * 2^k, m in [1, 2),
// e = k - 8, plus one when m > 1.75 (448 = 1.75 * 2^8). 0 for a block of zeros or one with
// an infinity (as the host's fp8::scale_exponent).
__device__ __forceinline__ int scale_exponent(float amax) {
  if (!(amax > 0.0f) || isinf(amax)) return 0;
  const int k = ilogbf(amax);
  return k - 8 + (ldexpf(amax, -k) > 1.75f ? 1 : 0);
}

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
  const int exponent = scale_exponent(amax);
  const int row_blocks = (p.rows + kFp8Block - 1) / kFp8Block, col_blocks = (p.cols + kFp8Block - 1) / kFp8Block;
  if (threadIdx.x == 0) p.exponents[(static_cast<std::int64_t>(e) * row_blocks + rb) * col_blocks + cb] = exponent;
  std::uint8_t* out = p.values + (static_cast<std::int64_t>(e) * p.rows + r0) * p.cols + c0;
  for (int i = threadIdx.x; i < rows * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c >= cols) continue;
    const float x = ldexpf(bf16_value(w[static_cast<std::int64_t>(r) * p.row_stride + c]), -exponent);
    out[static_cast<std::int64_t>(r) * p.cols + c] =
        static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  }
}

}  // namespace

void launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream) {
  if (p.experts == 0 || p.rows == 0 || p.cols == 0) return;
  const dim3 grid((p.cols + kFp8Block - 1) / kFp8Block, (p.rows + kFp8Block - 1) / kFp8Block, p.experts);
  quantize_blocks_kernel<<<grid, kThreads, 0, stream>>>(p);
}

}  // namespace mok::kernels
