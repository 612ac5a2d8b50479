// Expert parallelism (EP). An EP group of N ranks splits the E experts: rank r holds
// experts [r * E_l, (r + 1) * E_l), E_l = E / N, and T tokens of its own. The forward
// exchanges the routing between ranks on the device, plans each rank from the routing of
// all ranks (rows of an expert in global token order), pulls the rows it needs from the
// ranks that own them, runs the fused GEMMs, and pushes each result row into the combine
// slot (t * k + j) of the rank that owns the token, which sums its slots in ascending j.
// Every sum has the same order on any number of ranks: results are bitwise equal to one
// GPU computing the N ranks' tokens together.
//
// VirtualRanks runs an EP group of N ranks on one GPU (separate workspaces, one launch
// whose CTAs are split among the ranks, the same device code as N GPUs): the protocol
// is tested without a multi-GPU machine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "mok/forward.hpp"
#include "mok/kernel_status.hpp"  // kMaxEpRanks

namespace mok {
namespace detail {
struct RankPeers;  // src/host/ep_step.hpp: one rank's view of its group, for the shared rank step
}  // namespace detail
namespace kernels {
struct EpPeers;
}


class VirtualRanks {
 public:
  // shape: one rank's view of the layer (num_experts = E of the group, num_local_experts =
  // E / ranks; ranks <= kMaxEpRanks); tokens_per_rank: T of every rank. config.compute_sms
  // (0 = all) is split evenly among the ranks. By default every rank's rows are pulled by
  // all its SMs before the fused kernel; with config.comm_sms > 0 (or config.ring_rows > 0:
  // one SM in 32) that many of each rank's SMs copy them into its ring of config.ring_rows
  // rows (0: room for every row), config.minibatch_rows at a time, while the others compute.
  // training: as for a Workspace.
  VirtualRanks(const MoeShape& shape, std::int64_t tokens_per_rank, const Config& config = {},
               Training training = Training::off);
  ~VirtualRanks();
  VirtualRanks(const VirtualRanks&) = delete;
  VirtualRanks& operator=(const VirtualRanks&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  const MoeShape& shape() const { return shape_; }
  std::int64_t tokens_per_rank() const { return tokens_; }
  Workspace& workspace(int rank);

  // args[r]: rank r's call, as mok::forward takes it: x [T, H], topk_ids [T, k] with
  // global expert ids (-1 = none), topk_weights, the weights of rank r's E_l experts, its
  // shared expert, y. Stream-ordered, no host synchronisation.
  // saved (Training::save): one tensor per rank, saved_elements() bf16 each, as for
  // mok::forward; the backward reads and consumes them. None: the forward saves nothing (a
  // forward for evaluation on the group that trains; any training mode).
  void forward(std::span<const ForwardArgs> args, cudaStream_t stream, std::span<const TensorView> saved = {});
  // Gradients of every rank's sum(y * dy): rank r's dx, d_topk_weights and the gradients
  // of its experts' weights; the shared expert's gradients are those of rank r's tokens
  // (a data-parallel framework sums them over ranks). Routed gradients, dx and
  // d_topk_weights are bitwise equal to one GPU's over all tokens.
  void backward(std::span<const ForwardArgs> fwd, std::span<const BackwardArgs> bwd, cudaStream_t stream,
                std::span<const TensorView> saved = {});
  // bf16 elements of each rank's saved tensor (Training::save).
  std::int64_t saved_elements() const;
  // Synchronises `stream` and throws mok::Error naming the rank (and peer) if a planner or
  // kernel of any rank recorded an error. A timed-out wait stops the kernel with a trap,
  // which leaves the CUDA context unusable: the process should report and exit.
  void check(cudaStream_t stream);

  // Tests of the bounded waits: rank `rank`'s kernel does nothing from the next forward on
  // (as a hung or crashed peer), so its peers must time out naming it; -1 clears it.
  void stall_rank_for_testing(int rank);

 private:
  int stalled_rank_ = -1;
  struct Rank;
  struct Launch;
  Launch prepare(std::span<const ForwardArgs> args, const char* where, bool weights);
  void set_peers(kernels::EpPeers& peers, int rank) const;
  detail::RankPeers peers(int rank, std::span<const void* const> x, std::span<const void* const> dy);
  MoeShape shape_;
  std::int64_t tokens_;
  Config config_;
  Training training_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

// One rank of an EP group whose ranks run separate launches: other GPUs (NCCL windows,
// PyTorch symmetric memory, peer access) or other streams of one GPU. Its peers are
// reached through a symmetric region: region_bytes() on every rank, identical layout,
// region_bases[q] = rank q's region as mapped in this process (this rank's own at
// [rank]). Every region must be zeroed and every rank constructed before any rank's first
// call; afterwards the ranks synchronise on the device only (call numbers kept in the
// region, flags between ranks, every wait bounded and naming its peer), so forward and
// backward are stream-ordered and survive CUDA-graph capture. Results are bitwise equal to
// VirtualRanks and to one GPU. Every rank of a group must be made with the same shape, T, Config
// and training: the region's layout follows them (Config::pull_fp8_rows, for one, decides how a
// rank lays out its tokens for its peers and how it reads theirs), and nothing on the device can
// tell a mismatch (mok.ep checks this across the ranks; a C++ caller must).
class EpRank {
 public:
  static std::int64_t region_bytes(const MoeShape& shape, std::int64_t tokens_per_rank);

  // peers_on_other_gpus: the regions of other ranks live on other GPUs (system-scope
  // ordering); false when every rank shares this GPU.
  EpRank(const MoeShape& shape, std::int64_t tokens_per_rank, int rank, std::span<void* const> region_bases,
         const Config& config = {}, Training training = Training::off, bool peers_on_other_gpus = true);
  ~EpRank();
  EpRank(const EpRank&) = delete;
  EpRank& operator=(const EpRank&) = delete;

  int rank() const { return rank_; }
  Training training() const { return training_; }
  int size() const { return static_cast<int>(bases_.size()); }
  Workspace& workspace() { return *ws_; }
  std::int64_t saved_elements() const { return ws_->saved_elements(); }

  // This rank's call, as for mok::forward / mok::backward (global expert ids; its experts'
  // weights). Every rank of the group must make the same sequence of calls. forward's saved:
  // as VirtualRanks::forward's (none: nothing saved, any training mode).
  void forward(const ForwardArgs& args, cudaStream_t stream, const std::optional<TensorView>& saved = std::nullopt);
  void backward(const ForwardArgs& fwd, const BackwardArgs& bwd, cudaStream_t stream,
                const std::optional<TensorView>& saved = std::nullopt);
  // Synchronises `stream`; throws mok::Error naming this rank (and the peer) on any error.
  void check(cudaStream_t stream);

 private:
  struct Layout;
  void begin(const ForwardArgs& args, const BackwardArgs* bwd, const unsigned long long* saved_marker,
             cudaStream_t stream, int backward_comm_ctas = 0);
  void set_peers(kernels::EpPeers& peers) const;
  std::span<const void* const> row_sources(std::span<const void* const> rows, const void** local, cudaStream_t stream);
  detail::RankPeers peers(std::span<const void* const> x, std::span<const void* const> dy);
  int ctas() const;
  MoeShape shape_;
  std::int64_t tokens_;
  int rank_;
  Config config_;
  Training training_;
  bool system_scope_;
  std::vector<char*> bases_;
  std::unique_ptr<Workspace> ws_;
  std::uint16_t* ring_ = nullptr;
  int* ring_counters_ = nullptr;
  std::uint16_t* recv_ = nullptr;  // Config::pull_tokens_once: [ep, T, H] the peers' tokens this rank needs
};

}  // namespace mok
