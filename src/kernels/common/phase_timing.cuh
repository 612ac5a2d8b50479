// Where a persistent kernel's consumer warpgroups spend their time, by phase, for finding
// what bounds a preset (issue 18 asks "which phase, measured how"). Only a build with
// -DMOK_PHASE_TIMING=ON collects anything: there the first thread of each consumer warpgroup
// adds the SM cycles (clock64) since its last lap to the phase's counter in a global table
// (integer atomics: diagnostics, not results; a few per task). In the default build
// PhaseTimer is empty and every call compiles to nothing.
#pragma once

#include <cstdint>

namespace mok::kernels {

enum class Phase : int {
  other,           // task decoding, publications, the loop's own work
  mainloop_gemm1,  // forward: GEMM1's K loop, including waits for the producer's stages
  epilogue_gemm1,  //          SwiGLU, h stored
  mainloop_gemm2,
  epilogue_gemm2,  //          bf16 rows staged and stored (or pushed)
  mainloop_dh,     // backward: dh = dy W_down^T's K loop
  epilogue_dh,     //           the SwiGLU backward, d pre-activations stored
  mainloop_dx,     //           dx rows = d pre-activations W_gu
  epilogue_dx,     //           dx rows stored (or pushed)
  mainloop_wgrad,  //           weight-gradient tiles (MN-major operands)
  epilogue_wgrad,  //           weight-gradient tiles stored
  combine_wait,    // waiting for every row tile (and every peer's pushes)
  combine,         // the fixed-order sum of each token's rows
  count
};
inline constexpr int kPhases = static_cast<int>(Phase::count);

inline const char* phase_name(int phase) {
  constexpr const char* kNames[kPhases] = {"other", "mainloop_gemm1", "epilogue_gemm1", "mainloop_gemm2", "epilogue_gemm2",
                                           "mainloop_dh", "epilogue_dh", "mainloop_dx", "epilogue_dx", "mainloop_wgrad",
                                           "epilogue_wgrad", "combine_wait", "combine"};
  return phase >= 0 && phase < kPhases ? kNames[phase] : "?";
}

// A kernel's table, defined once in its .cu at namespace mok::kernels: MOK_PHASE_TABLE(forward)
// gives forward_phase_table (a device pointer in a timing build, a constant null otherwise)
// and, in a timing build, the host's set_forward_phase_table(table) (null: collect nothing).
#ifdef MOK_PHASE_TIMING
#define MOK_PHASE_TABLE(kernel)                                                      \
  static __device__ unsigned long long* kernel##_phase_table = nullptr;              \
  void set_##kernel##_phase_table(unsigned long long* table) {                       \
    cudaMemcpyToSymbol(kernel##_phase_table, &table, sizeof(table));                 \
  }
void set_forward_phase_table(unsigned long long* table);   // [kPhases] (kernels/forward/forward.cu)
void set_forward_fp8_phase_table(unsigned long long* table);  // [kPhases] (kernels/forward/forward_fp8.cu)
void set_backward_phase_table(unsigned long long* table);  // [kPhases] (kernels/backward/backward.cu)
#else
#define MOK_PHASE_TABLE(kernel) constexpr unsigned long long* kernel##_phase_table = nullptr;
#endif

#ifdef MOK_PHASE_TIMING
struct PhaseTimer {
  unsigned long long* table;  // [kPhases], or null
  long long last;
  __device__ __forceinline__ explicit PhaseTimer(unsigned long long* t) : table(t), last(0) {
#ifdef __CUDA_ARCH__
    last = clock64();
#endif
  }
  template <Phase kPhase>
  __device__ __forceinline__ void lap() {  // the cycles since the last lap, added by the warpgroup's first thread
#ifdef __CUDA_ARCH__
    const long long now = clock64();
    if (table != nullptr && threadIdx.x % 128 == 0)
      atomicAdd(table + static_cast<int>(kPhase), static_cast<unsigned long long>(now - last));
    last = now;
#endif
  }
};
#else
struct PhaseTimer {
  __device__ __forceinline__ explicit PhaseTimer(unsigned long long*) {}
  template <Phase>
  __device__ __forceinline__ void lap() {}
};
#endif

}  // namespace mok::kernels
