// The activation, shared by every kernel that computes or recomputes it: one definition,
// so forward, recompute and backward round identically.
#pragma once

#include <cuda_runtime.h>

namespace mok::kernels {

// limit = +inf means no clamp. fp32 throughout; the caller rounds the result to bf16 once.
__device__ __forceinline__ float swiglu(float gate, float up, float limit) {
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  const float sig = __frcp_rn(__fadd_rn(1.0f, __expf(-gate)));
  return __fmul_rn(__fmul_rn(gate, sig), up);
}

}  // namespace mok::kernels
