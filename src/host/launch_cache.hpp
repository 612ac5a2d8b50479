// A workspace's one-GPU calls replayed from CUDA graphs. A forward enqueues six launches (the
// planner's four, the row copy, the fused kernel), a backward eight; each launch costs the host
// ~4 µs on an H200 machine with the GPU busy, a graph launch of all six ~1.2–1.8 µs
// (bench/launch_cost.cu). Training repeats the same calls every step: the caching allocator hands
// each layer the same blocks, so a call's pointers, shapes and T — everything its launches'
// parameters are made from (the LaunchKey) — recur.
//
// Policy (LaunchTable, no CUDA in it: tests/test_launch_cache.cpp): a key seen for the first time
// is launched directly and remembered; seen again, its launches are captured once (on a private
// stream) into a graph kept for it; from then on the call is one graph launch. Launched directly
// instead: a stream that is being captured (the caller's own CUDA graph records the launches
// themselves), another device, a cache made disabled (Config::replay_launches), one whose graphs
// are not reused (more captures than replays after 2 x kMaxGraphs captures: token counts or
// pointers that never repeat), or one where a graph could not be made.
// A graph's parameters are values of the call that made it, so a replay runs the very launches
// a direct call with the same key would: the same bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "mok/validate.hpp"

namespace mok::detail {

// Every value one call's launch parameters are made from, as words.
class LaunchKey {
 public:
  LaunchKey() { words_.reserve(256); }
  LaunchKey& add(std::uint64_t word) {
    words_.push_back(word);
    return *this;
  }
  LaunchKey& add(const void* p) { return add(reinterpret_cast<std::uintptr_t>(p)); }
  LaunchKey& add(const TensorView& t);
  LaunchKey& add(const std::optional<TensorView>& t);
  LaunchKey& add(const ForwardArgs& a);
  LaunchKey& add(const BackwardArgs& b);
  std::uint64_t hash() const;
  bool operator==(const LaunchKey& other) const { return words_ == other.words_; }

 private:
  std::vector<std::uint64_t> words_;
};

// The bookkeeping: which keys have been seen, which have a graph (an opaque handle here), which
// graph goes when room is needed (least recently used), and when to stop making graphs.
class LaunchTable {
 public:
  static constexpr int kMaxGraphs = 256;  // per workspace: a model's layers of one shape (forward and backward: 2 x 61 for Kimi K2)
  static constexpr int kSeenKeys = 1024;  // keys remembered after their first (direct) call

  enum class Choice { direct, replay, capture };
  struct Decision {
    Choice choice;
    void* graph = nullptr;  // replay: the graph to launch
  };

  // For a call that may use a graph (not disabled, not inside a capture, the table's device).
  Decision choose(const LaunchKey& key);
  // After the capture that choose() asked for: keeps `graph` for `key`; returns the graph it
  // replaces (least recently used) for the caller to destroy, or null.
  void* keep(const LaunchKey& key, void* graph);
  void disable() { enabled_ = false; }
  bool enabled() const { return enabled_; }
  std::int64_t captures() const { return captures_; }
  std::int64_t replays() const { return replays_; }
  // Every graph held (to destroy them).
  std::vector<void*> graphs() const;

 private:
  struct Entry {
    LaunchKey key;
    std::uint64_t hash = 0, last_use = 0;
    void* graph = nullptr;
  };
  bool enabled_ = true;
  std::vector<Entry> entries_;
  std::vector<std::uint64_t> seen_;  // ring of hashes
  std::size_t seen_next_ = 0;
  std::uint64_t clock_ = 0;
  std::int64_t captures_ = 0, replays_ = 0;
};

class LaunchCache {
 public:
  explicit LaunchCache(bool enabled) {
    if (!enabled) table_.disable();
  }
  ~LaunchCache();
  LaunchCache(const LaunchCache&) = delete;
  LaunchCache& operator=(const LaunchCache&) = delete;

  // Enqueues on `stream` what enqueue(s) enqueues on stream s, directly or from the graph of `key`.
  // (enqueue may run twice: captured, then directly if no graph could be made of it; it only
  // enqueues work and reads host state.)
  template <typename Enqueue>
  void run(const LaunchKey& key, cudaStream_t stream, std::string_view where, Enqueue&& enqueue) {
    const LaunchTable::Decision d = may_replay(stream) ? table_.choose(key) : LaunchTable::Decision{LaunchTable::Choice::direct};
    if (d.choice == LaunchTable::Choice::replay) return launch(d.graph, stream, where);
    if (d.choice == LaunchTable::Choice::capture) {
      if (cudaStream_t capture = begin_capture()) {
        try {
          enqueue(capture);
        } catch (...) {
          if (cudaGraphExec_t partial = end_capture()) cudaGraphExecDestroy(partial);
          throw;
        }
        if (cudaGraphExec_t graph = end_capture()) {
          if (void* old = table_.keep(key, graph)) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(old));
          return launch(graph, stream, where);
        }
      }
      table_.disable();  // (no graph could be made: launch directly from now on)
    }
    enqueue(stream);
  }

  std::int64_t captures() const { return table_.captures(); }  // graphs made
  std::int64_t replays() const { return table_.replays(); }    // calls served by a graph made before them

 private:
  bool may_replay(cudaStream_t stream);
  cudaStream_t begin_capture();                 // null if capture could not begin
  cudaGraphExec_t end_capture();                // the instantiated graph, or null
  void launch(void* graph, cudaStream_t stream, std::string_view where);

  LaunchTable table_;
  int device_ = -1;
  cudaStream_t capture_stream_ = nullptr;
};

}  // namespace mok::detail
