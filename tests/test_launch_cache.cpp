// The launch cache's policy (src/host/launch_cache.hpp), on the CPU: a key is launched directly
// the first time, captured the second, replayed after that; the least recently used graph makes
// room; a table whose graphs are not reused stops making them; keys that differ in any word are
// different calls.
#include <gtest/gtest.h>

#include <cstdint>

#include "host/launch_cache.hpp"

namespace mok::detail {
namespace {

using Choice = LaunchTable::Choice;

LaunchKey key_of(std::uint64_t a, std::uint64_t b = 0) {
  LaunchKey k;
  k.add(a).add(b);
  return k;
}

void* handle(std::uintptr_t n) { return reinterpret_cast<void*>(n); }

TEST(LaunchTable, DirectThenCaptureThenReplay) {
  LaunchTable t;
  const LaunchKey k = key_of(1);
  EXPECT_EQ(t.choose(k).choice, Choice::direct);
  EXPECT_EQ(t.choose(k).choice, Choice::capture);
  EXPECT_EQ(t.keep(k, handle(7)), nullptr);
  for (int i = 0; i < 3; ++i) {
    const auto d = t.choose(k);
    EXPECT_EQ(d.choice, Choice::replay);
    EXPECT_EQ(d.graph, handle(7));
  }
  EXPECT_EQ(t.captures(), 1);
  EXPECT_EQ(t.replays(), 3);
  EXPECT_EQ(t.choose(key_of(1, 1)).choice, Choice::direct) << "another word: another call";
  EXPECT_EQ(t.choose(key_of(2)).choice, Choice::direct);
}

TEST(LaunchTable, KeysDifferInEveryField) {
  const Device gpu = Device::cuda(0);
  const TensorView a = TensorView::contiguous(handle(4096), DType::bf16, gpu, {4, 64});
  TensorView other_ptr = a, other_shape = a, other_stride = a, other_dtype = a, other_device = a;
  other_ptr.data = handle(8192);
  other_shape.shape[0] = 5;
  other_stride.stride[0] = 128;
  other_dtype.dtype = DType::f32;
  other_device.device = Device::cuda(1);
  LaunchKey base;
  base.add(a);
  for (const TensorView* v : {&other_ptr, &other_shape, &other_stride, &other_dtype, &other_device}) {
    LaunchKey k;
    k.add(*v);
    EXPECT_FALSE(k == base);
    EXPECT_NE(k.hash(), base.hash());
  }
  LaunchKey same;
  same.add(a);
  EXPECT_TRUE(same == base);
  LaunchKey absent, present;
  absent.add(std::optional<TensorView>{});
  present.add(std::optional<TensorView>{a});
  EXPECT_FALSE(absent == present);
}

TEST(LaunchTable, LeastRecentlyUsedGraphMakesRoom) {
  LaunchTable t;
  const int n = LaunchTable::kMaxGraphs;
  for (int i = 0; i < n; ++i) {  // every key captured
    ASSERT_EQ(t.choose(key_of(i)).choice, Choice::direct);
    ASSERT_EQ(t.choose(key_of(i)).choice, Choice::capture);
    ASSERT_EQ(t.keep(key_of(i), handle(1000 + i)), nullptr);
  }
  for (int i = 1; i < n; ++i) ASSERT_EQ(t.choose(key_of(i)).choice, Choice::replay);  // key 0 is now the oldest
  ASSERT_EQ(t.choose(key_of(n)).choice, Choice::direct);
  ASSERT_EQ(t.choose(key_of(n)).choice, Choice::capture);
  EXPECT_EQ(t.keep(key_of(n), handle(1000 + n)), handle(1000)) << "key 0's graph is replaced";
  EXPECT_EQ(t.choose(key_of(0)).choice, Choice::capture) << "a key seen before is captured again";
  EXPECT_EQ(t.choose(key_of(n)).graph, handle(1000 + n));
  EXPECT_EQ(static_cast<int>(t.graphs().size()), n);
}

TEST(LaunchTable, StopsMakingGraphsThatAreNotReused) {
  LaunchTable t;
  // More keys than graphs, cycling: each graph is replaced before it is replayed.
  const int keys = LaunchTable::kMaxGraphs + 1;
  int captures = 0;
  for (int round = 0; round < 4 && t.enabled(); ++round)
    for (int i = 0; i < keys && t.enabled(); ++i) {
      const auto d = t.choose(key_of(i));
      ASSERT_NE(d.choice, Choice::replay);
      if (d.choice == Choice::capture) {
        t.keep(key_of(i), handle(i + 1));
        ++captures;
      }
    }
  EXPECT_FALSE(t.enabled());
  EXPECT_EQ(captures, 2 * LaunchTable::kMaxGraphs + 1);
  EXPECT_EQ(t.choose(key_of(0)).choice, Choice::direct) << "disabled: every call launches directly";
}

TEST(LaunchTable, DisabledLaunchesDirectly) {
  LaunchTable t;
  t.disable();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(t.choose(key_of(5)).choice, Choice::direct);
  EXPECT_EQ(t.captures(), 0);
}

}  // namespace
}  // namespace mok::detail
