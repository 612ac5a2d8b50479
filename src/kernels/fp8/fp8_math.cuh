// E4M3 with power-of-two scales on the device (the host's twin: mok/fp8.hpp): a block's
// scale exponent from its largest magnitude, and values rounded to E4M3 (nearest, ties to
// even, saturating at +-448), so that the kernels produce the host's bytes.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace mok::kernels {

// The smallest e with amax / 2^e <= 448 (the largest E4M3): with amax = m * 2^k, m in [1, 2),
// e = k - 8, plus one when m > 1.75 (448 = 1.75 * 2^8). 0 for a block of zeros or one with
// an infinity or NaN (as the host's fp8::scale_exponent).
__device__ __forceinline__ int fp8_scale_exponent(float amax) {
  if (!(amax > 0.0f) || isinf(amax)) return 0;
  const int k = ilogbf(amax);
  return k - 8 + (ldexpf(amax, -k) > 1.75f ? 1 : 0);
}

// Four values (already divided by their scale) as four E4M3 bytes, the first in the lowest.
__device__ __forceinline__ std::uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  const std::uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const std::uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// Two values as two E4M3 bytes, the first in the lower.
__device__ __forceinline__ std::uint16_t pack_e4m3x2(float a, float b) {
  return static_cast<std::uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace mok::kernels
