// The body every persistent kernel shares, written once: a kernel is a policy plugged into
// run_persistent(). The skeleton owns the order of the prologue — a stalled EP call stops
// at once; a call whose inputs are not valid poisons its outputs and stops; then the
// pipeline's barriers and the push counters are initialised, the kernel's own shared state
// set, and the CTA synchronised — and the role split: comm CTAs fill the ring, every other
// CTA runs the producer thread and the consumer warpgroups over its share of the schedule.
//
// A policy K is a type of static __device__ hooks, each called with the kernel's params p
// (and the extra arguments given to run_persistent), by every thread of the CTA unless noted.
// (Static hooks over the params, not an object holding references to them: a struct of
// references to __grid_constant__ params changed the backward's code.)
//   using Storage;                      shared storage: stages, barriers (PipelineBarriers),
//                                       pushed[kConsumerWarpgroups] (push-combine counters)
//   bool stalled(p);                    EP: this call was abandoned (a peer gave up)
//   bool inputs_valid(p, cta, ctas);    false: it has poisoned its outputs; the CTA stops
//   void init_shared(p, Storage&, cta); its own shared state and prefetches
//   bool is_comm(p, cta);               a comm CTA (no tasks)
//   void run_comm(p, extra..., Storage&, cta);
//   Schedule schedule(p, cta, ctas);    the CTA's share of the tasks
//   void produce(p, Storage&, const Schedule&);          (thread 0 of warpgroup 0)
//   void consume(p, Storage&, const Schedule&, int wg);  (consumer warpgroup wg)
//   int kProducerRegs, kConsumerRegs;   the register split (setmaxnreg; kernels/common/persistent.cuh)
//   int kStageReaders;                  consumer warpgroups that read (and release) each stage
#pragma once

#include "kernels/ep/ep.cuh"
#include "kernels/common/persistent.cuh"

namespace mok::kernels {

template <typename K, typename Params, typename... Extra>
__device__ __forceinline__ void run_persistent(const Params& p, int cta, int ctas, const Extra&... extra) {
  if (K::stalled(p)) return;
  if (!K::inputs_valid(p, cta, ctas)) return;
  typename K::Storage& s = shared_storage<typename K::Storage>();
  s.barriers.init(K::kStageReaders);
  if (threadIdx.x < kConsumerWarpgroups * 2 * kMaxEpRanks) (&s.pushed[0][0][0])[threadIdx.x] = 0;
  K::init_shared(p, s, cta);
  __syncthreads();
  if (K::is_comm(p, cta)) {  // comm CTAs copy rows and take no tasks
    K::run_comm(p, extra..., s, cta);
    return;
  }
  const auto sched = K::schedule(p, cta, ctas);
  static_assert(K::kProducerRegs * kProducerThreads + K::kConsumerRegs * 128 * kConsumerWarpgroups <=
                kLaunchRegisters * kThreads, "the register split exceeds the launch's allocation");
#if defined(MOK_DIAG_COPY_WARPS)  // (optional hook: void assist(p, Storage&, const Schedule&, int warp), warps 1-3)
  split_roles<K::kProducerRegs, K::kConsumerRegs>(
      [&] { K::produce(p, s, sched); }, [&](int wg) { K::consume(p, s, sched, wg); },
      [&](int warp) {
        if constexpr (requires { K::assist(p, s, sched, warp); }) K::assist(p, s, sched, warp);
      });
#else
  split_roles<K::kProducerRegs, K::kConsumerRegs>([&] { K::produce(p, s, sched); },
                                                      [&](int wg) { K::consume(p, s, sched, wg); });
#endif
}

}  // namespace mok::kernels
