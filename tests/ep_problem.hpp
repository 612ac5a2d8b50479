// The expert-parallel test problem shared by the EP test files: a global problem (ep * T
// tokens, E experts) split into the ranks of a group of virtual ranks on one GPU, the one-GPU
// result every group must reproduce bit for bit, and the backward's gradients per rank.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "gpu_grads.hpp"
#include "gpu_problem.hpp"
#include "mok/backward.hpp"
#include "mok/ep.hpp"
#include "mok/error.hpp"
#include "mok/plan.hpp"

namespace mok::testing {

struct EpCase {
  const char* name;
  int ep;
  std::int64_t tokens_per_rank, hidden, inter, experts, top_k, shared;
  float limit;
  RoutingKind routing;
};
inline void PrintTo(const EpCase& c, std::ostream* os) { *os << c.name; }

// The EP forward suites' cases (BF16: every one; FP8: those whose hidden and intermediate sizes
// are multiples of 128, its scale blocks).
inline std::vector<EpCase> ep_forward_cases(bool fp8 = false) {
  const EpCase all[] = {
      EpCase{"ep1_uniform", 1, 300, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
      EpCase{"ep2_uniform", 2, 300, 256, 256, 8, 2, 0, 0, RoutingKind::uniform},
      EpCase{"ep4_uniform", 4, 257, 512, 256, 16, 4, 0, 0, RoutingKind::uniform},
      EpCase{"ep8_uniform", 8, 200, 256, 384, 16, 2, 0, 0, RoutingKind::uniform},
      EpCase{"ep4_skewed", 4, 400, 256, 256, 8, 2, 0, 0, RoutingKind::skewed},
      EpCase{"ep4_idle_ranks", 4, 300, 256, 256, 16, 2, 0, 0, RoutingKind::first_half},
      EpCase{"ep8_padded_shared_clamp", 8, 150, 256, 256, 16, 4, 192, 0.75f, RoutingKind::padded},
      EpCase{"ep8_one_expert_per_rank_k1", 8, 129, 320, 192, 8, 1, 0, 0, RoutingKind::uniform},
      EpCase{"ep2_all_to_one_expert", 2, 200, 256, 256, 4, 1, 0, 0, RoutingKind::one_expert},
      // small enough for compute-sanitizer (scripts/gpu_check.sh)
      EpCase{"ep4_small_shared_padded_clamp", 4, 64, 256, 128, 8, 2, 128, 0.75f, RoutingKind::padded}};
  std::vector<EpCase> out;
  for (const EpCase& c : all)
    if (!fp8 || (c.hidden % 128 == 0 && c.inter % 128 == 0)) out.push_back(c);
  return out;
}

inline MoeShape global_shape(const EpCase& c) {
  return testing::shape_of({c.name, c.tokens_per_rank * c.ep, c.hidden, c.inter, c.experts, c.top_k, c.shared,
                            c.limit, c.routing});
}

inline MoeShape rank_shape(const EpCase& c) {
  MoeShape s = global_shape(c);
  s.num_local_experts = c.experts / c.ep;
  return s;
}

// The global problem split into ranks: rank r has tokens [r T, (r + 1) T) and experts
// [r E_l, (r + 1) E_l); every rank holds the same shared expert.
struct EpProblem {
  HostProblem host;
  int ep;
  std::int64_t T;
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> x, gate, up, down, y;
  std::vector<std::unique_ptr<DeviceBuffer<std::int32_t>>> ids;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> weights;
  std::unique_ptr<DeviceBuffer<bf16>> shared_gate, shared_up, shared_down;
  MoeShape shape;

  EpProblem(const EpCase& c, std::uint64_t seed)
      : host(make_problem(global_shape(c), c.tokens_per_rank * c.ep, c.routing, seed)), ep(c.ep), T(c.tokens_per_rank),
        shape(rank_shape(c)) {
    const std::int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_local_experts, k = shape.top_k;
    auto slice = [](const auto& v, std::int64_t begin, std::int64_t n) {
      return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + begin, v.begin() + begin + n);
    };
    for (int r = 0; r < ep; ++r) {
      x.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.x, r * T * H, T * H)));
      ids.push_back(std::make_unique<DeviceBuffer<std::int32_t>>(slice(host.topk_ids, r * T * k, T * k)));
      weights.push_back(std::make_unique<DeviceBuffer<float>>(slice(host.topk_weights, r * T * k, T * k)));
      gate.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.w_gate, r * El * I * H, El * I * H)));
      up.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.w_up, r * El * I * H, El * I * H)));
      down.push_back(std::make_unique<DeviceBuffer<bf16>>(slice(host.w_down, r * El * H * I, El * H * I)));
      y.push_back(std::make_unique<DeviceBuffer<bf16>>(T * H));
    }
    shared_gate = std::make_unique<DeviceBuffer<bf16>>(host.shared_gate);
    shared_up = std::make_unique<DeviceBuffer<bf16>>(host.shared_up);
    shared_down = std::make_unique<DeviceBuffer<bf16>>(host.shared_down);
  }

  std::vector<ForwardArgs> args() const {
    const Device d = Device::cuda(0);
    const std::int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_local_experts, k = shape.top_k;
    const std::int64_t Is = shape.shared_intermediate;
    std::vector<ForwardArgs> out(ep);
    for (int r = 0; r < ep; ++r) {
      ForwardArgs& a = out[r];
      a.x = TensorView::contiguous(x[r]->get(), DType::bf16, d, {T, H});
      a.topk_ids = TensorView::contiguous(ids[r]->get(), DType::i32, d, {T, k});
      a.topk_weights = TensorView::contiguous(weights[r]->get(), DType::f32, d, {T, k});
      a.w_gate = TensorView::contiguous(gate[r]->get(), DType::bf16, d, {El, I, H});
      a.w_up = TensorView::contiguous(up[r]->get(), DType::bf16, d, {El, I, H});
      a.w_down = TensorView::contiguous(down[r]->get(), DType::bf16, d, {El, H, I});
      if (shape.has_shared()) {
        a.shared_gate = TensorView::contiguous(shared_gate->get(), DType::bf16, d, {Is, H});
        a.shared_up = TensorView::contiguous(shared_up->get(), DType::bf16, d, {Is, H});
        a.shared_down = TensorView::contiguous(shared_down->get(), DType::bf16, d, {H, Is});
      }
      a.y = TensorView::contiguous(y[r]->get(), DType::bf16, d, {T, H});
    }
    return out;
  }

  // New tokens and routing for every rank (same experts): rows of a global problem `h`.
  void upload_tokens(const HostProblem& h, cudaStream_t stream) {
    const std::int64_t H = shape.hidden, k = shape.top_k;
    for (int r = 0; r < ep; ++r) {
      x[r]->upload(std::vector<bf16>(h.x.begin() + r * T * H, h.x.begin() + (r + 1) * T * H), stream);
      ids[r]->upload(std::vector<std::int32_t>(h.topk_ids.begin() + r * T * k, h.topk_ids.begin() + (r + 1) * T * k),
                     stream);
      weights[r]->upload(
          std::vector<float>(h.topk_weights.begin() + r * T * k, h.topk_weights.begin() + (r + 1) * T * k), stream);
    }
  }

  void poison_outputs() const {
    for (const auto& b : y) cudaMemset(b->get(), 0xff, b->size() * sizeof(bf16));
    cudaDeviceSynchronize();
  }

  // Every rank's y, in global token order.
  std::vector<bf16> outputs() const {
    std::vector<bf16> all;
    for (const auto& b : y) {
      const auto part = b->download();
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
};

// (mode: the group's training mode, its forward given no saved tensors — a forward for
// evaluation on a group that trains saves nothing and gives the same bits)
inline std::vector<bf16> run_group(const EpProblem& p, const Config& config = {}, Training mode = Training::off) {
  VirtualRanks group(p.shape, p.T, config, mode);
  p.poison_outputs();
  const auto args = p.args();
  group.forward(args, nullptr);
  group.check(nullptr);
  return p.outputs();
}

// One GPU, all tokens and all experts: the result every EP group must reproduce bit for bit.
inline std::vector<bf16> run_one_gpu(const HostProblem& host) {
  testing::GpuProblem gpu(host);
  Workspace ws(host.shape, host.tokens);
  gpu.poison_output();
  forward(gpu.args(), ws, nullptr);
  ws.check(nullptr);
  return gpu.y.download();
}


// Per rank: dy (its tokens' rows of one global dy), and every gradient it writes (bf16).
struct EpGrads {
  const EpProblem& p;
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> dy, dx, d_gate, d_up, d_down, d_sgate, d_sup, d_sdown;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dtw;

  EpGrads(const EpProblem& problem, const std::vector<bf16>& dy_all) : p(problem) {
    const MoeShape& s = p.shape;
    const std::int64_t T = p.T, H = s.hidden, I = s.intermediate, El = s.num_local_experts, k = s.top_k;
    const std::int64_t Is = s.shared_intermediate;
    for (int r = 0; r < p.ep; ++r) {
      dy.push_back(std::make_unique<DeviceBuffer<bf16>>(
          std::vector<bf16>(dy_all.begin() + r * T * H, dy_all.begin() + (r + 1) * T * H)));
      dx.push_back(std::make_unique<DeviceBuffer<bf16>>(T * H));
      dtw.push_back(std::make_unique<DeviceBuffer<float>>(T * k));
      d_gate.push_back(std::make_unique<DeviceBuffer<bf16>>(El * I * H));
      d_up.push_back(std::make_unique<DeviceBuffer<bf16>>(El * I * H));
      d_down.push_back(std::make_unique<DeviceBuffer<bf16>>(El * H * I));
      d_sgate.push_back(std::make_unique<DeviceBuffer<bf16>>(Is * H));
      d_sup.push_back(std::make_unique<DeviceBuffer<bf16>>(Is * H));
      d_sdown.push_back(std::make_unique<DeviceBuffer<bf16>>(H * Is));
    }
  }

  std::vector<BackwardArgs> args() const {
    const MoeShape& s = p.shape;
    const Device d = Device::cuda(0);
    const std::int64_t T = p.T, H = s.hidden, I = s.intermediate, El = s.num_local_experts, k = s.top_k;
    const std::int64_t Is = s.shared_intermediate;
    std::vector<BackwardArgs> out(p.ep);
    for (int r = 0; r < p.ep; ++r) {
      BackwardArgs& b = out[r];
      b.dy = TensorView::contiguous(dy[r]->get(), DType::bf16, d, {T, H});
      b.dx = TensorView::contiguous(dx[r]->get(), DType::bf16, d, {T, H});
      b.d_topk_weights = TensorView::contiguous(dtw[r]->get(), DType::f32, d, {T, k});
      b.d_w_gate = TensorView::contiguous(d_gate[r]->get(), DType::bf16, d, {El, I, H});
      b.d_w_up = TensorView::contiguous(d_up[r]->get(), DType::bf16, d, {El, I, H});
      b.d_w_down = TensorView::contiguous(d_down[r]->get(), DType::bf16, d, {El, H, I});
      if (s.has_shared()) {
        b.d_shared_gate = TensorView::contiguous(d_sgate[r]->get(), DType::bf16, d, {Is, H});
        b.d_shared_up = TensorView::contiguous(d_sup[r]->get(), DType::bf16, d, {Is, H});
        b.d_shared_down = TensorView::contiguous(d_sdown[r]->get(), DType::bf16, d, {H, Is});
      }
    }
    return out;
  }

  void poison() const {
    for (int r = 0; r < p.ep; ++r) {
      for (auto* v : {&dx, &d_gate, &d_up, &d_down, &d_sgate, &d_sup, &d_sdown})
        cudaMemset((*v)[r]->get(), 0xff, (*v)[r]->size() * sizeof(bf16));
      cudaMemset(dtw[r]->get(), 0xff, dtw[r]->size() * sizeof(float));
    }
    cudaDeviceSynchronize();
  }

  // Every rank's buffers of one kind, concatenated in rank order (= global order).
  template <typename T>
  static std::vector<T> concat(const std::vector<std::unique_ptr<DeviceBuffer<T>>>& v) {
    std::vector<T> all;
    for (const auto& b : v) {
      const auto part = b->download();
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
  // The shared expert's gradient summed over ranks (what data parallelism all-reduces).
  static std::vector<double> summed(const std::vector<std::unique_ptr<DeviceBuffer<bf16>>>& v) {
    std::vector<double> sum;
    for (const auto& b : v) {
      const auto part = reference::to_double(b->download());
      if (sum.empty()) sum.assign(part.size(), 0.0);
      for (std::size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
    }
    return sum;
  }
};

struct TrainRun {
  std::vector<bf16> dx, gate, up, down;
  std::vector<float> dtw;
  std::vector<double> sgate, sup, sdown;
};

inline bool same_grads(const TrainRun& a, const TrainRun& b) {
  return same_bits(a.dx, b.dx) && same_bits(a.dtw, b.dtw) && same_bits(a.gate, b.gate) && same_bits(a.up, b.up) &&
         same_bits(a.down, b.down) && a.sgate == b.sgate && a.sup == b.sup && a.sdown == b.sdown;
}

inline TrainRun train_group(const EpProblem& p, const EpGrads& g, Training mode, const Config& config = {}) {
  VirtualRanks group(p.shape, p.T, config, mode);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> saved;
  std::vector<TensorView> views;
  if (mode == Training::save)
    for (int r = 0; r < p.ep; ++r) {
      saved.push_back(std::make_unique<DeviceBuffer<bf16>>(group.saved_elements()));
      views.push_back(TensorView::contiguous(saved.back()->get(), DType::bf16, Device::cuda(0), {group.saved_elements()}));
    }
  p.poison_outputs();
  g.poison();
  const auto fa = p.args();
  const auto ba = g.args();
  group.forward(fa, nullptr, views);
  group.backward(fa, ba, nullptr, views);
  group.check(nullptr);
  // (a bf16 rank with peers keeps no room for routed dx rows: its dx tiles push them to the
  // tokens' owners, so the gradients above were made without it; detail::rank_slot_rows)
  for (int r = 0; r < p.ep; ++r)
    EXPECT_EQ(group.workspace(r).dx_rows() == nullptr, p.ep > 1 && config.precision == Precision::bf16)
        << "rank " << r << " of " << p.ep;
  return {EpGrads::concat(g.dx),        EpGrads::concat(g.d_gate),      EpGrads::concat(g.d_up),
          EpGrads::concat(g.d_down),    EpGrads::concat(g.dtw),         EpGrads::summed(g.d_sgate),
          EpGrads::summed(g.d_sup),     EpGrads::summed(g.d_sdown)};
}


// Every rank as its own EpRank on its own stream of this GPU (a share of the SMs each), as
// ranks on separate GPUs run: the ranks meet only through their symmetric regions.
struct SeparateRanks {
  std::vector<std::unique_ptr<DeviceBuffer<std::uint8_t>>> regions;
  std::vector<std::unique_ptr<EpRank>> ranks;
  std::vector<cudaStream_t> streams;

  SeparateRanks(const EpProblem& p, Training mode, Config config = {}) {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    config.compute_sms = sms / p.ep - 1;  // every rank's kernel resident at once
    std::vector<void*> bases;
    for (int r = 0; r < p.ep; ++r) {
      regions.push_back(std::make_unique<DeviceBuffer<std::uint8_t>>(EpRank::region_bytes(p.shape, p.T)));
      cudaMemset(regions.back()->get(), 0, regions.back()->size());
      bases.push_back(regions.back()->get());
    }
    cudaDeviceSynchronize();
    for (int r = 0; r < p.ep; ++r) {
      ranks.push_back(std::make_unique<EpRank>(p.shape, p.T, r, bases, config, mode, false));
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      streams.push_back(s);
    }
  }
  ~SeparateRanks() {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
  void check() {
    for (int r = 0; r < static_cast<int>(ranks.size()); ++r) ranks[r]->check(streams[r]);
  }
};

// Rows of the largest local expert (padded) and of the busiest rank, over every rank's plan.
struct RingNeeds {
  std::int64_t expert_rows = 0, rank_rows = 0;
};

inline RingNeeds ring_needs(const EpProblem& p) {
  RingNeeds n;
  for (int r = 0; r < p.ep; ++r) {
    const Plan plan = plan_host(p.shape, p.T, p.host.topk_ids, r);
    for (std::size_t e = 0; e + 1 < plan.expert_offset.size(); ++e)
      n.expert_rows = std::max<std::int64_t>(n.expert_rows, plan.expert_offset[e + 1] - plan.expert_offset[e]);
    n.rank_rows = std::max(n.rank_rows, plan.padded_rows());
  }
  return n;
}

// The smallest ring (a multiple of minibatch_rows) that holds an expert of `rows` rows
// wherever its rows start (128-row aligned).
inline std::int64_t tight_ring(std::int64_t rows, std::int64_t minibatch_rows) {
  return (rows + minibatch_rows - 128 + minibatch_rows - 1) / minibatch_rows * minibatch_rows;
}

}  // namespace mok::testing
