#include "mok/device_plan.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "kernels/plan/plan.cuh"
#include "cuda_check.hpp"
#include "mok/error.hpp"

namespace mok {
namespace {

void check_cuda(cudaError_t err, const char* what) { detail::cuda_check(err, "mok::DevicePlan", what); }

std::size_t round_up(std::size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

std::int64_t device_plan_capacity_rows(const MoeShape& shape, std::int64_t tokens, const PlanOptions& options) {
  validate(options, "mok::device_plan_capacity_rows");
  const std::int64_t block_m = options.block_m;
  std::int64_t rows = options.capacity_rows > 0 ? options.capacity_rows : plan_capacity_rows(shape, Config{}, tokens, block_m);
  rows = rows / block_m * block_m;  // whole tiles
  if (options.capacity_rows <= 0) rows = std::max(rows, block_m);  // T = 0 still gets one tile
  return rows;
}

DevicePlan::DevicePlan(const MoeShape& shape, std::int64_t tokens, const PlanOptions& options)
    : shape_(shape), max_tokens_(tokens), tokens_(tokens), block_m_(options.block_m) {
  validate(shape);
  if (tokens < 0) throw_argument_error("mok::DevicePlan", "tokens", "must be >= 0, got ", tokens);
  validate(options, "mok::DevicePlan");
  if (shape.num_local_experts > 4096)
    throw_argument_error("mok::DevicePlan", "num_local_experts", "must be at most 4096, got ", shape.num_local_experts);
  capacity_rows_ = device_plan_capacity_rows(shape, tokens, options);
  if (capacity_rows_ <= 0)
    throw_argument_error("mok::DevicePlan", "capacity_rows", "must hold at least one tile of ", block_m_, " rows, got ", options.capacity_rows);
  allocated_rows_ = capacity_rows_;

  const std::int64_t El = shape.num_local_experts;
  const std::size_t i32 = sizeof(std::int32_t);
  const std::size_t sizes[] = {
      round_up(i32 * El), round_up(i32 * (El + 1)), round_up(i32 * capacity_rows_),
      round_up(i32 * allocated_tiles()), round_up(i32 * allocated_tiles()), round_up(i32),
      round_up(i32 * tokens * shape.top_k), round_up(i32 * std::max<std::int64_t>(1, chunks_for(max_tokens_)) * El),
      round_up(sizeof(PlanStatus))};
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  check_cuda(cudaMalloc(&memory_, total), "cudaMalloc");
  char* at = static_cast<char*>(memory_);
  std::int32_t** fields[] = {&view_.expert_rows, &view_.expert_offset, &view_.row_pair,
                             &view_.tile_expert, &view_.tile_row,      &view_.num_tiles,
                             &view_.pair_row,    &view_.chunk_base};
  for (int i = 0; i < 8; ++i) {
    *fields[i] = reinterpret_cast<std::int32_t*>(at);
    at += sizes[i];
  }
  view_.status = reinterpret_cast<PlanStatus*>(at);
}

DevicePlan::~DevicePlan() {
  if (memory_) cudaFree(memory_);
}

std::int64_t DevicePlan::chunks_for(std::int64_t tokens) const {
  const std::int64_t ids = shape_.ep_size() * tokens * shape_.top_k;
  return (ids + kernels::kPlanChunk - 1) / kernels::kPlanChunk;
}

std::int64_t DevicePlan::num_chunks() const { return chunks_for(tokens_); }

void DevicePlan::set_tokens(std::int64_t tokens, std::int64_t capacity_rows) {
  constexpr const char* where = "mok::DevicePlan::set_tokens";
  if (tokens < 0 || tokens > max_tokens_)
    throw_argument_error(where, "tokens", "must be in [0, ", max_tokens_, "] (the plan's max_tokens), got ", tokens);
  std::int64_t rows = capacity_rows;
  if (rows <= 0) rows = std::min(allocated_rows_, device_plan_capacity_rows(shape_, tokens, PlanOptions{block_m_, 0}));
  if (rows <= 0 || rows % block_m_ != 0 || rows > allocated_rows_)
    throw_argument_error(where, "capacity_rows", "must be a positive multiple of ", block_m_, " and at most ",
                         allocated_rows_, " (the rows allocated), got ", rows);
  tokens_ = tokens;
  capacity_rows_ = rows;
}

void DevicePlan::check(cudaStream_t stream) const {
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  PlanStatus status{};
  check_cuda(cudaMemcpy(&status, view_.status, sizeof status, cudaMemcpyDeviceToHost), "reading the status");
  const std::int64_t k = shape_.top_k, T = tokens_;
  if (status.code == PlanStatus::expert_out_of_range)
    throw_argument_error("mok::plan_device", "topk_ids", "expert id must be in [-1, ", shape_.num_experts,
                         "), got ", status.value, " at rank ", status.index / (T * k), ", token ",
                         (status.index / k) % T, ", slot ", status.index % k);
  if (status.code == PlanStatus::capacity_exceeded)
    throw ArgumentError(detail::concat("mok::plan_device: capacity exceeded: routed rows need ", status.value,
                               " padded rows, capacity is ", status.limit,
                               " (raise Config::capacity_factor; from Python mok.ep.ExpertParallel("
                               "capacity_factor=...), 0 for room for every row)"));
  if (status.code == PlanStatus::ring_too_small)
    throw ArgumentError(detail::concat("mok::plan_device: the backward's ring token buffer is too small: local expert ",
                               status.index, " has ", status.value, " padded rows and the ring holds ", status.limit,
                               " rows; the ring must hold every minibatch an expert's rows touch (raise "
                               "Config::ring_rows to at least those rows + minibatch_rows - 128, or 0 for room for "
                               "every row)"));
  if (status.code != PlanStatus::ok)
    throw Error(detail::concat("mok::plan_device: unknown status code ", status.code));
}

Plan DevicePlan::to_host(cudaStream_t stream, std::int64_t rank) const {
  check(stream);
  const std::int64_t El = shape_.num_local_experts;
  Plan p;
  p.tokens = tokens_, p.top_k = shape_.top_k, p.ep_size = shape_.ep_size(), p.rank = rank;
  p.num_local_experts = El, p.block_m = block_m_, p.capacity_rows = capacity_rows_;
  auto copy = [](std::vector<std::int32_t>& out, const std::int32_t* src, std::int64_t n) {
    out.resize(n);
    if (n > 0) check_cuda(cudaMemcpy(out.data(), src, sizeof(std::int32_t) * n, cudaMemcpyDeviceToHost), "copying the plan");
  };
  copy(p.expert_rows, view_.expert_rows, El);
  copy(p.expert_offset, view_.expert_offset, El + 1);
  std::int32_t tiles = 0;
  check_cuda(cudaMemcpy(&tiles, view_.num_tiles, sizeof tiles, cudaMemcpyDeviceToHost), "copying the plan");
  copy(p.row_pair, view_.row_pair, p.expert_offset[El]);
  copy(p.tile_expert, view_.tile_expert, tiles);
  copy(p.tile_row, view_.tile_row, tiles);
  copy(p.pair_row, view_.pair_row, tokens_ * shape_.top_k);
  return p;
}

void plan_device(const TensorView& ids, std::int64_t rank, DevicePlan& plan, cudaStream_t stream, const RingFit& ring,
                 std::span<int> also_zero) {
  constexpr const char* where = "mok::plan_device";
  const MoeShape& s = plan.shape();
  const std::int64_t ep = s.ep_size(), T = plan.tokens(), k = s.top_k;
  if (ids.dtype != DType::i32 && ids.dtype != DType::i64)
    throw_dtype_error(where, "topk_ids", "dtype must be i32 or i64, got ", dtype_name(ids.dtype));
  if (ids.device.kind != DeviceKind::cuda)
    throw_argument_error(where, "topk_ids", "must be on a CUDA device, got ", device_name(ids.device));
  const bool shape_ok = (ids.ndim == 3 && ids.shape[0] == ep && ids.shape[1] == T && ids.shape[2] == k) ||
                        (ep == 1 && ids.ndim == 2 && ids.shape[0] == T && ids.shape[1] == k);
  if (!shape_ok)
    throw_argument_error(where, "topk_ids", "shape must be [", ep, ", ", T, ", ", k, "]",
                         ep == 1 ? " or [T, k]" : "", ", got ", ids.shape_string());
  if (!ids.is_contiguous()) throw_argument_error(where, "topk_ids", "must be contiguous");
  if (ids.numel() > 0 && ids.data == nullptr) throw_argument_error(where, "topk_ids", "data pointer is null");
  if (rank < 0 || rank >= ep) throw_argument_error(where, "rank", "must be in [0, ", ep, "), got ", rank);
  if (ep * T * k > INT32_MAX) throw_argument_error(where, "topk_ids", "ep*T*k must fit in int32, got ", ep * T * k);
  if (s.num_local_experts > kernels::kMaxPlanLocalExperts)  // (the scan kernel's shared memory)
    throw_argument_error(where, "num_local_experts", "must be at most ", kernels::kMaxPlanLocalExperts, ", got ",
                         s.num_local_experts);

  const DevicePlanView& v = plan.view();
  kernels::PlanProblem p{};  // (the planner's first kernel sets row_pair and pair_row to -1)
  p.ids = ids.data;
  p.ids_are_i64 = ids.dtype == DType::i64;
  p.num_ids = ep * T * k;
  p.tokens_times_k = T * k;
  p.rank = rank;
  p.num_experts = static_cast<std::int32_t>(s.num_experts);
  p.num_local_experts = static_cast<std::int32_t>(s.num_local_experts);
  p.block_m = static_cast<std::int32_t>(plan.block_m());
  p.capacity_rows = plan.capacity_rows();
  if (ring.ring_rows > 0 && (ring.minibatch_rows <= 0 || ring.minibatch_rows % plan.block_m() != 0 ||
                             ring.ring_rows % ring.minibatch_rows != 0))
    throw_argument_error(where, "ring", "minibatch_rows must be a positive multiple of ", plan.block_m(),
                         " and ring_rows a multiple of it, got ", ring.minibatch_rows, " and ", ring.ring_rows);
  p.ring_minibatch_rows = ring.minibatch_rows;
  p.ring_rows = ring.ring_rows;
  p.zero_words = also_zero.data();
  p.zero_count = static_cast<std::int64_t>(also_zero.size());
  kernels::launch_plan(p, v, stream);
  check_cuda(cudaGetLastError(), "launching the planner");
}

}  // namespace mok
