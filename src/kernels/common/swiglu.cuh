// The activation, shared by every kernel that computes or recomputes it: one definition,
// so forward, recompute and backward round identically.
#pragma once

#include <cuda_runtime.h>

namespace mok::kernels {

// The sigmoid's reciprocal 1 / (1 + e^-g), whose argument is >= 1 or +inf (then 0): MUFU.RCP
// alone (rcp.approx, at most 1 ulp from the rounded quotient; the argument is never subnormal,
// so flushing changes nothing). __frcp_rn, the correctly rounded one, cost each element a
// range check, a branch around a called slow path and its argument moves: ~20 of the ~35
// instructions of swiglu() in the SASS, in every GEMM1 and dh epilogue. The __expf before it
// is already an approximation (ex2.approx), so the sigmoid was never the rounded quotient.
// (Measured against __frcp_rn with a diagnostic build at 4ea25f9: bench/NOTES.md.)
__device__ __forceinline__ float sigmoid_denominator_rcp(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
}

// e^-g for the sigmoid's denominator 1 + e^-g: __expf(-g)'s product and MUFU.EX2, with a
// result below 2^-126 flushed to 0 (__expf keeps it subnormal: a compare and two predicated
// multiplies a value). Only 1 + e^-g is used, and 1 + a subnormal rounds to 1 as 1 + 0 does,
// so every result is __expf's.
__device__ __forceinline__ float exp_neg(float g) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(g, -1.44269502162933349609375f)));
  return e;
}

// limit = +inf means no clamp. fp32 throughout; the caller rounds the result to bf16 once.
__device__ __forceinline__ float swiglu(float gate, float up, float limit) {
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  const float sig = sigmoid_denominator_rcp(__fadd_rn(1.0f, exp_neg(gate)));
  return __fmul_rn(__fmul_rn(gate, sig), up);
}

// The forward saves pre-activations for the backward with the clamp decision in them:
// a clamped value becomes +-inf, so bf16 rounding cannot move it across the limit.
__device__ __forceinline__ float saved_gate(float gate, float limit) { return gate > limit ? __int_as_float(0x7f800000) : gate; }
// (Two selects, the upper one last: the nested conditional compiled to a branch a value.)
__device__ __forceinline__ float saved_up(float up, float limit) {
  float saved = up < -limit ? __int_as_float(0xff800000) : up;
  saved = up > limit ? __int_as_float(0x7f800000) : saved;
  return saved;
}

struct SwigluGrad {
  float hidden;  // swiglu(gate, up), as the forward computed it
  float d_gate;  // d hidden/d gate * d_hidden; 0 where the clamp was active
  float d_up;
};

// gate, up: as saved_gate() / saved_up() stored them (infinite = clamped).
__device__ __forceinline__ SwigluGrad swiglu_backward(float gate, float up, float d_hidden, float limit) {
  const bool gate_pass = gate != __int_as_float(0x7f800000), up_pass = fabsf(up) != __int_as_float(0x7f800000);
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  const float sig = sigmoid_denominator_rcp(__fadd_rn(1.0f, exp_neg(gate)));
  const float silu = __fmul_rn(gate, sig);
  SwigluGrad g;
  g.hidden = __fmul_rn(silu, up);
  // d silu/d gate = sig * (1 + gate * (1 - sig))
  const float dsilu = __fmul_rn(sig, __fmaf_rn(gate, __fsub_rn(1.0f, sig), 1.0f));
  g.d_gate = gate_pass ? __fmul_rn(__fmul_rn(d_hidden, up), dsilu) : 0.0f;
  g.d_up = up_pass ? __fmul_rn(d_hidden, silu) : 0.0f;
  return g;
}

}  // namespace mok::kernels
