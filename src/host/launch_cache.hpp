// A workspace's one-GPU calls replayed from CUDA graphs. A forward enqueues six launches (the
// planner's four, the row copy, the fused kernel), a backward eight; each launch costs the host
// ~4.7 µs on an H200 machine with the GPU busy, a graph launch of all six ~1.8 µs
// (bench/launch_cost.cu). Training repeats the same calls every step: the caching allocator hands
// each layer the same blocks, so a call's pointers, shapes and T — everything its launches'
// parameters are made from (the LaunchKey) — recur.
//
// Policy: a key seen for the first time is launched directly and remembered; seen again, its
// launches are captured once (on a private stream) into a graph kept for it; from then on the
// call is one graph launch. Launched directly instead: a stream that is being captured (the
// caller's own CUDA graph records the launches themselves), another device, a cache made
// disabled (Config::replay_launches), or one whose graphs are not reused (more captures than
// replays after 2 x kMaxGraphs captures: token counts or pointers that never repeat).
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

class LaunchCache {
 public:
  static constexpr int kMaxGraphs = 256;  // per workspace: a model's layers of one shape (forward and backward: 2 x 61 for Kimi K2)
  static constexpr int kSeenKeys = 1024;  // keys remembered after their first (direct) call

  explicit LaunchCache(bool enabled) : enabled_(enabled) {}
  ~LaunchCache();
  LaunchCache(const LaunchCache&) = delete;
  LaunchCache& operator=(const LaunchCache&) = delete;

  // Enqueues on `stream` what enqueue(s) enqueues on stream s, directly or from the graph of `key`.
  template <typename Enqueue>
  void run(const LaunchKey& key, cudaStream_t stream, std::string_view where, Enqueue&& enqueue) {
    switch (choose(key, stream)) {
      case Choice::direct:
        enqueue(stream);
        return;
      case Choice::replay:
        break;
      case Choice::capture: {
        cudaStream_t capture = begin_capture(where);
        try {
          enqueue(capture);
        } catch (...) {
          abandon_capture();
          throw;
        }
        end_capture(key, where);
        break;
      }
    }
    replay(stream, where);
  }

  std::int64_t captures() const { return captures_; }  // graphs made
  std::int64_t replays() const { return replays_; }    // calls served by a graph made before them

 private:
  enum class Choice { direct, replay, capture };
  struct Graph {
    LaunchKey key;
    std::uint64_t hash = 0, last_use = 0;
    cudaGraphExec_t exec = nullptr;
  };
  Choice choose(const LaunchKey& key, cudaStream_t stream);
  cudaStream_t begin_capture(std::string_view where);
  void abandon_capture();
  void end_capture(const LaunchKey& key, std::string_view where);
  void replay(cudaStream_t stream, std::string_view where);

  bool enabled_;
  int device_ = -1;
  cudaStream_t capture_stream_ = nullptr;
  std::vector<Graph> graphs_;
  std::vector<std::uint64_t> seen_;  // ring of hashes
  std::size_t seen_next_ = 0;
  std::uint64_t clock_ = 0, pending_hash_ = 0;
  std::size_t current_ = 0;  // the graph replay() launches
  std::int64_t captures_ = 0, replays_ = 0;
};

}  // namespace mok::detail
