// Parameters and launcher of the fused forward kernel (src/kernels/forward/forward.cu).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/ep/ep.cuh"
#include "kernels/plan/plan_tables.cuh"
#include "mok/kernel_status.hpp"

namespace mok::kernels {

inline constexpr int kBlockM = 128;       // rows of an M-tile (= the plan's block_m)
inline constexpr int kBlockN = 256;       // GEMM1: 128 gate + 128 up columns; GEMM2: 256 of H
inline constexpr int kGemm1Columns = 128; // h columns one GEMM1 tile produces
inline constexpr int kBlockK = 64;        // one 128-byte swizzle atom of bf16
inline constexpr int kStages = 4;
inline constexpr int kCombineTokens = 32; // tokens of one combine task
// Trailer of a saved tensor that holds a forward's pre-activations (not yet consumed).
inline constexpr unsigned long long kSavedValid = 0x4d6f4b5361766564ull;  // "MoKSaved"

// Counters the kernel uses, zeroed before each launch (stream-ordered, graph-safe).
// h_ready[m]: GEMM1 warpgroup-tiles done for M-tile m (routed tiles, then shared tiles).
struct ForwardCounters {
  int* h_ready;
  int* y_done;  // GEMM2 warpgroup-tiles done
  int* abort;   // set by the first CTA that gives up; every wait checks it
#if defined(MOK_DIAG_COPY_WARPS)
  int* x_copied = nullptr;  // rows of each routed M-tile the producer warps have copied (copy_x_rows)
#endif
};

struct ForwardMaps {
  CUtensorMap x;                               // [T, H], box 64 x 128 (shared expert's A)
  CUtensorMap x_routed;                        // [capacity, H], box 64 x 128
  CUtensorMap gate, up;                        // [E_l, I, H], box 64 x 128 x 1
  CUtensorMap down;                            // [E_l, H, I], box 64 x 256 x 1
  CUtensorMap h_store, h_load;                 // [capacity, I], boxes 64 x 64 / 64 x 128
  CUtensorMap shared_gate, shared_up;          // [1, I_s, H]
  CUtensorMap shared_down;                     // [1, H, I_s]
  CUtensorMap shared_h_store, shared_h_load;   // [T_pad, I_s]
  CUtensorMap slots, shared_slots;             // bf16 [capacity, H], [T_pad, H], box 64 x 64 (stores)
  CUtensorMap saved_gu, shared_saved_gu;       // training: [capacity, 2I], [T_pad, 2I_s], box 64 x 64 (stores)
};

// The forward's ring token buffer (RingGeometry) of x rows: freed[m] counts the GEMM1
// warpgroup-tiles of minibatch m; GEMM1 runs minibatch by minibatch and starts a minibatch
// as soon as it has landed. maps.x_routed then covers the ring. Without comm CTAs the rows
// were copied before the launch.
struct RingParams : RingGeometry {
  std::uint16_t* buffer;              // [ring_rows, H]
  const std::uint16_t* x[kMaxEpRanks];  // rank q's rows [T, H] (one GPU: x[0])
};

struct ForwardParams {
  ForwardMaps maps;
  EpPeers ep;
  RingParams ring;
  PlanTables plan;
  // data
  const float* topk_weights;     // [T, k]
  std::uint16_t* slots;          // [capacity, H] bf16 result rows
  std::uint16_t* shared_slots;   // [T_pad, H]
  std::uint16_t* y;              // [T, H] bf16 bits
  // Training: gate | up pre-activations, [capacity, 2I] and [T_pad, 2I_s] bf16, for the
  // backward (null: not saved). gemm1_only: stop after GEMM1 (the backward's recompute).
  std::uint16_t* saved_gu;
  std::uint16_t* shared_saved_gu;
  unsigned long long* saved_marker;  // set to kSavedValid when saved_gu is written
  bool gemm1_only;
  // One GPU: x_routed lies under the slot rows (Workspace::rows_in_slots; bf16 rows each
  // under its own slot row, E4M3 rows in the slot buffer's upper half); this is its capacity
  // in rows (0: a buffer of its own). A GEMM2 tile then waits for the GEMM1 tiles of the x
  // rows its slot rows overwrite.
  int x_rows_in_slots;
#if defined(MOK_DIAG_COPY_WARPS)
  // (a measured variant, not the default: bench/NOTES.md, ninth session) one GPU: the routed rows of
  // x ([T, H]) that the producer warpgroup's warps 1-3 copy into x_rows_dst in plan order during the
  // kernel, counted in counters.x_copied per M-tile (copy_x_rows); null: none.
  const std::uint16_t* x_rows_src;
  std::uint16_t* x_rows_dst;
#endif
  // Task order (Config::interleave_rows / 128; 0: phase-major): routed tiles in chunks of
  // this many M-tiles, chunk c's GEMM2 tiles right after chunk c + 1's GEMM1 tiles.
  int interleave_tiles;
  ForwardCounters counters;
  KernelStatus* status;
  // sizes
  int tokens, hidden, inter, shared_inter, top_k, num_local_experts;
  int shared_tiles;              // ceil(T / 128) if a shared expert, else 0
  int max_routed_tiles;          // h_ready offset of the shared tiles
  float swiglu_limit;            // +inf: none
  long long timeout_ns;
};

void launch_forward(const ForwardParams& params, int num_ctas, cudaStream_t stream);

// Whether a one-GPU (or BF16 EP rank's; an FP8 rank kernel always decodes) forward launch hands each
// GEMM task's decode from the producer to the consumers (TaskNote, kernels/forward/tasks.cuh) or has
// the consumers decode it themselves: two builds of the BF16 and FP8 forward kernels, the same bits.
// The notes take ~1.2-1.8 us of decode a task off the tensor cores' path, which pays where tasks are
// short. Measured on an H100 (bench/NOTES.md, forty-second and forty-third sessions; decode time /
// notes time, forward): 1.04-1.11x at hidden 2048 (qwen3-30b-a3b, olmoe-1b-7b) and 1.01-1.06x on
// qwen3.5-397b (hidden 4096, intermediate 1024); level on mixtral-8x7b (4096, 14336); 0.98-0.99x at
// the power cap on deepseek-v3 and kimi-k2 (7168, 2048) and on gpt-oss-120b (2880, 2880), where the
// consumers then wait on the stages instead. So: notes where both GEMMs' K are short, hidden <=
// kTaskNotesMaxHidden and intermediate <= kTaskNotesMaxInter.
inline constexpr int kTaskNotesMaxHidden = 4096;
inline constexpr int kTaskNotesMaxInter = 1024;
enum class TaskNotes { by_shape, on, off };
bool forward_task_notes(const ForwardParams& params);
// Tests: both builds on the same inputs (by_shape: the rule). It applies to launches made from here on:
// a workspace's cached launches (CUDA graphs, host/launch_cache.hpp) keep the kernel they captured, so a
// test takes a fresh Workspace per mode. In a MOK_DIAG_TASK_DECODE build every launch decodes.
void set_forward_task_notes(TaskNotes mode);
// The same forward with ping-pong consumer warpgroups (kernels/forward/pingpong.cu; one GPU, no
// ring): its params' weight maps use the boxes of 128 x 128 tasks (gate and up kBoxMN, down kBoxK).
void launch_forward_pingpong(const ForwardParams& params, int num_ctas, cudaStream_t stream);

// Virtual ranks: one launch runs `ranks` ranks' forwards on one GPU, CTA c serving rank
// c / ctas_per_rank with the same device code, so that every rank's CTAs are resident
// together (their waits on each other cannot deadlock).
struct ForwardGroupParams {
  ForwardParams rank[kMaxEpRanks];
  int ranks, ctas_per_rank;
};
static_assert(sizeof(ForwardGroupParams) <= 32764, "kernel parameters are limited to 32764 bytes");
void launch_forward_group(const ForwardGroupParams& params, cudaStream_t stream);
std::size_t forward_shared_memory_bytes();

}  // namespace mok::kernels
