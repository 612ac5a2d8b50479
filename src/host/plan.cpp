#include "mok/plan.hpp"

#include <limits>

#include "mok/error.hpp"

namespace mok {

void validate(const PlanOptions& options, std::string_view where) {
  // (a tile of more rows than 2^16 is no tile any kernel runs: they take 64 or 128; larger ones
  // wrapped the padded sizes in int32)
  constexpr std::int64_t kMaxBlockM = 1 << 16;
  if (options.block_m <= 0 || options.block_m % 64 != 0 || options.block_m > kMaxBlockM)
    throw_argument_error(where, "block_m", "must be a positive multiple of 64 up to ", kMaxBlockM, ", got ",
                         options.block_m);
  if (options.capacity_rows < 0 || options.capacity_rows > std::numeric_limits<std::int32_t>::max())
    throw_argument_error(where, "capacity_rows", "must be in [0, 2^31) (0: the worst case), got ", options.capacity_rows);
}

std::int64_t Plan::routed_rows() const {
  std::int64_t n = 0;
  for (std::int32_t r : expert_rows) n += r;
  return n;
}

Plan plan_host(const MoeShape& shape, std::int64_t T, std::span<const std::int32_t> ids,
               std::int64_t rank, const PlanOptions& opt) {
  constexpr const char* where = "mok::plan_host";
  validate(shape);
  const std::int64_t k = shape.top_k, El = shape.num_local_experts, ep = shape.ep_size();
  if (T < 0) throw_argument_error(where, "tokens", "must be >= 0, got ", T);
  if (rank < 0 || rank >= ep)
    throw_argument_error(where, "rank", "must be in [0, ", ep, "), got ", rank);
  validate(opt, where);
  if (static_cast<std::int64_t>(ids.size()) != ep * T * k)
    throw_argument_error(where, "all_topk_ids", "must hold ep_size*T*k = ", ep * T * k,
                         " ids, got ", ids.size());
  if (ep * T * k > std::numeric_limits<std::int32_t>::max())
    throw_argument_error(where, "tokens", "ep_size*T*k must fit in int32, got ", ep * T * k);

  Plan p;
  p.tokens = T, p.top_k = k, p.ep_size = ep, p.rank = rank, p.num_local_experts = El;
  p.block_m = opt.block_m;
  p.capacity_rows = opt.capacity_rows > 0 ? opt.capacity_rows
                                          : plan_capacity_rows(shape, Config{}, T, opt.block_m);
  p.capacity_rows = p.capacity_rows / opt.block_m * opt.block_m;  // whole tiles, as on the device

  const std::int64_t first_expert = rank * El;
  p.expert_rows.assign(El, 0);
  for (std::int64_t i = 0; i < ep * T * k; ++i) {
    const std::int32_t e = ids[i];
    if (e < -1 || e >= shape.num_experts)
      throw_argument_error(where, "topk_ids", "expert id must be in [-1, ", shape.num_experts,
                           "), got ", e, " at rank ", i / (T * k), ", token ", (i / k) % T,
                           ", slot ", i % k);
    if (e >= first_expert && e < first_expert + El) ++p.expert_rows[e - first_expert];
  }

  // The padded total in int64 first: the int32 offsets are written only once it fits the capacity.
  const auto padded = [&](std::int64_t e) { return (p.expert_rows[e] + opt.block_m - 1) / opt.block_m * opt.block_m; };
  std::int64_t padded_total = 0;
  for (std::int64_t e = 0; e < El; ++e) padded_total += padded(e);
  if (padded_total > p.capacity_rows)
    throw ArgumentError(detail::concat(where, ": capacity exceeded on rank ", rank, ": ", p.routed_rows(),
                               " routed rows need ", padded_total, " padded rows, capacity is ",
                               p.capacity_rows,
                               " (raise Config::capacity_factor; from Python mok.ep.ExpertParallel("
                               "capacity_factor=...), 0 for room for every row)"));
  if (padded_total > std::numeric_limits<std::int32_t>::max())  // (a default capacity may exceed them)
    throw_argument_error(where, "block_m", "pads the plan to ", padded_total, " rows, more than its int32 row "
                         "indices hold");
  p.expert_offset.assign(El + 1, 0);
  for (std::int64_t e = 0; e < El; ++e)
    p.expert_offset[e + 1] = static_cast<std::int32_t>(p.expert_offset[e] + padded(e));

  // Scanning ids in increasing global pair id appends each expert's rows in that order.
  p.row_pair.assign(p.padded_rows(), -1);
  std::vector<std::int32_t> fill(p.expert_offset.begin(), p.expert_offset.end() - 1);
  p.pair_row.assign(T * k, -1);
  for (std::int64_t i = 0; i < ep * T * k; ++i) {
    const std::int32_t e = ids[i];
    if (e < first_expert || e >= first_expert + El) continue;
    const std::int32_t row = fill[e - first_expert]++;
    p.row_pair[row] = static_cast<std::int32_t>(i);
    if (i / (T * k) == rank) p.pair_row[i % (T * k)] = row;
  }

  for (std::int64_t e = 0; e < El; ++e)
    for (std::int64_t row = p.expert_offset[e]; row < p.expert_offset[e + 1]; row += opt.block_m) {
      p.tile_expert.push_back(static_cast<std::int32_t>(e));
      p.tile_row.push_back(static_cast<std::int32_t>(row));
    }
  return p;
}

}  // namespace mok
