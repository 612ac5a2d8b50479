// Host pieces shared by the two EP front ends (VirtualRanks: every rank in one launch;
// EpRank: one rank per launch).
#pragma once

#include <algorithm>
#include <cstdint>

#include "mok/device_plan.hpp"
#include "mok/error.hpp"
#include "mok/types.hpp"

namespace mok::detail {

// Minibatches of the largest plan a rank can have, and the ring's rows (Config::ring_rows,
// or room for every row).
inline std::int64_t ring_minibatches(const MoeShape& shape, std::int64_t tokens, const Config& config) {
  constexpr std::int64_t kTile = 128;
  const PlanOptions options{kTile, config.capacity_factor > 0 ? plan_capacity_rows(shape, config, tokens, kTile) : 0};
  const std::int64_t capacity = device_plan_capacity_rows(shape, tokens, options);
  return (capacity + config.minibatch_rows - 1) / config.minibatch_rows;
}

inline std::int64_t ring_rows(const MoeShape& shape, std::int64_t tokens, const Config& config) {
  return config.ring_rows > 0 ? config.ring_rows : ring_minibatches(shape, tokens, config) * config.minibatch_rows;
}

// Comm CTAs of a rank with `ctas` CTAs: Config::comm_sms, or one in 32; none for a rank of
// one CTA (its rows are then pulled before the launch).
inline int comm_ctas(std::string_view where, const Config& config, int ctas) {
  if (config.comm_sms >= ctas)
    throw_argument_error(where, "comm_sms", "must leave each rank compute SMs: ", ctas, " SMs per rank, comm_sms = ",
                         config.comm_sms);
  return config.comm_sms > 0 ? config.comm_sms : ctas >= 2 ? std::max(1, ctas / 32) : 0;
}

}  // namespace mok::detail
