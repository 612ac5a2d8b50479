// Host-side bfloat16 storage type: conversions only, no arithmetic.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mok {

struct bf16 {
  std::uint16_t bits = 0;

  static bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }

  // Round to nearest even, as the GPU's cvt.rn.bf16.f32 does; NaN stays a quiet NaN.
  static bf16 from_float(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if (std::isnan(f)) return from_bits(static_cast<std::uint16_t>((u >> 16) | 0x40u));
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return from_bits(static_cast<std::uint16_t>((u + rounding) >> 16));
  }

  float to_float() const {
    const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};

static_assert(sizeof(bf16) == 2);

// Rounds a value to the nearest bf16 and back (the value a bf16 tensor would hold).
inline double round_to_bf16(double v) { return bf16::from_float(static_cast<float>(v)).to_float(); }

}  // namespace mok
