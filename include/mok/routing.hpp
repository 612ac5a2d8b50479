// Synthetic routings for tests, benchmarks and examples (no router involved).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mok {

enum class RoutingKind {
  uniform,      // k distinct experts per token, uniformly at random
  skewed,       // k distinct experts; slot 0 is expert 0 for ~90% of tokens (hot expert)
  one_expert,   // every valid slot goes to the same expert (k = 1 only, else slot j -> expert j)
  padded,       // uniform, with about a quarter of the slots set to -1
  first_half,   // uniform over the first half of the experts only: the rest get no rows
};

RoutingKind parse_routing_kind(const std::string& name);
const char* routing_kind_name(RoutingKind kind);

// [tokens, k] global expert ids in [-1, E), deterministic in `seed`.
std::vector<std::int32_t> make_routing(RoutingKind kind, std::int64_t tokens, std::int64_t num_experts,
                                       std::int64_t top_k, std::uint64_t seed);

// [tokens, k] positive weights that sum to 1 per token (over valid slots).
std::vector<float> make_routing_weights(const std::vector<std::int32_t>& ids, std::int64_t top_k,
                                        std::uint64_t seed);

}  // namespace mok
