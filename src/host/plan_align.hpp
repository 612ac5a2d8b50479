// The plan's padding of each expert's rows, in M-tiles: one, or two in the MOK_DIAG_CLUSTER2 build
// (a cluster of two CTAs takes an expert's M-tiles in pairs, each pair sharing its B operand) and
// in MOK_DIAG_PAD256 (the same padding without clusters: what the padding alone costs).
#pragma once

#include <cstdint>

namespace mok::detail {

#if defined(MOK_DIAG_CLUSTER2) || defined(MOK_DIAG_PAD256)
inline constexpr std::int64_t kPlanAlignTiles = 2;
#else
inline constexpr std::int64_t kPlanAlignTiles = 1;
#endif

}  // namespace mok::detail
