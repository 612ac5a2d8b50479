// bench/tile_units.hpp: fp8_tile_rate's tile order visits every tile of the grid exactly once, for
// every kind of unit (a tile, a pair sharing B, a pair sharing A) and group size, and in the
// order it promises (M fastest inside a group of group_m M-tiles, then N, then the next group).
#include <gtest/gtest.h>

#include <vector>

#include "tile_units.hpp"

namespace {

using mok::bench::TileMN;
using mok::bench::unit_count;
using mok::bench::unit_tile;

struct Unit {
  int um, un;
};

TEST(BenchTileUnits, EveryTileOnceForEveryUnitAndGroup) {
  for (const Unit unit : {Unit{1, 1}, Unit{2, 1}, Unit{1, 2}}) {
    for (const int tiles_m : {2, 16, 64}) {
      for (const int tiles_n : {2, 16, 32}) {
        for (const int group_m : {2, 4, 16, 64}) {
          if (group_m > tiles_m || tiles_m % group_m) continue;
          std::vector<int> seen(tiles_m * tiles_n, 0);
          const int units = unit_count(tiles_m, tiles_n, unit.um, unit.un);
          EXPECT_EQ(units * unit.um * unit.un, tiles_m * tiles_n);
          for (int u = 0; u < units; ++u) {
            for (int rank = 0; rank < unit.um * unit.un; ++rank) {
              const TileMN t = unit_tile(u, rank, tiles_n, group_m, unit.um, unit.un);
              ASSERT_TRUE(t.m >= 0 && t.m < tiles_m && t.n >= 0 && t.n < tiles_n)
                  << "unit " << u << " rank " << rank << ": (" << t.m << ", " << t.n << ")";
              ++seen[t.m + t.n * tiles_m];
            }
          }
          for (int i = 0; i < tiles_m * tiles_n; ++i)
            ASSERT_EQ(seen[i], 1) << "tile (" << i % tiles_m << ", " << i / tiles_m << "), units " << unit.um << " x "
                                  << unit.un << ", grid " << tiles_m << " x " << tiles_n << ", groups of " << group_m;
        }
      }
    }
  }
}

TEST(BenchTileUnits, GroupsRunMFastestThenNThenTheNextGroup) {
  // 64 x 32 tiles in groups of 16 M-tiles (the layer's expert of 2048 rows): units 0-15 are
  // (0..15, 0), unit 16 is (0, 1), and the second group starts at unit 16 * 32 with M-tile 16.
  EXPECT_EQ(unit_tile(5, 0, 32, 16, 1, 1).m, 5);
  EXPECT_EQ(unit_tile(5, 0, 32, 16, 1, 1).n, 0);
  EXPECT_EQ(unit_tile(16, 0, 32, 16, 1, 1).m, 0);
  EXPECT_EQ(unit_tile(16, 0, 32, 16, 1, 1).n, 1);
  EXPECT_EQ(unit_tile(16 * 32, 0, 32, 16, 1, 1).m, 16);
  EXPECT_EQ(unit_tile(16 * 32, 0, 32, 16, 1, 1).n, 0);
  // one group of all M (the order before 2026-12-06): tile u is (u % tiles_m, u / tiles_m)
  EXPECT_EQ(unit_tile(70, 0, 32, 64, 1, 1).m, 6);
  EXPECT_EQ(unit_tile(70, 0, 32, 64, 1, 1).n, 1);
  // pairs sharing B: the two ranks take M-tiles 2i and 2i + 1 of one N-tile
  EXPECT_EQ(unit_tile(3, 1, 32, 16, 2, 1).m, 7);
  EXPECT_EQ(unit_tile(3, 1, 32, 16, 2, 1).n, 0);
  // pairs sharing A: N-tiles 2j and 2j + 1 of one M-tile
  EXPECT_EQ(unit_tile(16, 1, 32, 16, 1, 2).m, 0);
  EXPECT_EQ(unit_tile(16, 1, 32, 16, 1, 2).n, 3);
}

}  // namespace
