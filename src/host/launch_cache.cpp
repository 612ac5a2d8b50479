#include "launch_cache.hpp"

#include <algorithm>

#include "cuda_check.hpp"

namespace mok::detail {

LaunchKey& LaunchKey::add(const TensorView& t) {
  add(t.data).add((static_cast<std::uint64_t>(t.dtype) << 32) | static_cast<std::uint32_t>(t.ndim));
  add((static_cast<std::uint64_t>(t.device.kind) << 32) | static_cast<std::uint32_t>(t.device.index));
  for (int d = 0; d < t.ndim && d < TensorView::kMaxDims; ++d)
    add(static_cast<std::uint64_t>(t.shape[d])).add(static_cast<std::uint64_t>(t.stride[d]));
  return *this;
}

LaunchKey& LaunchKey::add(const std::optional<TensorView>& t) {
  add(std::uint64_t{t.has_value()});
  return t ? add(*t) : *this;
}

LaunchKey& LaunchKey::add(const ForwardArgs& a) {
  for (const TensorView* t : {&a.x, &a.topk_ids, &a.topk_weights, &a.w_gate, &a.w_up, &a.w_down, &a.y}) add(*t);
  add(a.shared_gate).add(a.shared_up).add(a.shared_down);
  add(std::uint64_t{a.fp8.has_value()});
  if (a.fp8)
    for (const TensorView* t : {&a.fp8->gate, &a.fp8->up, &a.fp8->down, &a.fp8->gate_exponents,
                                &a.fp8->up_exponents, &a.fp8->down_exponents})
      add(*t);
  return *this;
}

LaunchKey& LaunchKey::add(const BackwardArgs& b) {
  for (const TensorView* t : {&b.dy, &b.dx, &b.d_topk_weights, &b.d_w_gate, &b.d_w_up, &b.d_w_down}) add(*t);
  add(b.d_shared_gate).add(b.d_shared_up).add(b.d_shared_down);
  add(std::uint64_t{b.fp8.has_value()}).add(std::uint64_t{b.fp8_weight_gradients});
  if (b.fp8)
    for (const TensorView* t : {&b.fp8->down_t, &b.fp8->gate_up_t, &b.fp8->down_t_exponents, &b.fp8->gate_up_t_exponents})
      add(*t);
  return *this;
}

std::uint64_t LaunchKey::hash() const {
  std::uint64_t h = 0x9e3779b97f4a7c15ull ^ words_.size();
  for (std::uint64_t w : words_) {  // (splitmix64's finaliser on each word, chained)
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}

LaunchTable::Decision LaunchTable::choose(const LaunchKey& key) {
  if (!enabled_) return {Choice::direct};
  const std::uint64_t h = key.hash();
  for (Entry& e : entries_)
    if (e.hash == h && e.key == key) {
      e.last_use = ++clock_;
      ++replays_;
      return {Choice::replay, e.graph};
    }
  if (std::find(seen_.begin(), seen_.end(), h) != seen_.end()) return {Choice::capture};
  if (seen_.size() < kSeenKeys) seen_.push_back(h);
  else seen_[seen_next_++ % kSeenKeys] = h;
  return {Choice::direct};
}

void* LaunchTable::keep(const LaunchKey& key, void* graph) {
  void* replaced = nullptr;
  Entry* slot = nullptr;
  if (entries_.size() < kMaxGraphs) {
    slot = &entries_.emplace_back();
  } else {  // the least recently used makes room
    slot = &*std::min_element(entries_.begin(), entries_.end(),
                              [](const Entry& a, const Entry& b) { return a.last_use < b.last_use; });
    replaced = slot->graph;
  }
  *slot = Entry{key, key.hash(), ++clock_, graph};
  if (++captures_ > 2 * kMaxGraphs && replays_ < captures_) enabled_ = false;  // graphs not reused: stop making them
  return replaced;
}

std::vector<void*> LaunchTable::graphs() const {
  std::vector<void*> out;
  for (const Entry& e : entries_) out.push_back(e.graph);
  return out;
}

LaunchCache::~LaunchCache() {
  for (void* g : table_.graphs()) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g));  // (a running one is freed when it completes)
  if (capture_stream_) cudaStreamDestroy(capture_stream_);
}

bool LaunchCache::may_replay(cudaStream_t stream) {
  if (!table_.enabled()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // (e.g. the legacy stream while another thread captures: launch directly)
    return false;
  }
  if (status != cudaStreamCaptureStatusNone) return false;  // the caller's graph records the launches
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device_ < 0) device_ = device;
  return device == device_;
}

cudaStream_t LaunchCache::begin_capture() {
  if (!capture_stream_ && cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking) != cudaSuccess) {
    capture_stream_ = nullptr;
    (void)cudaGetLastError();
    return nullptr;
  }
  if (cudaStreamBeginCapture(capture_stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return capture_stream_;
}

cudaGraphExec_t LaunchCache::end_capture() {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (cudaStreamEndCapture(capture_stream_, &graph) == cudaSuccess && graph &&
      cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
    exec = nullptr;
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();  // (a failed capture is not the call's error: it runs directly)
  return exec;
}

void LaunchCache::launch(void* graph, cudaStream_t stream, std::string_view where) {
  cuda_check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), stream), where, "cudaGraphLaunch (the launch cache)");
}

}  // namespace mok::detail
