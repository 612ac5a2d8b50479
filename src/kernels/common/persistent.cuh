// Pieces shared by the persistent kernels (forward.cu, backward.cu): the CTA's roles and
// register split, the wgmma accumulator layout, and the consumer mainloop over a pipeline
// of {A 128 x 64, B 256 x 64} stages (kernels/common/pipeline.cuh; bounded waits: kernels/common/waits.cuh).
//
// A kernel's params type P provides what kernels/common/waits.cuh needs. Its shared storage S
// provides: stages[kStages] with members a and b, and barriers (PipelineBarriers<kStages>).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/pipeline.cuh"
#include "mok/kernel_status.hpp"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ != 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "mok's persistent kernels are Hopper's (wgmma, TMA, setmaxnreg): compile them for sm_90a only"
#endif

namespace mok::kernels {

// The CTA both persistent kernels use: one producer warpgroup (its thread 0 issues every
// TMA load), two consumer warpgroups of 64 rows each, one CTA per SM.
inline constexpr int kProducerThreads = 128;  // one warpgroup (split_roles)
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kThreads = kProducerThreads + 128 * kConsumerWarpgroups;
inline constexpr int kProducerRegisters = 40;
inline constexpr int kConsumerRegisters = 232;
// The named barriers (bar.sync ids; 0 is __syncthreads'): one per consumer warpgroup (its
// 128 threads) and one of every consumer thread.
enum class NamedBarrier : int { warpgroup0 = 1, consumers = 1 + kConsumerWarpgroups };
// Synchronises the 128 threads of consumer warpgroup `wg`.
__device__ __forceinline__ void sync_warpgroup(int wg) {
  ptx::named_barrier_sync(static_cast<int>(NamedBarrier::warpgroup0) + wg, 128);
}
// Synchronises every consumer thread.
__device__ __forceinline__ void sync_consumers() {
  ptx::named_barrier_sync(static_cast<int>(NamedBarrier::consumers), 128 * kConsumerWarpgroups);
}
// setmaxnreg moves registers within the CTA's launch allocation (kThreads x the kernel's
// count, 168 under __launch_bounds__(kThreads, 1)): what the consumers take, the producer
// must give back, or setmaxnreg.inc waits forever (seen: 48 + 232 hung every CTA).
inline constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
static_assert(kProducerRegisters * kProducerThreads + kConsumerRegisters * 128 * kConsumerWarpgroups <=
              kLaunchRegisters * kThreads);

// The kernel's shared storage S in dynamic shared memory, aligned to 1024 bytes (the
// 128-byte swizzle's atom); the launch asks for shared_storage_bytes<S>().
template <typename S>
constexpr std::size_t shared_storage_bytes() { return sizeof(S) + 1024; }
// The most dynamic shared memory one CTA of sm_90 may opt in to: 227 KiB for static and
// dynamic together, less a reserve for the kernels' static shared variables (16 bytes: the EP
// push's verdict; a launch over the sum fails with 'invalid argument').
inline constexpr std::size_t kMaxSharedMemoryBytes = 227 * 1024 - 128;

template <typename S>
__device__ __forceinline__ S& shared_storage() {
  extern __shared__ std::uint8_t smem_raw[];
  return *reinterpret_cast<S*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
}

// Warp specialisation: warpgroup 0 hands registers back and its thread 0 runs producer();
// the other warpgroups take the registers and run consumer(warpgroup index from 0).
template <int kProducerRegisters, int kConsumerRegisters, typename Producer, typename Consumer>
__device__ __forceinline__ void split_roles(Producer&& producer, Consumer&& consumer) {
  if (threadIdx.x < 128) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) producer();
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    consumer((threadIdx.x - 128) / 128);  // unsigned arithmetic, converted to int
  }
}

#if defined(MOK_DIAG_COPY_WARPS)
// The same, warps 1-3 of warpgroup 0 running helper(warp) (a diagnostic build's copy warps).
template <int kProducerRegisters, int kConsumerRegisters, typename Producer, typename Consumer, typename Helper>
__device__ __forceinline__ void split_roles(Producer&& producer, Consumer&& consumer, Helper&& helper) {
  if (threadIdx.x < 128) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) producer();
    else if (threadIdx.x >= 32) helper(static_cast<int>(threadIdx.x / 32));
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    consumer((threadIdx.x - 128) / 128);  // unsigned arithmetic, converted to int
  }
}
#endif

// Raises a persistent kernel's dynamic shared memory limit to `smem` bytes on the current
// device, once per kernel and device (this also loads the kernel's module; see kernels/common/load.cuh).
template <auto Kernel>
void configure_persistent(std::size_t smem) {
  static bool configured[64] = {};  // per kernel and device (the attribute is per device context)
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64 || !configured[device]) {
    // An error here (e.g. too much shared memory) surfaces as the launch's error, checked by the caller.
    if (cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) == cudaSuccess &&
        device >= 0 && device < 64)
      configured[device] = true;
  }
}

// Launches a persistent kernel with `smem` bytes of dynamic shared memory.
template <auto Kernel, typename Params>
void launch_persistent(std::size_t smem, int threads, const Params& params, int ctas, cudaStream_t stream) {
  configure_persistent<Kernel>(smem);
  Kernel<<<ctas, threads, smem, stream>>>(params);
}


// Row/column of accumulator element i of this thread (wgmma m64nN f32 layout) inside its
// warpgroup's 64-row tile.
__device__ __forceinline__ int acc_row(int warp, int lane, int i) { return warp * 16 + lane / 4 + 8 * ((i >> 1) & 1); }
__device__ __forceinline__ int acc_col(int lane, int i) { return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1); }

// Byte offset of the byte at `byte` (column offset in bytes) of row `row` in a staging
// tile of 128-byte-wide panels (64 rows each, 8 KB a panel) with the 128-byte swizzle TMA
// expects: 16-byte chunks of a row are permuted by the row's index mod 8.
__device__ __forceinline__ int swizzled_offset_bytes(int row, int byte) {
  const int panel = byte / 128, chunk = (byte % 128) / 16;
  return panel * 64 * 128 + row * 128 + ((chunk ^ (row % 8)) * 16) + byte % 16;
}
// The same for bf16 element (row, col): 64 columns a panel.
__device__ __forceinline__ int swizzled_offset(int row, int col) { return swizzled_offset_bytes(row, col * 2); }

// Columns [128 half, 128 half + 128) of this warpgroup's 64 x 256 accumulators, as the bf16
// pairs pack(acc[i], acc[i + 1]), into its 16 KB staging (two swizzled 64-column panels) for
// TMA stores: first waits until the previous stores have read the staging, and syncs the
// warpgroup before and after the writes (fenced for the async proxy). half: a constant
// after unrolling (the accumulators' indices must be). kSharedWindow: the writes as st.shared
// at 32-bit addresses rather than generic stores at 64-bit ones — for a kernel at its register
// limit (the FP8 dgrad kernel), where the compiler hoists the 64-bit staging addresses out of
// the task loop and spills them across the mainloops (188 bytes; 0 with this).
template <bool kSharedWindow = false, typename Pack>
__device__ __forceinline__ void stage_bf16_half(char* staging, const float (&acc)[128], int half, int wg, Pack pack) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  if (tid == 0) ptx::tma_store_wait_read();
  sync_warpgroup(wg);
#pragma unroll
  for (int i = 64 * half; i < 64 * half + 64; i += 2) {
    const int r = acc_row(warp, lane, i), c = acc_col(lane, i) - 128 * half;
    if constexpr (kSharedWindow)
      ptx::st_shared_b32(ptx::smem_address(staging) + swizzled_offset(r, c), pack(acc[i], acc[i + 1]));
    else
      *reinterpret_cast<std::uint32_t*>(staging + swizzled_offset(r, c)) = pack(acc[i], acc[i + 1]);
  }
  ptx::fence_proxy_async_shared_cta();
  sync_warpgroup(wg);
}

// The plan's expert whose task range [offset(e) / 128 * n_tiles, ...) holds `local`, for
// tasks numbered N-tile-major inside each expert: the largest e with start(e) <= local.
__host__ __device__ __forceinline__ int expert_of_task(const std::int32_t* expert_offset, int num_experts, int local,
                                              int n_tiles, int block_m) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (expert_offset[mid] / block_m * n_tiles <= local) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

__device__ __forceinline__ float2 unpack_bf16x2(std::uint32_t bits) {
  __nv_bfloat162 v;
  *reinterpret_cast<std::uint32_t*>(&v) = bits;
  return __bfloat1622float2(v);
}

// Operand layouts of one GEMM in shared memory. K-major: the tile's rows are M (or N)
// with 64 K elements each (one TMA box of {64, rows}). MN-major: 64-row K boxes of 64
// M (N) elements, one box per 64 M (N), 8 KB apart.
struct KMajor {
  static constexpr int kMn = 0;
  static constexpr int kDescStep = 2;  // 32 bytes per 16 K
  __device__ static std::uint64_t descriptor(const void* tile) { return ptx::wgmma_descriptor_sw128(tile); }
};
struct MnMajor {
  static constexpr int kMn = 1;
  static constexpr int kDescStep = 128;  // 2048 bytes per 16 K
  __device__ static std::uint64_t descriptor(const void* tile) { return ptx::wgmma_descriptor_sw128_mn(tile, 8192); }
};

// The consumer warpgroup `wg` multiplies its 64 rows of A by the stage's 256 columns of B
// over k_steps stages, handing each stage back once its MMAs are done. acc is zeroed first,
// though the first MMA ignores it (its asm reads it): entering undefined, acc's 128 registers
// stayed live through the caller's whole task loop, the combine included (~190 live there:
// its loads went one at a time, 2026-12-03); and in the FP8 dgrad kernel, entering as the FP8
// mainloop left it (defined by ordinary instructions), ptxas serialized every wgmma of the
// kernel (warning C7515). An empty sum (k_steps = 0) is zero.
template <typename LayoutA, typename LayoutB, int kStages, typename P, typename S>
__device__ __forceinline__ void mainloop(const P& p, S& s, Pipeline<kStages>& pipe, float (&acc)[128], int k_steps,
                                         int wg, int task) {
  constexpr int kBlockK = 64;
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  const bool leader = threadIdx.x % 128 == 0;  // releases the warpgroup's stages
  int previous = -1;
  for (int kb = 0; kb < k_steps; ++kb) {
    const int stage_index = pipe.consumer_wait(p, s.barriers, task);
    const auto& stage = s.stages[stage_index];
    const std::uint64_t desc_a = LayoutA::descriptor(stage.a + wg * 64 * kBlockK);
    const std::uint64_t desc_b = LayoutB::descriptor(stage.b);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk)
      ptx::wgmma_m64n256k16_bf16<LayoutA::kMn, LayoutB::kMn>(acc, desc_a + LayoutA::kDescStep * kk,
                                                             desc_b + LayoutB::kDescStep * kk, (kb | kk) != 0);
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<1>();  // the previous stage's MMAs are done: hand it back
    if (previous >= 0 && leader) pipe.consumer_release(s.barriers, previous);
    previous = stage_index;
    pipe.consumer_advance();
  }
  ptx::wgmma_wait_group<0>();
  if (previous >= 0 && leader) pipe.consumer_release(s.barriers, previous);
}

// counter += count (release, gpu scope) once every thread of warpgroup `wg` has issued the
// writes it counts.
__device__ __forceinline__ void publish_count(int* counter, int count, int wg) {
  if (count == 0) return;
  sync_warpgroup(wg);
  if (threadIdx.x % 128 == 0) {
    ptx::fence_acq_rel_gpu();
    ptx::red_release_gpu_add(counter, count);
  }
}

// counter += pending (then pending = 0) once the TMA stores of warpgroup `wg`'s pending
// tiles have completed (their readers use plain loads). Callers defer it until a reader
// needs the tiles, so the stores drain behind later mainloops instead of behind a wait.
__device__ __forceinline__ void publish_stored_tiles(int* counter, int& pending, int wg) {
  if (pending == 0) return;
  if (threadIdx.x % 128 == 0) {
    ptx::tma_store_wait_all();
    ptx::fence_proxy_async_global();
  }
  publish_count(counter, pending, wg);
  pending = 0;
}

// Four consecutive values of a bf16 slot row as fp32.
__device__ __forceinline__ float4 load4_streaming(const std::uint16_t* row, int c) {
  const uint2 bits = __ldcs(reinterpret_cast<const uint2*>(row) + c);
  const float2 lo = unpack_bf16x2(bits.x), hi = unpack_bf16x2(bits.y);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// out[t] = shared[t] + sum_j w[t,j] * slot[pair_row[t,j]] (kWeighted) or + slot (plain
// sum) for tokens [begin, end), two sets of 4 columns a thread, in fp32, rounded to bf16 once.
// A round issues kCombineSlots slots' loads for both column sets before its first add (the
// combine is bound by how many bytes are in flight); the adds then run in ascending j, round
// after round. shared may be null; pair_row -1 = no slot.
// kPushed (push combine): slot (t, j) is row t * k + j instead, present where ids >= 0.
// Rows of bf16 bits.
constexpr int kCombineSlots = 8;

// The slot row of (token, slot) pair `pair`, -1 for none: the plan's row, or (kPushed, the push
// combine) the pair itself where its expert id is valid.
template <bool kPushed>
__device__ __forceinline__ int combine_slot_row(int pair, const std::int32_t* pair_row, const std::int32_t* ids) {
  return kPushed ? (ids[pair] >= 0 ? pair : -1) : pair_row[pair];
}

// Before token `token` of [begin, end) is combined: its slot rows (and shared row) are bulk-
// prefetched into L2 `ahead` tokens early, one request a row from threads 0 .. k. ahead: up
// to 2 tokens, as long as the rows prefetched ahead stay within 192 KB a CTA (~25 MB of L2
// over 132 SMs). Measured on an H200: two tokens ahead took 2-3 % off the forward of
// qwen3-30b-a3b and olmoe-1b-7b (k H 4 = 64 KB a token) and added 2 % to deepseek-v3's FP8
// forward (229 KB a token: ~90 MB ahead, more than the L2 holds). Not inlined: inlined, it
// cost the FP8 kernel's consumers 48 bytes of spill.
template <bool kPushed>
__device__ __noinline__ void prefetch_combine_rows(int token, int begin, int end, int hidden, int top_k,
                                                   const std::int32_t* pair_row, const std::int32_t* ids,
                                                   const std::uint16_t* slots, const std::uint16_t* shared, int tid) {
  if (tid > top_k) return;
  const long long token_bytes = static_cast<long long>(top_k) * hidden * 2;
  const int ahead = static_cast<int>(min(2LL, (192LL << 10) / token_bytes));
  if (ahead == 0) return;
  const std::uint32_t bytes = static_cast<std::uint32_t>(hidden) * 2;
  for (int t = token == begin ? token : token + ahead; t <= token + ahead && t < end; ++t) {
    if (tid == top_k) {
      if (shared) ptx::bulk_prefetch_l2(shared + static_cast<std::int64_t>(t) * hidden, bytes);
      continue;
    }
    const int row = combine_slot_row<kPushed>(t * top_k + tid, pair_row, ids);
    if (row >= 0) ptx::bulk_prefetch_l2(slots + static_cast<std::int64_t>(row) * hidden, bytes);
  }
}

// A column block of the combine (kBlock; the backward in column blocks, BackwardParams::col_begin):
// `columns` columns of each row, the slot rows `slot_stride` elements apart, the shared and out
// rows `out_stride` apart (the callers offset the pointers to the block's first column).
struct CombineBlock {
  int columns, slot_stride, out_stride;
};

// prefetch_combine_rows for a column block (a function of its own: the forward's calls and
// code stay as they were).
template <bool kPushed>
__device__ __noinline__ void prefetch_combine_block_rows(int token, int begin, int end, CombineBlock block, int top_k,
                                                         const std::int32_t* pair_row, const std::int32_t* ids,
                                                         const std::uint16_t* slots, const std::uint16_t* shared, int tid) {
  if (tid > top_k) return;
  const long long token_bytes = static_cast<long long>(top_k) * block.columns * 2;
  const int ahead = static_cast<int>(min(2LL, (192LL << 10) / token_bytes));
  if (ahead == 0) return;
  const std::uint32_t bytes = static_cast<std::uint32_t>(block.columns) * 2;
  for (int t = token == begin ? token : token + ahead; t <= token + ahead && t < end; ++t) {
    if (tid == top_k) {
      if (shared) ptx::bulk_prefetch_l2(shared + static_cast<std::int64_t>(t) * block.out_stride, bytes);
      continue;
    }
    const int row = combine_slot_row<kPushed>(t * top_k + tid, pair_row, ids);
    if (row >= 0) ptx::bulk_prefetch_l2(slots + static_cast<std::int64_t>(row) * block.slot_stride, bytes);
  }
}

// kBlock: `block`'s columns and strides instead of hidden's.
template <bool kWeighted, bool kPushed, bool kBlock = false>
__device__ void combine_tokens(int begin, int end, int hidden, int top_k, const std::int32_t* pair_row,
                               const std::int32_t* ids, const float* weights, const std::uint16_t* slots,
                               const std::uint16_t* shared, std::uint16_t* out, int tid,
                               int threads, CombineBlock block = {}) {
  const int columns4 = (kBlock ? block.columns : hidden) / 4;
  const int slot_stride = kBlock ? block.slot_stride : hidden, out_stride = kBlock ? block.out_stride : hidden;
  for (int token = begin; token < end; ++token) {
    if constexpr (kBlock)
      prefetch_combine_block_rows<kPushed>(token, begin, end, block, top_k, pair_row, ids, slots, shared, tid);
    else
      prefetch_combine_rows<kPushed>(token, begin, end, hidden, top_k, pair_row, ids, slots, shared, tid);
    // Two column sets a thread a round (c and c + threads), each column's adds in the same order.
    for (int c0 = tid; c0 < columns4; c0 += 2 * threads) {
      const int c[2] = {c0, c0 + threads};
      const bool in[2] = {true, c[1] < columns4};
      float4 acc[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        acc[h] = shared && in[h] ? load4_streaming(shared + static_cast<std::int64_t>(token) * out_stride, c[h])
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
      for (int j0 = 0; j0 < top_k; j0 += kCombineSlots) {
        float4 v[2][kCombineSlots];
        float w[kCombineSlots];
        bool valid[kCombineSlots];
#pragma unroll
        for (int j = 0; j < kCombineSlots; ++j) {
          const int slot = j0 + j;
          const int pair = token * top_k + slot;
          int row = -1;
          if (slot < top_k) row = combine_slot_row<kPushed>(pair, pair_row, ids);
          valid[j] = row >= 0;  // -1: a padding slot, or past k
          w[j] = (kWeighted && valid[j]) ? weights[token * top_k + slot] : 1.0f;
          const std::uint16_t* slot_row = slots + static_cast<std::int64_t>(max(row, 0)) * slot_stride;  // (read only where valid)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            v[h][j] = valid[j] && in[h] ? load4_streaming(slot_row, c[h]) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int j = 0; j < kCombineSlots; ++j) {
            if (!valid[j]) continue;
            if constexpr (kWeighted) {
              acc[h].x = __fmaf_rn(w[j], v[h][j].x, acc[h].x);
              acc[h].y = __fmaf_rn(w[j], v[h][j].y, acc[h].y);
              acc[h].z = __fmaf_rn(w[j], v[h][j].z, acc[h].z);
              acc[h].w = __fmaf_rn(w[j], v[h][j].w, acc[h].w);
            } else {
              acc[h].x = __fadd_rn(acc[h].x, v[h][j].x);
              acc[h].y = __fadd_rn(acc[h].y, v[h][j].y);
              acc[h].z = __fadd_rn(acc[h].z, v[h][j].z);
              acc[h].w = __fadd_rn(acc[h].w, v[h][j].w);
            }
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (in[h])
          *reinterpret_cast<uint2*>(out + static_cast<std::int64_t>(token) * out_stride + 4 * c[h]) =
              uint2{pack_bf16x2(acc[h].x, acc[h].y), pack_bf16x2(acc[h].z, acc[h].w)};
    }
  }
}

}  // namespace mok::kernels
