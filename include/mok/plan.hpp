// The schedule of one rank (docs/design.md §3): which routed rows this rank's experts
// receive, in which order, padded how, and the M-tiles the GEMMs walk.
//
// Rows of one expert are ordered by global pair id  (source_rank * T + token) * k + slot,
// i.e. by global token id, then slot. That fixes every sum's order independently of the
// number of ranks, which is what makes EP=1 and EP=N bitwise comparable.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "mok/types.hpp"

namespace mok {

struct PlanOptions {
  std::int64_t block_m = 128;         // each expert's segment is padded to a multiple of this
  std::int64_t capacity_rows = 0;     // rows of the plan table; 0 = plan_capacity_rows(worst case)
};

// Throws ArgumentError (named for `where`) unless block_m is a positive multiple of 64 up to 2^16
// and capacity_rows in [0, 2^31): the plan's row indices are int32.
void validate(const PlanOptions& options, std::string_view where);

// A decoded global pair id.
struct PairId {
  std::int32_t source_rank, token, slot;
};

inline PairId decode_pair(std::int32_t id, std::int64_t tokens, std::int64_t top_k) {
  const std::int64_t global_token = id / top_k;
  return {static_cast<std::int32_t>(global_token / tokens),
          static_cast<std::int32_t>(global_token % tokens), static_cast<std::int32_t>(id % top_k)};
}

struct Plan {
  std::int64_t tokens = 0;  // T per rank
  std::int64_t top_k = 0;
  std::int64_t ep_size = 1, rank = 0;
  std::int64_t num_local_experts = 0;
  std::int64_t block_m = 0;
  std::int64_t capacity_rows = 0;

  std::vector<std::int32_t> expert_rows;    // [E_l] routed rows of each local expert
  std::vector<std::int32_t> expert_offset;  // [E_l + 1] start of each padded segment
  std::vector<std::int32_t> row_pair;       // [expert_offset[E_l]] global pair id; -1 = padding
  std::vector<std::int32_t> tile_expert;    // [tiles] local expert of each M-tile
  std::vector<std::int32_t> tile_row;       // [tiles] first row of each M-tile
  std::vector<std::int32_t> pair_row;       // [T * k] this rank's own pairs: row in *its* plan
                                            //   when the expert is local, else -1 (EP=1: all)

  std::int64_t padded_rows() const { return expert_offset.empty() ? 0 : expert_offset.back(); }
  std::int64_t num_tiles() const { return static_cast<std::int64_t>(tile_expert.size()); }
  std::int64_t routed_rows() const;
};

// Plans rank `rank` of an EP group from the routing of every rank, [ep_size, T, k]
// (`all_topk_ids[(r * T + t) * k + j]`). Throws mok::Error on an id outside [-1, E),
// inconsistent sizes, or more padded rows than options.capacity_rows.
Plan plan_host(const MoeShape& shape, std::int64_t tokens, std::span<const std::int32_t> all_topk_ids,
               std::int64_t rank, const PlanOptions& options = {});

}  // namespace mok
