// The pipeline of the persistent kernels: kStages shared-memory stages that the producer
// thread fills with TMA loads and the consumer warpgroups read with wgmma. Stage i has two
// mbarriers: full[i] completes when its loads have landed (the producer's expect-tx arrival
// plus the bytes), empty[i] when every consumer warpgroup has released it. The state (stage
// index, and the barriers' parity, which flips each pass over the stages) lives in Pipeline;
// call sites only acquire, commit, wait and release.
//
//   producer:  full = producer_acquire(bytes) -> TMA loads into stages[stage()] on full
//              -> producer_commit()
//   consumer:  i = consumer_wait() -> wgmma on stages[i] -> consumer_advance() -> ...
//              -> consumer_release(i) once the MMAs that read stage i are done
// A producer may hand the consumers a few bytes with a stage (producer_acquire's note: the
// forward's decoded tasks); they read them after consumer_wait, before the stage is released.
#pragma once

#include <cstdint>

#include "kernels/common/waits.cuh"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/mbarrier.cuh"

namespace mok::kernels {

template <int kStages>
struct PipelineBarriers {
  std::uint64_t full[kStages];
  std::uint64_t empty[kStages];

  // Thread 0, before the roles split: full[i] expects one arrival (the producer's, with the
  // bytes), empty[i] one per consumer warpgroup that reads the stage.
  __device__ void init(int consumer_warpgroups) {
    if (threadIdx.x != 0) return;
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&full[i], 1);
      ptx::mbarrier_init(&empty[i], consumer_warpgroups);
    }
    ptx::fence_proxy_async_shared_cta();
  }
};

// One role's position in the pipeline (the producer and each consumer warpgroup keep their
// own): the stage it is at and the parity of the current pass.
template <int kStages>
class Pipeline {
 public:
  // Producer: waits (bounded) until the current stage is free, arms its full barrier for
  // `bytes` of loads and returns it; the loads go to stages[stage()].
  // note() runs between the stage's empty wait and its full barrier's arrival:
  // shared-memory writes that the consumers may read once their wait on that full barrier
  // returns (the arrival releases them, the wait acquires), and that the previous pass's
  // readers are done with (they released the stage). E.g. a task's TaskNote with its first stage.
  template <typename P, typename Note>
  __device__ __forceinline__ std::uint64_t* producer_acquire(const P& p, PipelineBarriers<kStages>& b, int task,
                                                             std::uint32_t bytes, Note&& note) {
    wait_barrier(p, &b.empty[index_], phase_ ^ 1u, task, WaitSite::stage_empty);  // free: the previous pass released it
    note();
    std::uint64_t* full = &b.full[index_];
    ptx::mbarrier_arrive_expect_tx(full, bytes);
    return full;
  }
  template <typename P>
  __device__ __forceinline__ std::uint64_t* producer_acquire(const P& p, PipelineBarriers<kStages>& b, int task,
                                                             std::uint32_t bytes) {
    return producer_acquire(p, b, task, bytes, [] {});
  }
  __device__ __forceinline__ int stage() const { return index_; }
  // Producer: the stage's loads are issued (they complete its full barrier by their bytes).
  __device__ __forceinline__ void producer_commit() { advance(); }

  // Consumer: waits (bounded) until the current stage's loads have landed; returns its index
  // (release it with consumer_release once its reads are done; consumer_advance moves on).
  template <typename P>
  __device__ __forceinline__ int consumer_wait(const P& p, PipelineBarriers<kStages>& b, int task) {
    wait_barrier(p, &b.full[index_], phase_, task, WaitSite::stage_full);
    return index_;
  }
  __device__ __forceinline__ void consumer_advance() { advance(); }
  // Consumer: moves past `steps` stages that another warpgroup reads (the ping-pong forward,
  // whose warpgroups take alternate tasks of one in-order stream of stages).
  __device__ __forceinline__ void consumer_skip(int steps) {
    const int passes = (index_ + steps) / kStages;
    index_ = (index_ + steps) - passes * kStages;
    phase_ ^= static_cast<std::uint32_t>(passes & 1);
  }
  // Consumer (one thread of the warpgroup): stage `index` may be refilled.
  __device__ __forceinline__ void consumer_release(PipelineBarriers<kStages>& b, int index) {
    ptx::mbarrier_arrive(&b.empty[index]);
  }

 private:
  __device__ __forceinline__ void advance() {
    if (++index_ == kStages) {
      index_ = 0;
      phase_ ^= 1u;
    }
  }

  int index_ = 0;
  std::uint32_t phase_ = 0;
};

}  // namespace mok::kernels
