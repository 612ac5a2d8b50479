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
  return add(b.d_shared_gate).add(b.d_shared_up).add(b.d_shared_down);
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

LaunchCache::~LaunchCache() {
  for (Graph& g : graphs_) cudaGraphExecDestroy(g.exec);  // (one still running is freed when it completes)
  if (capture_stream_) cudaStreamDestroy(capture_stream_);
}

LaunchCache::Choice LaunchCache::choose(const LaunchKey& key, cudaStream_t stream) {
  if (!enabled_) return Choice::direct;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // (e.g. the legacy stream while another thread captures: launch directly)
    return Choice::direct;
  }
  if (status != cudaStreamCaptureStatusNone) return Choice::direct;  // the caller's graph records the launches
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return Choice::direct;
  if (device_ < 0) device_ = device;
  if (device != device_) return Choice::direct;

  const std::uint64_t h = key.hash();
  for (std::size_t i = 0; i < graphs_.size(); ++i)
    if (graphs_[i].hash == h && graphs_[i].key == key) {
      graphs_[i].last_use = ++clock_;
      current_ = i;
      ++replays_;
      return Choice::replay;
    }
  if (std::find(seen_.begin(), seen_.end(), h) != seen_.end()) {
    pending_hash_ = h;
    return Choice::capture;
  }
  if (seen_.size() < kSeenKeys) seen_.push_back(h);
  else seen_[seen_next_++ % kSeenKeys] = h;
  return Choice::direct;
}

cudaStream_t LaunchCache::begin_capture(std::string_view where) {
  if (!capture_stream_) cuda_check(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking), where,
                                   "cudaStreamCreateWithFlags (the launch cache's capture stream)");
  cuda_check(cudaStreamBeginCapture(capture_stream_, cudaStreamCaptureModeThreadLocal), where,
             "cudaStreamBeginCapture (the launch cache)");
  return capture_stream_;
}

void LaunchCache::abandon_capture() {
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(capture_stream_, &graph);
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
}

void LaunchCache::end_capture(const LaunchKey& key, std::string_view where) {
  cudaGraph_t graph = nullptr;
  cuda_check(cudaStreamEndCapture(capture_stream_, &graph), where, "cudaStreamEndCapture (the launch cache)");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  cuda_check(made, where, "cudaGraphInstantiate (the launch cache)");
  if (graphs_.size() < kMaxGraphs) {
    graphs_.push_back({});
    current_ = graphs_.size() - 1;
  } else {  // the least recently used makes room
    current_ = static_cast<std::size_t>(std::min_element(graphs_.begin(), graphs_.end(), [](const Graph& a, const Graph& b) {
                                          return a.last_use < b.last_use;
                                        }) - graphs_.begin());
    cudaGraphExecDestroy(graphs_[current_].exec);
  }
  graphs_[current_] = Graph{key, pending_hash_, ++clock_, exec};
  if (++captures_ > 2 * kMaxGraphs && replays_ < captures_) enabled_ = false;  // graphs not reused: stop making them
}

void LaunchCache::replay(cudaStream_t stream, std::string_view where) {
  cuda_check(cudaGraphLaunch(graphs_[current_].exec, stream), where, "cudaGraphLaunch (the launch cache)");
}

}  // namespace mok::detail
