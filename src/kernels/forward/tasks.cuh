// The fused forward's shared storage, tasks and schedule (see kernels/forward/forward.cu's header):
// what each task is and in which order the CTAs take them.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/boxes.hpp"
#include "kernels/common/diag.cuh"
#include "kernels/ep/ep_push.cuh"
#include "kernels/forward/forward.cuh"
#include "kernels/forward/interleave.cuh"
#include "kernels/common/load.cuh"
#include "kernels/common/persistent.cuh"
#include "kernels/common/pipeline.cuh"
#include "kernels/ep/ring_copy.cuh"
#include "kernels/common/slot_rows.cuh"
#include "kernels/common/swiglu.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"
#include "mok/ptx/mbarrier.cuh"
#include "mok/ptx/tma.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok::kernels::fwd {

using namespace mok::ptx;

constexpr int kRowBytes = kBlockK * 2;
// Tokens of one combine task: kCombineTokens, or a diagnostic build's (kernels/common/diag.cuh).
inline constexpr int kForwardCombineTokens = MOK_DIAG_FWD_COMBINE_TOKENS > 0 ? MOK_DIAG_FWD_COMBINE_TOKENS : kCombineTokens;

enum TaskKind : int { kGemm1, kGemm2, kCombine };

struct Task {
  TaskKind kind;
  bool shared;  // the shared expert's tiles
  int m, n;     // M-tile (per set), N-tile; combine: token block in m
  int mb;       // ring: the minibatch of a routed GEMM1 tile (else -1)
};

// A GEMM task as its producer decoded it, handed to the consumers (SharedStorage::notes): the
// consumers then load nothing before their mainloop, where decoding a routed task is a binary
// search over the plan's expert offsets, then tile_row and tile_expert, dependent global loads
// the producer makes anyway, a task ahead. The producer writes task i's note between the empty
// wait and the full barrier's arrival of i's first stage; the consumers read it once their full
// wait on that stage returns (the arrival releases the writes, the wait acquires them), and keep
// reading it from shared memory until task i's epilogue is done (no registers held through the
// mainloop). Slots go by the CTA's task ordinal modulo kTaskNotes = kStages + 1: while the
// consumers are in task i, none of whose stages the producer may refill before they release
// them, the producer is at most kStages stages (so tasks) ahead, and never back at i's slot.
struct alignas(16) TaskNote {
  Task task;
  int row0;    // the tile's first plan row (shared expert: first token)
  int expert;  // its local expert (shared expert: 0)
};
inline constexpr int kTaskNotes = kStages + 1;
static_assert(sizeof(Task) == 20 && offsetof(Task, shared) == 4 && offsetof(Task, m) == 8 && offsetof(Task, n) == 12 &&
              offsetof(Task, mb) == 16 && offsetof(TaskNote, row0) == 20 && offsetof(TaskNote, expert) == 24,
              "TaskNoteView's offsets");

// A consumer's view of its task's note: the note's 32-bit shared-window address, each field
// loaded where it is used (LDS after the task's first full wait), so that nothing of it is held
// in registers through a mainloop (the FP8 consumers are at their register limit).
struct TaskNoteView {
  std::uint32_t address;
  __device__ __forceinline__ Task task() const {
    const uint4 v = ptx::ld_shared_v4_u32(address);  // kind, shared (its low byte), m, n
    return Task{static_cast<TaskKind>(v.x), (v.y & 0xffu) != 0, static_cast<int>(v.z), static_cast<int>(v.w),
                static_cast<int>(ptx::ld_shared_u32(address + 16))};
  }
  __device__ __forceinline__ int n() const { return static_cast<int>(ptx::ld_shared_u32(address + 12)); }
  __device__ __forceinline__ bool shared() const { return (ptx::ld_shared_u32(address + 4) & 0xffu) != 0; }
  __device__ __forceinline__ int row0() const { return static_cast<int>(ptx::ld_shared_u32(address + 20)); }
  __device__ __forceinline__ int expert() const { return static_cast<int>(ptx::ld_shared_u32(address + 24)); }
};

struct alignas(1024) SharedStorage {
  struct alignas(1024) Stage {
    std::uint16_t a[kBlockM * kBlockK];  // 16 KB
    std::uint16_t b[kBlockN * kBlockK];  // 32 KB
  } stages[kStages];
  union {
    std::uint16_t h_staging[kConsumerWarpgroups][2][64 * 64];  // per warpgroup: two 64-column panels
    CommShared comm;  // comm CTAs (which have no epilogues)
  };
  PipelineBarriers<kStages> barriers;
  PushedRows pushed[kConsumerWarpgroups];  // push combine: rows pushed, not yet published
  // The FP8 forward: stage i's 128 A rows' scale exponent bytes
  // (Fp8ForwardParams::x_exps / h_exps; within the struct's 1024-byte padding: no more shared memory).
  alignas(16) std::uint8_t a_exps[kStages][kBlockM];
  TaskNote notes[kTaskNotes];  // the decoded GEMM tasks (TaskNote; the slot: TaskSchedule::note_slot)
};
static_assert(kCommStagingBytes <= sizeof(SharedStorage::stages), "comm staging fits the stages");
static_assert(kCommWarps <= kThreads / 32);
static_assert(sizeof(SharedStorage::Stage) % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
static_assert(shared_storage_bytes<SharedStorage>() <= kMaxSharedMemoryBytes, "shared memory over the sm_90 opt-in limit");
static_assert(kBlockK * 2 == 128, "one K step is one 128-byte swizzle atom");
static_assert(kBlockN == 2 * kGemm1Columns && kBlockM == 64 * kConsumerWarpgroups);

constexpr std::uint32_t kStageBytesB = kBlockN * kRowBytes;
constexpr std::uint32_t kStageBytesA = kBlockM * kRowBytes;
// The host's boxes (kernels/common/boxes.hpp) are these tiles: A is one K-major box, B two
// (GEMM1: gate rows, then up rows) or one GEMM2 weight box; h leaves in 64 x 64 boxes.
static_assert(kBoxK.cols == kBlockK && kBoxK.rows == kBlockM && kStageBytesA == kBoxK.bytes(2));
static_assert(kStageBytesB == 2 * kBoxK.bytes(2) && kStageBytesB == kBoxDown.bytes(2) && kBoxDown.rows == kBlockN);
static_assert(kBoxMN.cols == kBlockK && kBoxMN.rows * kConsumerWarpgroups == kBlockM);

// K steps (64 of K each) of a bf16 GEMM task: GEMM1 runs over H, GEMM2 over its expert set's I.
__device__ __forceinline__ int gemm_k_steps(const ForwardParams& p, const Task& t) {
  return (t.kind == kGemm1 ? p.hidden : (t.shared ? p.shared_inter : p.inter)) / kBlockK;
}

// A GEMM task's first plan row and its local expert (the shared expert's: its first token, 0).
__device__ __forceinline__ int task_row0(const ForwardParams& p, const Task& t) {
  return t.shared ? t.m * kBlockM : p.plan.tile_row[t.m];
}
__device__ __forceinline__ int task_expert(const ForwardParams& p, const Task& t) {
  return t.shared ? 0 : p.plan.tile_expert[t.m];
}

// Ring: plan rows of minibatch mb (the last one may be short).
__device__ __forceinline__ int minibatch_rows(const ForwardParams& p, int mb) {
  return minibatch_rows(p.ring, p.plan.expert_offset[p.num_local_experts], mb);
}

// Task ranges of one launch; routed tile count comes from the device plan. The tile shape is
// the kernel's: kGemm1Cols h columns a GEMM1 task, kGemm2Cols columns of H a GEMM2 task, and
// kParts warpgroups publishing a part of each task (h_ready and y_done count parts): the
// cooperative kernels' tasks are 128 x 256 in two 64-row halves (Schedule), the ping-pong
// forward's 128 x 128 in one (kernels/forward/pingpong.cu). (Template constants, not members:
// one more register in the FP8 consumers cost them 20 bytes of spill.)
template <int kGemm1Cols, int kGemm2Cols, int kParts>
struct TaskSchedule {
  int cta, ctas;  // this CTA among the CTAs serving this rank: it takes tasks cta, cta + ctas, ...
  int m_routed, m_shared, n1_routed, n1_shared, n2, combine_tasks;
  int g1_routed_end, g1_shared_end, g2_routed_end, g2_shared_end, total;

  __host__ __device__ TaskSchedule(const ForwardParams& p, int cta_, int ctas_) : cta(cta_), ctas(ctas_) {
    m_routed = *p.plan.num_tiles;
    m_shared = p.shared_tiles;
    n1_routed = (p.inter + kGemm1Cols - 1) / kGemm1Cols;
    n1_shared = (p.shared_inter + kGemm1Cols - 1) / kGemm1Cols;
    n2 = (p.hidden + kGemm2Cols - 1) / kGemm2Cols;
    combine_tasks = (p.tokens + kForwardCombineTokens - 1) / kForwardCombineTokens;
    g1_routed_end = m_routed * n1_routed;
    g1_shared_end = g1_routed_end + m_shared * n1_shared;
    g2_routed_end = g1_shared_end + m_routed * n2;
    g2_shared_end = g2_routed_end + m_shared * n2;
    total = p.gemm1_only ? g1_shared_end : g2_shared_end + combine_tasks;
  }

  // Interleaved order: where the routed GEMM1 and GEMM2 tasks end (the shared expert's follow).
  __host__ __device__ int interleaved_routed_end() const { return g1_routed_end + (g2_routed_end - g1_shared_end); }

  // Inside a set of M-tiles, task i is N-tile i / tiles, M-tile first + i % tiles.
  __host__ __device__ static void split(int local, int first_tile, int tiles, Task& t) {
    t.n = local / tiles;
    t.m = first_tile + local % tiles;
  }

  // Ring: routed GEMM1 tasks minibatch by minibatch (N-tile-major inside one), so that
  // a minibatch is done with before later ones need its ring slots.
  __host__ __device__ void split_minibatch(const ForwardParams& p, int local, Task& t) const {
    const int per = p.ring.minibatch_rows / kBlockM;  // M-tiles of a full minibatch
    t.mb = local / (per * n1_routed);
    const int l = local - t.mb * per * n1_routed, tiles = per < m_routed - t.mb * per ? per : m_routed - t.mb * per;
    t.n = l / tiles;
    t.m = t.mb * per + l % tiles;
  }

  // Routed tasks: find the expert whose task range holds `local`, then split inside it. (Bands
  // of M-tiles, N-tile-major inside each, were measured for GEMM1 and GEMM2 and gained nothing:
  // bench/NOTES.md, the eighth session.)
  __host__ __device__ static void split_routed(const ForwardParams& p, int local, int n_tiles, Task& t) {
    const int e = expert_of_task(p.plan.expert_offset, p.num_local_experts, local, n_tiles, kBlockM);
    const int first = p.plan.expert_offset[e] / kBlockM;
    split(local - first * n_tiles, first, p.plan.expert_offset[e + 1] / kBlockM - first, t);
  }

  __host__ __device__ void split_interleaved(const ForwardParams& p, int local, Task& t) const {
    const InterleavedTask it = interleaved_task(m_routed, n1_routed, n2, p.interleave_tiles, local);
    t.kind = it.gemm2 ? kGemm2 : kGemm1, t.m = it.m, t.n = it.n;
  }

  __host__ __device__ Task decode(const ForwardParams& p, int task) const {
    Task t{kCombine, false, 0, 0, -1};
    if (p.interleave_tiles > 0) {  // [routed G1 and G2 interleaved | shared G1 | shared G2 | combine]
      const int routed_end = interleaved_routed_end(), shared_g1 = g1_shared_end - g1_routed_end;
      if (task < routed_end) {
        split_interleaved(p, task, t);
      } else if (task < routed_end + shared_g1) {
        t.kind = kGemm1, t.shared = true;
        split(task - routed_end, 0, m_shared, t);
      } else if (task < g2_shared_end) {
        t.kind = kGemm2, t.shared = true;
        split(task - routed_end - shared_g1, 0, m_shared, t);
      } else {
        t.m = task - g2_shared_end;
      }
      return t;
    }
    if (task < g1_routed_end) {
      t.kind = kGemm1;
      if (p.ring.comm_ctas > 0) split_minibatch(p, task, t);
      else split_routed(p, task, n1_routed, t);
    } else if (task < g1_shared_end) {
      t.kind = kGemm1, t.shared = true;
      split(task - g1_routed_end, 0, m_shared, t);
    } else if (task < g2_routed_end) {
      t.kind = kGemm2;
      split_routed(p, task - g1_shared_end, n2, t);
    } else if (task < g2_shared_end) {
      t.kind = kGemm2, t.shared = true;
      split(task - g2_routed_end, 0, m_shared, t);
    } else {
      t.m = task - g2_shared_end;
    }
    return t;
  }
  // (decode and kind_of are host-callable too: tests/test_forward_schedule.cu checks one against the other.)
  // Task `task`'s kind from the schedule's ranges alone (no loads): a consumer publishes its
  // pending h rows before a task that is not a GEMM1 tile (this CTA's own GEMM2 loads may wait
  // for them), so it must know the kind before it waits for the task's note.
  __host__ __device__ TaskKind kind_of(const ForwardParams& p, int task) const {
    if (task >= g2_shared_end) return kCombine;
    if (p.interleave_tiles > 0) {  // [routed G1 and G2 interleaved | shared G1 | shared G2], as decode()
      const int routed_end = interleaved_routed_end();
      if (task < routed_end) return interleaved_task(m_routed, n1_routed, n2, p.interleave_tiles, task).gemm2 ? kGemm2 : kGemm1;
      return task < routed_end + (g1_shared_end - g1_routed_end) ? kGemm1 : kGemm2;
    }
    return task < g1_shared_end ? kGemm1 : kGemm2;
  }
  // The note slot of this CTA's task `task` (its ordinal among the CTA's tasks, modulo kTaskNotes).
  __host__ __device__ int note_slot(int task) const { return (task - cta) / ctas % kTaskNotes; }
  // A combine task (kind_of's kCombine) as decode() gives it.
  __host__ __device__ Task combine_task(int task) const { return Task{kCombine, false, task - g2_shared_end, 0, -1}; }
  __host__ __device__ int n1(bool shared) const { return shared ? n1_shared : n1_routed; }
  // h_ready[m] once every GEMM1 task of M-tile m is done.
  __device__ int hidden_parts(bool shared) const { return kParts * n1(shared); }
  __device__ int slot_tiles_total() const { return kParts * (m_routed + m_shared) * n2; }
};
using Schedule = TaskSchedule<kGemm1Columns, kBlockN, kConsumerWarpgroups>;

// TaskNoteView's accessors from the consumers' own decode of the task (the plan's loads before the
// mainloop): the forward kernels built without notes (forward_task_notes() false: hidden above
// kTaskNotesMaxHidden or intermediate above kTaskNotesMaxInter, or a test's TaskNotes::off; an EP
// rank's FP8 consumers; the virtual-rank group kernels), and every launch of a MOK_DIAG_TASK_DECODE
// build (timing only, the same bits; bench/NOTES.md, forty-first and forty-second sessions).
struct DecodedTask {
  Task t;
  int row0_, expert_;
  __device__ __forceinline__ DecodedTask(const ForwardParams& p, const Schedule& sched, int task)
      : t(sched.decode(p, task)), row0_(task_row0(p, t)), expert_(task_expert(p, t)) {}
  __device__ __forceinline__ Task task() const { return t; }
  __device__ __forceinline__ int n() const { return t.n; }
  __device__ __forceinline__ bool shared() const { return t.shared; }
  __device__ __forceinline__ int row0() const { return row0_; }
  __device__ __forceinline__ int expert() const { return expert_; }
};
#if defined(MOK_DIAG_TASK_DECODE)
inline constexpr bool kDiagTaskDecode = true;
#else
inline constexpr bool kDiagTaskDecode = false;
#endif

// Consumer: GEMM task `task`'s note, once its first stage (the pipeline's current one) has
// landed; the mainloop's own wait for that stage then returns at once. The view stays valid
// until the consumer moves to its next task (TaskNote).
template <typename P, typename Sched>
__device__ __forceinline__ TaskNoteView wait_task_note(const P& p, SharedStorage& s, Pipeline<kStages>& pipe,
                                                       const Sched& sched, int task) {
  pipe.consumer_wait(p, s.barriers, task);
  return TaskNoteView{ptx::smem_address(&s.notes[sched.note_slot(task)])};
}

}  // namespace mok::kernels::fwd
