// Parameters and launcher of the FP8 forward kernel (src/kernels/forward/forward_fp8.cu): the
// routed experts in E4M3 with DeepSeek-V3's blockwise scaling (power-of-two scales, mok/fp8.hpp),
// the shared expert and everything else as the BF16 forward.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/forward/forward.cuh"

namespace mok::kernels {

struct Fp8ForwardMaps {
  CUtensorMap x;         // E4M3 [capacity, H]: the routed rows, quantized per 1 x 128; box 128 x 128
  CUtensorMap gate, up;  // E4M3 [E_l, I, H]; box 128 x 128 x 1
  CUtensorMap down;      // E4M3 [E_l, H, I]; box 128 x 128 x 1
  CUtensorMap h_store;   // E4M3 [capacity, I]; box 128 x 64
  CUtensorMap h_load;    // E4M3 [capacity, I]; box 128 x 128
};

struct Fp8ForwardParams {
  // The BF16 forward's params: plan, counters, slots, y, sizes, the shared expert's maps, the
  // saved pre-activations, the EP peer table (base.maps' routed maps are unused; no ring).
  ForwardParams base;
  Fp8ForwardMaps maps;
  std::int64_t capacity;           // plan rows: the stride of the row scales
  // The row scales (powers of two) as E8M0 bytes (2^(byte - 127); fp8_math.cuh's e8m0_byte): x's from
  // the quantization, h's written by GEMM1. The producer loads a stage's 128 rows' bytes with its
  // operands, so that the consumers' promotions read them from shared memory.
  const std::uint8_t* x_exps;      // [H / 128, capacity]: row r's block b scale
  std::uint8_t* h_exps;            // [I / 128, capacity]
  const std::int32_t* gate_exponents;  // [E_l, I / 128, H / 128]: weight block (i, j) scale 2^e
  const std::int32_t* up_exponents;    // [E_l, I / 128, H / 128]
  const std::int32_t* down_exponents;  // [E_l, H / 128, I / 128]
};

// One GPU, or one rank of an EP group (params.base.ep.push: the rank's own launch).
void launch_forward_fp8(const Fp8ForwardParams& params, int num_ctas, cudaStream_t stream);

// Virtual ranks (as ForwardGroupParams): one launch, CTA c serving rank c / ctas_per_rank.
struct Fp8ForwardGroupParams {
  Fp8ForwardParams rank[kMaxEpRanks];
  int ranks, ctas_per_rank;
};
static_assert(sizeof(Fp8ForwardGroupParams) <= 32764, "kernel parameters are limited to 32764 bytes");
void launch_forward_fp8_group(const Fp8ForwardGroupParams& params, cudaStream_t stream);

}  // namespace mok::kernels
