// Routing exchange of an EP group: every rank writes its [T, k] ids (as i32) into slot
// `rank` of every rank's [ep, T, k] buffer, with one store per peer (no multicast), and
// counts the rows it sends to each rank (what its combine will wait for). The backward
// also sends the routing weights the same way.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/ep/ep.cuh"

namespace mok::kernels {

struct ExchangeParams {
  const void* ids[kMaxEpRanks];       // rank r's topk_ids [T, k]
  bool ids_are_i64[kMaxEpRanks];
  std::int32_t* all_ids[kMaxEpRanks];  // rank q's [ep, T, k] buffer
  int* expected_rows[kMaxEpRanks];     // rank r's [kMaxEpRanks] rows its routing sends to each rank (zeroed)
  const float* weights[kMaxEpRanks];   // rank r's topk_weights [T, k], or null: not exchanged
  float* all_weights[kMaxEpRanks];     // rank q's [ep, T, k] (the backward's dh epilogue reads them)
  int num_local_experts;
  int ranks;                         // ranks this launch serves (virtual ranks: all of them)
  int first_rank;                    // global rank of the first one
  int ep;                            // size of the group
  std::int64_t pairs_per_rank;       // T * k
  // Separate launches per rank (ranks == 1; peers may be other GPUs): rows copied into this
  // rank's symmetric buffers first (x, and dy in the backward; null src: none), then, once
  // every block's writes are done, flags[q] = *epoch at every rank q (release, system
  // scope): "my routing and rows are there". Null flags: the stream orders the ranks.
  const std::uint16_t* rows_src[2];
  std::uint16_t* rows_dst[2];
  std::int64_t row_elements;         // T * H
  // Config::pull_fp8_rows (an FP8 forward): rows 0 (x) quantized per 1 x 128 instead of copied, into
  // kernels/fp8/quantize_rows.cuh's token-major layout at rows_dst[0] (hidden: H)
  bool rows_fp8 = false;
  int hidden = 0;
  int* flags[kMaxEpRanks];             // rank q's exchange flag of this rank
  const unsigned* epoch;             // this rank's call number
  int* blocks_done;                  // this rank's counter of finished blocks (zeroed)
};

void launch_exchange(const ExchangeParams& params, cudaStream_t stream);

}  // namespace mok::kernels
