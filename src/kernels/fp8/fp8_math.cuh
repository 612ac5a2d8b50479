// E4M3 with power-of-two scales on the device (the host's twin: mok/fp8.hpp): a block's
// scale exponent from its largest magnitude, and values rounded to E4M3 (nearest, ties to
// even, saturating at +-448), so that the kernels produce the host's bytes.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace mok::kernels {

// 2^e as a float, ldexpf(1, e)'s value for every int e, from its bits with no branch: normal
// ones from the exponent field, subnormal ones (e in [-149, -127]) from the mantissa bit, 0
// below, infinity above 127. Multiplying by it is exact, as ldexpf is, unless the product is
// subnormal, where both round the same real number once. (A branch to ldexpf for the rare
// exponents cost the FP8 mainloop registers: 60 bytes of spill in the FP8 forward.)
__device__ __forceinline__ float exp2_int(int e) {
  const int normal = (max(min(e, 128), -127) + 127) << 23, subnormal = e >= -149 && e < -126 ? 1 << (e + 149) : 0;
  return __int_as_float(e >= -126 ? normal : subnormal);
}

// A scale 2^e of the recipe (e in fp8_scale_exponent's [-127, 120]) as its E8M0 byte e + 127 (0: 2^-127,
// the one subnormal scale; the exponent field of the float 2^e), the form in which the quantizations
// store activation scales and the FP8 forward's, dgrad's and weight gradients' stages carry A's (mainloop_fp8).
__device__ __forceinline__ std::uint8_t e8m0_byte(int e) { return static_cast<std::uint8_t>(e + 127); }

// The scale an E8M0 byte stands for (e8m0_byte's inverse): 2^(byte - 127) from the exponent
// field, and byte 0, 2^-127, as the subnormal float 0x00400000 (a select, no branch).
__device__ __forceinline__ float e8m0_scale(std::uint32_t byte) {
  return __uint_as_float(byte != 0 ? byte << 23 : 0x00400000u);
}

// Division of a block's values by its scale 2^e as one multiplication by 2^-e, exact as ldexpf(v, -e)
// is: e is fp8_scale_exponent's, in [-127, 120], so 2^-e is a normal float. (Before the floor at
// -127, e reached -157 and 2^-e took two factors.)
struct InverseScale {
  float a;
  __device__ __forceinline__ explicit InverseScale(int e) : a(exp2_int(-e)) {}
  __device__ __forceinline__ float operator()(float v) const { return v * a; }
};

// The smallest e >= -127 (E8M0's floor: fp8::kMinScaleExponent) with amax / 2^e <= 448 (the largest
// E4M3): with amax = m * 2^k, m in [1, 2), e = k - 8, plus one when m > 1.75 (448 = 1.75 * 2^8;
// 0x600000: the mantissa bits of 1.75). 0 for a block of zeros or one with an infinity or NaN (as the
// host's fp8::scale_exponent). From amax's bits (a subnormal amax, biased exponent 0, takes the floor).
__device__ __forceinline__ int fp8_scale_exponent(float amax) {
  if (!(amax > 0.0f) || isinf(amax)) return 0;
  const unsigned bits = __float_as_uint(amax);
  const int biased = static_cast<int>(bits >> 23);  // (amax > 0: no sign bit)
  return max(biased - 127 - 8 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0), -127);
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
