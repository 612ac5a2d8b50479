#include "mok/routing.hpp"

#include <algorithm>
#include <numeric>
#include <random>

#include "mok/error.hpp"

namespace mok {

RoutingKind parse_routing_kind(const std::string& name) {
  for (RoutingKind k : {RoutingKind::uniform, RoutingKind::skewed, RoutingKind::one_expert,
                        RoutingKind::padded, RoutingKind::first_half})
    if (name == routing_kind_name(k)) return k;
  throw_argument_error("mok::parse_routing_kind", "name",
                       "must be uniform, skewed, one_expert, padded or first_half, got '", name, "'");
}

const char* routing_kind_name(RoutingKind kind) {
  switch (kind) {
    case RoutingKind::uniform: return "uniform";
    case RoutingKind::skewed: return "skewed";
    case RoutingKind::one_expert: return "one_expert";
    case RoutingKind::padded: return "padded";
    case RoutingKind::first_half: return "first_half";
  }
  return "unknown";
}

std::vector<std::int32_t> make_routing(RoutingKind kind, std::int64_t T, std::int64_t E,
                                       std::int64_t k, std::uint64_t seed) {
  constexpr const char* where = "mok::make_routing";
  if (T < 0) throw_argument_error(where, "tokens", "must be >= 0, got ", T);
  if (k <= 0 || k > E) throw_argument_error(where, "top_k", "must be in [1, ", E, "], got ", k);
  const std::int64_t pool = kind == RoutingKind::first_half ? std::max<std::int64_t>(k, E / 2) : E;
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> ids(T * k);
  std::vector<std::int32_t> experts(pool);
  std::iota(experts.begin(), experts.end(), 0);
  for (std::int64_t t = 0; t < T; ++t) {
    std::int32_t* row = ids.data() + t * k;
    if (kind == RoutingKind::one_expert) {
      for (std::int64_t j = 0; j < k; ++j) row[j] = static_cast<std::int32_t>(j);
      continue;
    }
    // Partial Fisher-Yates: k distinct experts.
    for (std::int64_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<std::int64_t> pick(j, pool - 1);
      std::swap(experts[j], experts[pick(rng)]);
      row[j] = experts[j];
    }
    if (kind == RoutingKind::skewed && std::uniform_real_distribution<double>(0, 1)(rng) < 0.9) {
      auto hot = std::find(row, row + k, 0);
      if (hot != row + k) std::swap(*hot, row[0]);
      else row[0] = 0;
    }
    if (kind == RoutingKind::padded)
      for (std::int64_t j = 0; j < k; ++j)
        if (std::uniform_real_distribution<double>(0, 1)(rng) < 0.25) row[j] = -1;
  }
  return ids;
}

std::vector<float> make_routing_weights(const std::vector<std::int32_t>& ids, std::int64_t k,
                                        std::uint64_t seed) {
  if (k < 1 || ids.size() % static_cast<std::size_t>(k) != 0)
    throw_argument_error("mok::make_routing_weights", "top_k", "must be >= 1 and divide the ", ids.size(),
                         " ids ([tokens, top_k]), got ", k);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  std::vector<float> w(ids.size(), 0.0f);
  for (std::size_t t = 0; t * k < ids.size(); ++t) {
    float sum = 0.0f;
    for (std::int64_t j = 0; j < k; ++j)
      if (ids[t * k + j] >= 0) sum += (w[t * k + j] = u(rng));
    for (std::int64_t j = 0; j < k; ++j)
      if (sum > 0.0f) w[t * k + j] /= sum;
  }
  return w;
}

}  // namespace mok
