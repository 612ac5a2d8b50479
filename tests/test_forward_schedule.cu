// The forward's task schedule on the host (kernels/forward/tasks.cuh). A consumer reads each GEMM
// task's decode from its producer's note (TaskNote) and works out alone, without loads, only the
// task's kind (TaskSchedule::kind_of: whether to publish its pending h rows first), a combine task
// (combine_task) and the note's slot (note_slot). Those must agree with the producer's decode of
// every task, in every order the kernels run: phase-major, interleaved (Config::interleave_rows),
// the ring's minibatches, GEMM1 only (the backward's recompute), with and without a shared expert
// — or a consumer would wait for a note that never comes, or publish too late for its own producer.
// A CPU test: the schedule's arithmetic and the plan's loads only, on host arrays.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/forward/tasks.cuh"

namespace mok {
namespace {

using kernels::ForwardParams;
using kernels::fwd::kCombine;
using kernels::fwd::kGemm1;
using kernels::fwd::kGemm2;
using kernels::fwd::kTaskNotes;
using kernels::fwd::Schedule;
using kernels::fwd::Task;

struct Order {
  int interleave_tiles = 0;
  int comm_ctas = 0, minibatch_rows = 0;  // the ring
  bool gemm1_only = false;
};

// A plan of `experts` segments, each padded to the 128-row M-tile (some empty).
std::vector<std::int32_t> expert_offsets(int experts, std::mt19937& rng) {
  std::vector<std::int32_t> offset(experts + 1, 0);
  std::uniform_int_distribution<int> rows(0, 700);
  for (int e = 0; e < experts; ++e) {
    const int r = rng() % 5 == 0 ? 0 : rows(rng);
    offset[e + 1] = offset[e] + (r + 127) / 128 * 128;
  }
  return offset;
}

void check_schedule(const ForwardParams& p, int ctas) {
  const Schedule whole(p, 0, 1);
  int combines = 0;
  for (int cta = 0; cta < ctas; ++cta) {
    const Schedule sched(p, cta, ctas);
    int ordinal = 0;
    for (int task = sched.cta; task < sched.total; task += sched.ctas, ++ordinal) {
      const Task t = sched.decode(p, task);
      ASSERT_EQ(sched.kind_of(p, task), t.kind) << "task " << task << " of CTA " << cta;
      EXPECT_EQ(sched.note_slot(task), ordinal % kTaskNotes) << "task " << task;
      if (t.kind == kCombine) {
        const Task c = sched.combine_task(task);
        EXPECT_TRUE(c.kind == kCombine && c.m == t.m && c.m >= 0 && c.m < sched.combine_tasks) << "task " << task;
        ++combines;
      } else {
        EXPECT_TRUE(t.m >= 0 && t.m < (t.shared ? sched.m_shared : sched.m_routed)) << "task " << task;
        EXPECT_TRUE(t.n >= 0 && t.n < (t.kind == kGemm1 ? sched.n1(t.shared) : sched.n2)) << "task " << task;
      }
    }
  }
  EXPECT_EQ(combines, p.gemm1_only ? 0 : whole.combine_tasks);
  // Every GEMM task's kind: the routed and shared GEMM1 / GEMM2 counts of the schedule.
  int g1 = 0, g2 = 0;
  for (int task = 0; task < whole.total; ++task) {
    const auto kind = whole.kind_of(p, task);
    g1 += kind == kGemm1, g2 += kind == kGemm2;
  }
  EXPECT_EQ(g1, whole.g1_shared_end);
  EXPECT_EQ(g2, p.gemm1_only ? 0 : whole.g2_shared_end - whole.g1_shared_end);
}

TEST(ForwardSchedule, ConsumersKindAndSlotAgreeWithTheProducersDecode) {
  std::mt19937 rng(20261207);
  const Order orders[] = {{}, {2, 0, 0, false}, {5, 0, 0, false}, {0, 0, 0, true}, {0, 4, 256, false}, {0, 4, 512, true}};
  for (int experts : {1, 3, 8, 32, 128})
    for (const Order& order : orders)
      for (int shared_inter : {0, 256})
        for (int round = 0; round < 3; ++round) {
          const std::vector<std::int32_t> offset = expert_offsets(experts, rng);
          const std::int32_t tiles = offset.back() / 128;
          ForwardParams p{};
          p.plan.expert_offset = offset.data();
          p.plan.num_tiles = &tiles;
          p.num_local_experts = experts;
          p.tokens = 1 + static_cast<int>(rng() % 3000);
          p.hidden = 128 * (1 + static_cast<int>(rng() % 60));
          p.inter = 128 * (1 + static_cast<int>(rng() % 24));
          p.shared_inter = shared_inter;
          p.shared_tiles = shared_inter > 0 ? (p.tokens + 127) / 128 : 0;
          p.interleave_tiles = order.interleave_tiles;
          p.ring.comm_ctas = order.comm_ctas;
          p.ring.minibatch_rows = order.minibatch_rows;
          p.gemm1_only = order.gemm1_only;
          SCOPED_TRACE(::testing::Message() << experts << " experts, " << tiles << " M-tiles, interleave "
                                            << order.interleave_tiles << ", ring " << order.minibatch_rows
                                            << ", gemm1 only " << order.gemm1_only << ", shared " << shared_inter);
          for (int ctas : {1, 7, 132}) check_schedule(p, ctas);
        }
}

}  // namespace
}  // namespace mok
