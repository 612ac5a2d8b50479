// The kernels' pipeline alone (kernels/common/pipeline.cuh), without GEMMs: one producer thread
// fills kStages shared-memory stages with bulk copies (completing each stage's full barrier
// by its bytes, as TMA loads do) and two consumer warpgroups read every item and release its
// stage. Many passes over few stages exercise every wrap-around and parity flip; each item's
// words are checked where they are read (no stage is overwritten before both warpgroups have
// released it, none is read before its bytes landed), and the kernel must finish within its
// bounded waits (a deadlock would time out and be recorded). Each item also brings a note through
// producer_acquire's hook (as the forward's TaskNotes), read once its stage has landed and again
// after its release: its slot of kStages + 1 must not have been rewritten yet.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gpu_support.hpp"
#include "kernels/common/pipeline.cuh"
#include "kernels/common/persistent.cuh"
#include "mok/forward.hpp"  // wait_site_text
#include "mok/kernel_status.hpp"
#include "mok/ptx/tma.cuh"

namespace mok {
namespace {

constexpr int kWords = 16;  // 64 bytes an item (bulk copies: multiples of 16 bytes)

struct Counters {
  int* abort;
};

struct PipelineTestParams {  // what kernels/common/waits.cuh needs, plus the test's buffers
  Counters counters;
  KernelStatus* status;
  long long timeout_ns;
  const int* items;  // [n, kWords]
  int n;
  int* errors;       // words read wrong
  long long* sums;   // [2, n]: per consumer warpgroup, the sum of item i's words as read
};

__device__ int expected_word(int item, int w) { return item * 131 + w * 7 + 1; }
__device__ int note_word(int item) { return item * 7 + 3; }

template <int kStages>
__global__ void __launch_bounds__(384, 1) pipeline_kernel(const __grid_constant__ PipelineTestParams p) {
  struct alignas(128) Shared {
    int stages[kStages][kWords];
    kernels::PipelineBarriers<kStages> barriers;
    int notes[kStages + 1];  // a word a item, by item modulo kStages + 1 (the forward's TaskNote slots)
  };
  __shared__ Shared s;
  s.barriers.init(kernels::kConsumerWarpgroups);
  __syncthreads();
  kernels::Pipeline<kStages> pipe;
  if (threadIdx.x < 128) {  // producer warpgroup: its thread 0 issues every copy
    if (threadIdx.x != 0) return;
    for (int i = 0; i < p.n; ++i) {
      // (every item brings a note, written between its stage's empty wait and its full arrival)
      std::uint64_t* full = pipe.producer_acquire(p, s.barriers, i, kWords * 4, [&] { s.notes[i % (kStages + 1)] = note_word(i); });
      ptx::bulk_load(s.stages[pipe.stage()], p.items + i * kWords, kWords * 4, full);
      pipe.producer_commit();
    }
    return;
  }
  const int wg = (threadIdx.x - 128) / 128, lane = threadIdx.x % 128;
  for (int i = 0; i < p.n; ++i) {
    const int stage = pipe.consumer_wait(p, s.barriers, i);
    if (lane < kWords) {
      const int word = s.stages[stage][lane];
      if (word != expected_word(i, lane)) atomicAdd(p.errors, 1);
      // (a warp-level sum of the 16 words, written by lane 0)
      long long sum = word;
      for (int d = 8; d > 0; d /= 2) sum += __shfl_down_sync(0xffffu, sum, d, 16);
      if (lane == 0) p.sums[wg * p.n + i] = sum;
    }
    if (lane == 0 && s.notes[i % (kStages + 1)] != note_word(i)) atomicAdd(p.errors, 1);  // (landed with the stage)
    kernels::sync_warpgroup(wg);  // every read of the stage is done
    if (lane == 0) {
      pipe.consumer_release(s.barriers, stage);
      // The note stays until this consumer moves to the next item: the producer, at most kStages
      // stages (so items) ahead, does not reach this item's slot again.
      if (*static_cast<volatile int*>(&s.notes[i % (kStages + 1)]) != note_word(i)) atomicAdd(p.errors, 1);
    }
    pipe.consumer_advance();
  }
}

template <int kStages>
void run_pipeline(int n) {
  std::vector<int> items(static_cast<std::size_t>(n) * kWords);
  for (int i = 0; i < n; ++i)
    for (int w = 0; w < kWords; ++w) items[i * kWords + w] = i * 131 + w * 7 + 1;
  testing::DeviceBuffer<int> d_items(items), errors(1), abort_flag(1);
  testing::DeviceBuffer<long long> sums(2 * static_cast<std::size_t>(n));
  cudaMemset(errors.get(), 0, sizeof(int));
  cudaMemset(abort_flag.get(), 0, sizeof(int));
  cudaMemset(sums.get(), 0xff, sums.size() * sizeof(long long));
  KernelStatus* status = nullptr;
  ASSERT_EQ(cudaMallocManaged(&status, sizeof(KernelStatus)), cudaSuccess);
  *status = KernelStatus{};
  PipelineTestParams p{{abort_flag.get()}, status, 10'000'000'000LL, d_items.get(), n, errors.get(), sums.get()};
  pipeline_kernel<kStages><<<4, 384>>>(p);  // (CTAs are independent: 4 run the same pipeline)
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "timed out or failed at " << wait_site_text(status->site);
  EXPECT_EQ(status->code, KernelStatus::ok);
  EXPECT_EQ(errors.download()[0], 0)
      << "words or notes read before their bytes landed or after their stage (note slot) was refilled";
  const auto got = sums.download();
  for (int wg = 0; wg < 2; ++wg)
    for (int i = 0; i < n; ++i) {
      long long want = 0;
      for (int w = 0; w < kWords; ++w) want += i * 131 + w * 7 + 1;
      ASSERT_EQ(got[wg * n + i], want) << "warpgroup " << wg << ", item " << i;
    }
  cudaFree(status);
}

TEST(Pipeline, OneStageEveryItemWaitsForTheLast) {
  MOK_REQUIRE_HOPPER();
  run_pipeline<1>(300);
}

TEST(Pipeline, TwoStagesManyParityFlips) {
  MOK_REQUIRE_HOPPER();
  run_pipeline<2>(2001);
}

TEST(Pipeline, FourStagesLikeTheKernels) {
  MOK_REQUIRE_HOPPER();
  run_pipeline<4>(4099);
}

TEST(Pipeline, SevenStagesItemsNotAMultiple) {
  MOK_REQUIRE_HOPPER();
  run_pipeline<7>(1000);
}

}  // namespace
}  // namespace mok
