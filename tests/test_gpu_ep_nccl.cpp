// EpRank on regions from NCCL windows: one rank per GPU of this machine (one thread each),
// the same global problem split into ranks, bitwise equal to one GPU computing all of it.
// With one GPU the group has one rank (the EP = 1 path through NCCL's window).
#include <gtest/gtest.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include "gpu_problem.hpp"
#include "mok/ep.hpp"
#include "mok/ep_nccl.hpp"
#include "mok/error.hpp"

namespace mok {
namespace {

using testing::DeviceBuffer;

TEST(EpNccl, RanksOnNcclWindowsMatchOneGpuBitwise) {
  MOK_REQUIRE_HOPPER();
  const int ranks = std::min(cuda_device_count(), 8);
  const std::int64_t T = 256, H = 256, I = 256, k = 2, E = 8 * ranks;
  MoeShape global = testing::shape_of({"", T * ranks, H, I, E, k, 0, 0, RoutingKind::skewed});
  const HostProblem host = make_problem(global, T * ranks, RoutingKind::skewed, 5);
  std::vector<bf16> expected;
  {
    cudaSetDevice(0);
    testing::GpuProblem one(host);
    Workspace ws(global, host.tokens);
    forward(one.args(), ws, nullptr);
    ws.check(nullptr);
    expected = one.y.download();
  }
  MoeShape shape = global;
  shape.num_local_experts = E / ranks;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  Config once;  // the second group: each peer token pulled once, then gathered locally
  once.pull_tokens_once = true;
  const Config configs[2] = {Config{}, once};
  std::vector<std::vector<bf16>> outputs[2] = {std::vector<std::vector<bf16>>(ranks), std::vector<std::vector<bf16>>(ranks)};
  std::vector<std::string> errors(ranks);
  auto run_rank = [&](int r) {
    try {
      cudaSetDevice(r);
      ncclComm_t comm;
      if (ncclCommInitRank(&comm, ranks, id, r) != ncclSuccess) throw Error("ncclCommInitRank failed");
      const std::int64_t El = E / ranks;
      auto slice = [](const auto& v, std::int64_t begin, std::int64_t n) {
        return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + begin, v.begin() + begin + n);
      };
      DeviceBuffer<bf16> x(slice(host.x, r * T * H, T * H)), y(T * H);
      DeviceBuffer<std::int32_t> ids(slice(host.topk_ids, r * T * k, T * k));
      DeviceBuffer<float> weights(slice(host.topk_weights, r * T * k, T * k));
      DeviceBuffer<bf16> gate(slice(host.w_gate, r * El * I * H, El * I * H));
      DeviceBuffer<bf16> up(slice(host.w_up, r * El * I * H, El * I * H));
      DeviceBuffer<bf16> down(slice(host.w_down, r * El * H * I, El * H * I));
      const Device d = Device::cuda(r);
      ForwardArgs a;
      a.x = TensorView::contiguous(x.get(), DType::bf16, d, {T, H});
      a.topk_ids = TensorView::contiguous(ids.get(), DType::i32, d, {T, k});
      a.topk_weights = TensorView::contiguous(weights.get(), DType::f32, d, {T, k});
      a.w_gate = TensorView::contiguous(gate.get(), DType::bf16, d, {El, I, H});
      a.w_up = TensorView::contiguous(up.get(), DType::bf16, d, {El, I, H});
      a.w_down = TensorView::contiguous(down.get(), DType::bf16, d, {El, H, I});
      a.y = TensorView::contiguous(y.get(), DType::bf16, d, {T, H});
      for (int c = 0; c < 2; ++c) {
        NcclEpRegion region(comm, EpRank::region_bytes(shape, T));
        EpRank rank(shape, T, r, region.bases(), configs[c], Training::off, ranks > 1);
        for (int call = 0; call < 2; ++call) {
          cudaMemset(y.get(), 0xff, y.size() * sizeof(bf16));
          rank.forward(a, nullptr);
          rank.check(nullptr);
        }
        outputs[c][r] = y.download();
      }
      ncclCommDestroy(comm);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(run_rank, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
  for (int c = 0; c < 2; ++c) {
    std::vector<bf16> all;
    for (const auto& o : outputs[c]) all.insert(all.end(), o.begin(), o.end());
    ASSERT_EQ(all.size(), expected.size());
    EXPECT_TRUE(testing::same_bits(all, expected)) << ranks << " ranks over NCCL" << (c ? ", tokens pulled once" : "");
  }
}

}  // namespace
}  // namespace mok
