// Benchmark harness: times implementations of the layer on named presets and writes
// records in the schema shared with bench/torch_baseline.py:
//   preset, impl, pass, tokens, ep, ms (median), ms_p10, ms_p90, tflops, peak_bytes,
//   gpu, commit, date, hidden, intermediate, experts, top_k, routing, iters
//
// impls:
//   cublas cuBLAS GEMMs with the layer's FLOPs as if every routed row went to one expert
//          (fwd: X[M,H]·[gate|up]^T, h·down^T; fwd+bwd adds the four backward GEMMs):
//          the ceiling a grouped kernel is measured against
//   plan   the device planner alone (pass "plan"): its cost inside every pass
//   mok    the fused layer: "fwd" (forward), "fwd+bwd" (forward saving the pre-activations,
//          then the fused backward into bf16 gradients); the forward is checked first on
//          sampled tokens against the fp64 CPU reference, the backward's outputs for
//          finiteness (its exactness is the test suite's job). peak_bytes: what one pass
//          needs beyond its inputs and weights, like the PyTorch baseline's peak: the
//          workspace + y + the high-water mark of what the pass allocates from a caching
//          stream-ordered pool (scratch; fwd+bwd: saved tensor, dx, d_topk_weights, bf16
//          weight gradients, allocated when the backward runs), measured over one pass
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "mok/mok.hpp"

namespace {

#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) throw mok::Error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
  } while (0)
#define CUBLAS_OK(call)                                                                     \
  do {                                                                                      \
    cublasStatus_t s_ = (call);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) throw mok::Error(std::string(#call) + " failed: " + std::to_string(s_)); \
  } while (0)

struct Options {
  std::vector<std::string> presets{"all"};
  std::vector<std::string> impls{"mok", "cublas", "plan"};
  std::vector<std::string> passes{"fwd", "fwd+bwd"};
  int warmup = 3, iters = 20;
  mok::Config ep_config;  // mok-ep1: --comm-sms, --minibatch-rows, --ring-rows
  std::string out, commit = "unknown", date = "unknown";
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

struct Record {
  std::string preset, impl, pass;  // impl: cublas | plan
  std::int64_t tokens, ep, hidden, intermediate, experts, top_k;
  double ms, ms_p10, ms_p90, tflops;
  std::size_t peak_bytes;
  int iters;
};

// Device memory owned for one measurement, counted for peak_bytes.
class Arena {
 public:
  ~Arena() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <typename T>
  T* alloc(std::size_t n) {
    void* p = nullptr;
    CUDA_OK(cudaMalloc(&p, std::max<std::size_t>(1, n) * sizeof(T)));
    blocks_.push_back(p);
    bytes_ += n * sizeof(T);
    return static_cast<T*>(p);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  std::vector<void*> blocks_;
  std::size_t bytes_ = 0;
};

// A stream-ordered pool that keeps what is freed (a caching allocator, as PyTorch's):
// the memory one pass allocates, and its high-water mark.
class StepPool {
 public:
  explicit StepPool(cudaStream_t stream) : stream_(stream) {
    int device = 0;
    CUDA_OK(cudaGetDevice(&device));
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    CUDA_OK(cudaMemPoolCreate(&pool_, &props));
    std::uint64_t keep = ~std::uint64_t{0};
    CUDA_OK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  ~StepPool() {
    cudaStreamSynchronize(stream_);
    cudaMemPoolDestroy(pool_);
  }
  StepPool(const StepPool&) = delete;
  StepPool& operator=(const StepPool&) = delete;

  template <typename T>
  T* alloc(std::size_t n) {
    void* p = nullptr;
    CUDA_OK(cudaMallocFromPoolAsync(&p, std::max<std::size_t>(1, n) * sizeof(T), pool_, stream_));
    return static_cast<T*>(p);
  }
  void free(void* p) { CUDA_OK(cudaFreeAsync(p, stream_)); }
  static mok::TensorView u8(void* p, std::int64_t bytes) {
    return mok::TensorView::contiguous(p, mok::DType::u8, mok::Device::cuda(0), {bytes});
  }
  // Bytes in use at the highest point while `body` runs, above what was in use before.
  template <typename Body>
  std::size_t high_water(Body body) {
    CUDA_OK(cudaStreamSynchronize(stream_));
    std::uint64_t used = 0, zero = 0;
    CUDA_OK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used));
    CUDA_OK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero));  // (resets it to the current use)
    body();
    CUDA_OK(cudaStreamSynchronize(stream_));
    std::uint64_t high = 0;
    CUDA_OK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &high));
    return static_cast<std::size_t>(high - used);
  }

 private:
  cudaStream_t stream_;
  cudaMemPool_t pool_{};
};

// Fills bf16 buffers with small random values on the device (never time zeros).
__global__ void fill_random_kernel(std::uint16_t* p, std::size_t n, std::uint32_t seed);

// Times `body` with CUDA events: warm-up, then each iteration after an L2 flush.
template <typename Body>
std::vector<float> time_iterations(const Options& o, cudaStream_t stream, Body body) {
  static void* flush = nullptr;
  constexpr std::size_t kFlushBytes = 256u << 20;  // > 4x the H200's 60 MB L2
  if (!flush) CUDA_OK(cudaMalloc(&flush, kFlushBytes));
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (int i = 0; i < o.warmup; ++i) body();
  std::vector<float> ms;
  for (int i = 0; i < o.iters; ++i) {
    CUDA_OK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, stream));
    CUDA_OK(cudaEventRecord(start, stream));
    body();
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaEventSynchronize(stop));
    float t = 0;
    CUDA_OK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CUDA_OK(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms;
}

// Row-major C[M,N] = op(A)·op(B) in bf16 with fp32 accumulation (cuBLAS is column-major:
// compute C^T = op(B)^T·op(A)^T).
void gemm(cublasHandle_t h, bool ta, bool tb, int M, int N, int K, const void* A, const void* B, void* C) {
  const float one = 1.0f, zero = 0.0f;
  const int lda = ta ? M : K, ldb = tb ? K : N;
  CUBLAS_OK(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &one,
                         B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &zero, C, CUDA_R_16BF, N,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

Record bench_dense(const Options& o, const mok::Preset& p, const std::string& pass, cudaStream_t stream,
                   cublasHandle_t handle) {
  const mok::MoeShape& s = p.shape;
  Arena arena;
  struct Chain {  // one expert-like GEMM chain: M rows through an [I, H] SwiGLU MLP
    int M, H, I;
    std::uint16_t *x, *w1, *w2, *gu, *hid, *y, *dy, *dh, *dgu, *dx, *dw1, *dw2;
  };
  std::vector<Chain> chains;
  chains.push_back({static_cast<int>(p.tokens * s.top_k), static_cast<int>(s.hidden), static_cast<int>(s.intermediate)});
  if (s.has_shared()) chains.push_back({static_cast<int>(p.tokens), static_cast<int>(s.hidden), static_cast<int>(s.shared_intermediate)});
  const bool bwd = pass == "fwd+bwd";
  for (Chain& c : chains) {
    const std::size_t M = c.M, H = c.H, I = c.I;
    c.x = arena.alloc<std::uint16_t>(M * H), c.w1 = arena.alloc<std::uint16_t>(2 * I * H);
    c.w2 = arena.alloc<std::uint16_t>(H * I), c.gu = arena.alloc<std::uint16_t>(M * 2 * I);
    c.hid = arena.alloc<std::uint16_t>(M * I), c.y = arena.alloc<std::uint16_t>(M * H);
    if (bwd) {
      c.dy = arena.alloc<std::uint16_t>(M * H), c.dh = arena.alloc<std::uint16_t>(M * I);
      c.dgu = arena.alloc<std::uint16_t>(M * 2 * I), c.dx = arena.alloc<std::uint16_t>(M * H);
      c.dw1 = arena.alloc<std::uint16_t>(2 * I * H), c.dw2 = arena.alloc<std::uint16_t>(H * I);
    }
    std::uint32_t seed = 1;
    for (auto [ptr, n] : {std::pair{c.x, M * H}, {c.w1, 2 * I * H}, {c.w2, H * I}, {c.hid, M * I},
                          {bwd ? c.dy : nullptr, M * H}, {bwd ? c.dgu : nullptr, M * 2 * I}})
      if (ptr) fill_random_kernel<<<1024, 256, 0, stream>>>(ptr, n, seed++);
  }
  CUBLAS_OK(cublasSetStream(handle, stream));
  auto body = [&] {
    for (const Chain& c : chains) {
      gemm(handle, false, true, c.M, 2 * c.I, c.H, c.x, c.w1, c.gu);   // [M,H]·[2I,H]^T
      gemm(handle, false, true, c.M, c.H, c.I, c.hid, c.w2, c.y);      // [M,I]·[H,I]^T
      if (!bwd) continue;
      gemm(handle, false, false, c.M, c.I, c.H, c.dy, c.w2, c.dh);     // dgrad down
      gemm(handle, true, false, c.H, c.I, c.M, c.dy, c.hid, c.dw2);    // wgrad down
      gemm(handle, false, false, c.M, c.H, 2 * c.I, c.dgu, c.w1, c.dx);  // dgrad gate|up
      gemm(handle, true, false, 2 * c.I, c.H, c.M, c.dgu, c.x, c.dw1);   // wgrad gate|up
    }
  };
  const auto ms = time_iterations(o, stream, body);
  const double flops = mok::forward_flops(s, p.tokens * s.top_k, p.tokens) * (bwd ? 3.0 : 1.0);
  const double med = ms[ms.size() / 2];
  return {p.name, "cublas", pass, p.tokens, 1, s.hidden, s.intermediate, s.num_experts, s.top_k, med,
          ms[ms.size() / 10], ms[ms.size() * 9 / 10], flops / (med * 1e-3) / 1e12, arena.bytes(), o.iters};
}

Record bench_plan(const Options& o, const mok::Preset& p, cudaStream_t stream) {
  const mok::MoeShape& s = p.shape;
  const auto ids = mok::make_routing(mok::RoutingKind::uniform, p.tokens, s.num_experts, s.top_k, 7);
  Arena arena;
  std::int32_t* d_ids = arena.alloc<std::int32_t>(ids.size());
  // Async copy on the bench stream: a plain cudaMemcpy from pageable memory may return
  // before its DMA lands, and a non-blocking stream does not wait for it.
  CUDA_OK(cudaMemcpyAsync(d_ids, ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  mok::DevicePlan plan(s, p.tokens);
  const auto view = mok::TensorView::contiguous(d_ids, mok::DType::i32, mok::Device::cuda(0), {p.tokens, s.top_k});
  mok::plan_device(view, 0, plan, stream);
  const mok::Plan got = plan.to_host(stream, 0);  // correctness first
  const mok::Plan expected = mok::plan_host(s, p.tokens, ids, 0);
  if (got.row_pair != expected.row_pair || got.tile_row != expected.tile_row)
    throw mok::Error("mok_bench: device plan differs from the host plan on preset " + p.name);
  const auto ms = time_iterations(o, stream, [&] { mok::plan_device(view, 0, plan, stream); });
  const double med = ms[ms.size() / 2];
  return {p.name, "plan", "plan", p.tokens, 1, s.hidden, s.intermediate, s.num_experts, s.top_k, med,
          ms[ms.size() / 10], ms[ms.size() * 9 / 10], 0.0,
          static_cast<std::size_t>(plan.capacity_rows() * 4 * 3), o.iters};
}

__global__ void fill_random_kernel(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed * 0x9e3779b9u;
    h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12;
    const float v = (static_cast<float>(h & 0xffff) / 65535.0f - 0.5f) * 0.25f;  // |v| <= 1/8
    std::uint32_t bits;
    std::memcpy(&bits, &v, 4);
    p[i] = static_cast<std::uint16_t>(bits >> 16);
  }
}

// The fp64 reference of a few tokens: their experts' weights are copied back and
// renumbered into a small problem.
double check_sampled_tokens(const mok::MoeShape& s, std::int64_t T, const std::uint16_t* d_x, const std::uint16_t* d_gate,
                            const std::uint16_t* d_up, const std::uint16_t* d_down, const std::vector<std::int32_t>& ids,
                            const std::vector<float>& weights, const std::uint16_t* d_y) {
  const std::int64_t H = s.hidden, I = s.intermediate, k = s.top_k;
  const std::vector<std::int64_t> tokens{0, T / 3, T / 2, T - 1};
  mok::MoeShape small = s;
  std::vector<std::int32_t> experts;
  mok::reference::Routing r;
  std::vector<double> x, y_gpu;
  auto fetch = [](const std::uint16_t* src, std::int64_t offset, std::int64_t n) {
    std::vector<mok::bf16> host(n);
    CUDA_OK(cudaMemcpy(host.data(), src + offset, n * 2, cudaMemcpyDeviceToHost));
    return mok::reference::to_double(host);
  };
  mok::reference::Weights w;
  for (std::int64_t t : tokens) {
    auto xr = fetch(d_x, t * H, H), yr = fetch(d_y, t * H, H);
    x.insert(x.end(), xr.begin(), xr.end());
    y_gpu.insert(y_gpu.end(), yr.begin(), yr.end());
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = ids[t * k + j];
      auto at = std::find(experts.begin(), experts.end(), e);
      if (e >= 0 && at == experts.end()) {
        experts.push_back(e);
        auto g = fetch(d_gate, e * I * H, I * H), u = fetch(d_up, e * I * H, I * H), d = fetch(d_down, e * H * I, H * I);
        w.gate.insert(w.gate.end(), g.begin(), g.end());
        w.up.insert(w.up.end(), u.begin(), u.end());
        w.down.insert(w.down.end(), d.begin(), d.end());
        at = experts.end() - 1;
      }
      r.ids.push_back(e < 0 ? -1 : static_cast<std::int32_t>(at - experts.begin()));
      r.weights.push_back(weights[t * k + j]);
    }
  }
  // The sampled tokens' experts, renumbered; at least k of them so that top_k <= E holds
  // (unused extra experts get zero weights).
  small.num_experts = small.num_local_experts = std::max<std::int64_t>(k, static_cast<std::int64_t>(experts.size()));
  w.gate.resize(small.num_experts * I * H), w.up.resize(small.num_experts * I * H), w.down.resize(small.num_experts * H * I);
  const auto ref = mok::reference::forward(small, static_cast<std::int64_t>(tokens.size()), x, r, w);
  return mok::reference::relative_error(y_gpu, ref);
}

// impl "mok": the one-GPU kernels; "mok-ep1": the same layer through the expert-parallel
// machinery (routing exchange, peer pulls, push combine) as an EP group of one rank.
Record bench_mok(const Options& o, const mok::Preset& p, const std::string& impl, const std::string& pass,
                 cudaStream_t stream) {
  const bool ep1 = impl == "mok-ep1";
  const mok::MoeShape& s = p.shape;
  if (s.has_shared()) throw mok::Error("mok_bench: presets with a shared expert are not benchmarked");
  const std::int64_t T = p.tokens, H = s.hidden, I = s.intermediate, E = s.num_experts, k = s.top_k;
  Arena arena;
  auto* x = arena.alloc<std::uint16_t>(T * H);
  auto* gate = arena.alloc<std::uint16_t>(E * I * H);
  auto* up = arena.alloc<std::uint16_t>(E * I * H);
  auto* down = arena.alloc<std::uint16_t>(E * H * I);
  auto* y = arena.alloc<std::uint16_t>(T * H);
  auto* d_ids = arena.alloc<std::int32_t>(T * k);
  auto* d_weights = arena.alloc<float>(T * k);
  std::uint32_t seed = 11;
  for (auto [ptr, n] : {std::pair{x, T * H}, {gate, E * I * H}, {up, E * I * H}, {down, E * H * I}})
    fill_random_kernel<<<1024, 256, 0, stream>>>(ptr, n, seed++);
  const auto ids = mok::make_routing(mok::RoutingKind::uniform, T, E, k, 7);
  const auto weights = mok::make_routing_weights(ids, k, 7);
  CUDA_OK(cudaMemcpyAsync(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaMemcpyAsync(d_weights, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const bool bwd = pass == "fwd+bwd";
  mok::Workspace ws(s, T, {}, bwd ? mok::Training::save : mok::Training::off);
  const mok::Device dev = mok::Device::cuda(0);
  mok::ForwardArgs a;
  a.x = mok::TensorView::contiguous(x, mok::DType::bf16, dev, {T, H});
  a.topk_ids = mok::TensorView::contiguous(d_ids, mok::DType::i32, dev, {T, k});
  a.topk_weights = mok::TensorView::contiguous(d_weights, mok::DType::f32, dev, {T, k});
  a.w_gate = mok::TensorView::contiguous(gate, mok::DType::bf16, dev, {E, I, H});
  a.w_up = mok::TensorView::contiguous(up, mok::DType::bf16, dev, {E, I, H});
  a.w_down = mok::TensorView::contiguous(down, mok::DType::bf16, dev, {E, H, I});
  a.y = mok::TensorView::contiguous(y, mok::DType::bf16, dev, {T, H});
  CUDA_OK(cudaMemsetAsync(y, 0xff, T * H * 2, stream));
  // One GPU: what a pass allocates (scratch, saved tensor, gradients) comes from a caching
  // stream-ordered pool, as a framework's allocator would hand it out, and peak_bytes is
  // the pool's measured high-water mark over one pass + the workspace + y.
  StepPool pool(stream);
  auto forward = [&](const std::optional<mok::TensorView>& saved) {
    auto* scratch = pool.alloc<std::uint8_t>(ws.forward_scratch_bytes());
    mok::forward(a, ws, stream, saved, pool.u8(scratch, ws.forward_scratch_bytes()));
    pool.free(scratch);
  };
  std::unique_ptr<mok::VirtualRanks> group;
  if (ep1) {
    group = std::make_unique<mok::VirtualRanks>(s, T, o.ep_config, bwd ? mok::Training::save : mok::Training::off);
    if (!bwd) group->forward(std::span<const mok::ForwardArgs>(&a, 1), stream);
  } else {
    forward(std::nullopt);
  }
  if (!(ep1 && bwd)) {  // (the training forward needs its saved tensor: checked after the first step below)
    if (ep1) group->check(stream);
    else ws.check(stream);
    const double err = check_sampled_tokens(s, T, x, gate, up, down, ids, weights, y);
    if (!(err <= 1e-2))
      throw mok::Error("mok_bench: fused forward wrong on " + p.name + ": relative error " + std::to_string(err));
  }
  std::function<void()> step;
  std::uint16_t *dx = nullptr, *saved_fixed = nullptr;  // (one GPU: kept for the checks after the first step)
  float* d_tw = nullptr;
  if (ep1 && !bwd) {
    step = [&] { group->forward(std::span<const mok::ForwardArgs>(&a, 1), stream); };
  } else if (!bwd) {
    step = [&] { forward(std::nullopt); };
  } else {
    auto* dy = arena.alloc<std::uint16_t>(T * H);
    fill_random_kernel<<<1024, 256, 0, stream>>>(dy, T * H, seed++);
    const std::int64_t saved_n = ws.saved_elements();
    // One training step's tensors: saved (forward to backward), dx, d_topk_weights and the
    // bf16 weight gradients (allocated when the backward runs, as autograd does).
    auto grads = [=](std::uint16_t* dx_, float* d_tw_, void* dg, void* du, void* dd) {  // (by value: step outlives this block)
      mok::BackwardArgs b;
      b.dy = mok::TensorView::contiguous(dy, mok::DType::bf16, dev, {T, H});
      b.dx = mok::TensorView::contiguous(dx_, mok::DType::bf16, dev, {T, H});
      b.d_topk_weights = mok::TensorView::contiguous(d_tw_, mok::DType::f32, dev, {T, k});
      b.d_w_gate = mok::TensorView::contiguous(dg, mok::DType::bf16, dev, {E, I, H});
      b.d_w_up = mok::TensorView::contiguous(du, mok::DType::bf16, dev, {E, I, H});
      b.d_w_down = mok::TensorView::contiguous(dd, mok::DType::bf16, dev, {E, H, I});
      return b;
    };
    auto saved_view = [=](std::uint16_t* at) { return mok::TensorView::contiguous(at, mok::DType::bf16, dev, {saved_n}); };
    if (ep1) {  // the EP machinery owns its buffers: fixed tensors, peak not reported
      saved_fixed = arena.alloc<std::uint16_t>(saved_n);
      dx = arena.alloc<std::uint16_t>(T * H);
      d_tw = arena.alloc<float>(T * k);
      const mok::BackwardArgs b = grads(dx, d_tw, arena.alloc<std::uint16_t>(E * I * H),
                                        arena.alloc<std::uint16_t>(E * I * H), arena.alloc<std::uint16_t>(E * H * I));
      step = [&, b, saved_view] {
        const mok::TensorView sv = saved_view(saved_fixed);
        group->forward(std::span<const mok::ForwardArgs>(&a, 1), stream, std::span<const mok::TensorView>(&sv, 1));
        group->backward(std::span<const mok::ForwardArgs>(&a, 1), std::span<const mok::BackwardArgs>(&b, 1), stream,
                        std::span<const mok::TensorView>(&sv, 1));
      };
    } else {
      step = [&, grads, saved_view, saved_n] {
        auto* saved = pool.alloc<std::uint16_t>(saved_n);
        forward(saved_view(saved));
        auto* dx_ = pool.alloc<std::uint16_t>(T * H);
        auto* d_tw_ = pool.alloc<float>(T * k);
        auto* dg = pool.alloc<std::uint16_t>(E * I * H);
        auto* du = pool.alloc<std::uint16_t>(E * I * H);
        auto* dd = pool.alloc<std::uint16_t>(E * H * I);
        const std::int64_t bytes = ws.backward_scratch_bytes(mok::DType::bf16);
        auto* scratch = pool.alloc<std::uint8_t>(bytes);
        mok::backward(a, grads(dx_, d_tw_, dg, du, dd), ws, stream, saved_view(saved), pool.u8(scratch, bytes));
        for (void* q : {static_cast<void*>(scratch), static_cast<void*>(saved), static_cast<void*>(dg),
                        static_cast<void*>(du), static_cast<void*>(dd)})
          pool.free(q);
        if (dx == nullptr) dx = dx_, d_tw = d_tw_;  // the first step's, checked below
        else pool.free(dx_), pool.free(d_tw_);
      };
      CUDA_OK(cudaMemsetAsync(y, 0xff, T * H * 2, stream));
    }
    step();
    if (ep1) group->check(stream);
    else ws.check(stream);
    const double err = check_sampled_tokens(s, T, x, gate, up, down, ids, weights, y);
    if (!(err <= 1e-2))
      throw mok::Error("mok_bench: fused forward wrong on " + p.name + ": relative error " + std::to_string(err));
    std::vector<mok::bf16> dx_host(T * H);
    std::vector<float> dtw_host(T * k);
    CUDA_OK(cudaMemcpy(dx_host.data(), dx, T * H * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dtw_host.data(), d_tw, T * k * 4, cudaMemcpyDeviceToHost));
    for (mok::bf16 v : dx_host)
      if (!std::isfinite(v.to_float())) throw mok::Error("mok_bench: fused backward wrote a non-finite dx on " + p.name);
    for (float v : dtw_host)
      if (!std::isfinite(v)) throw mok::Error("mok_bench: fused backward wrote a non-finite d_topk_weights on " + p.name);
    if (!ep1) pool.free(dx), pool.free(d_tw);
  }
  std::size_t peak = 0;
  if (!ep1) {  // one pass, measured
    const std::size_t high = pool.high_water([&] { step(); });
    peak = static_cast<std::size_t>(ws.bytes()) + 2 * T * H + high;
  }
  const std::vector<float> ms = time_iterations(o, stream, step);
  if (ep1) group->check(stream);
  else ws.check(stream);
  const double med = ms[ms.size() / 2];
  const double flops = mok::forward_flops(s, T * k, T) * (bwd ? 3 : 1);
  return {p.name, impl, pass, T, 1, H, I, E, k, med, ms[ms.size() / 10], ms[ms.size() * 9 / 10],
          flops / (med * 1e-3) / 1e12, peak, o.iters};
}

void write_json(const Options& o, const std::vector<Record>& records, const std::string& gpu) {
  std::ostringstream js;
  js << "[\n";
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    js << "  {\"preset\": \"" << r.preset << "\", \"impl\": \"" << r.impl << "\", \"pass\": \"" << r.pass
       << "\", \"tokens\": " << r.tokens << ", \"ep\": " << r.ep << ", \"ms\": " << r.ms
       << ", \"ms_p10\": " << r.ms_p10 << ", \"ms_p90\": " << r.ms_p90 << ", \"tflops\": " << r.tflops
       << ", \"peak_bytes\": " << r.peak_bytes << ", \"gpu\": \"" << gpu << "\", \"commit\": \"" << o.commit
       << "\", \"date\": \"" << o.date << "\", \"hidden\": " << r.hidden << ", \"intermediate\": " << r.intermediate
       << ", \"experts\": " << r.experts << ", \"top_k\": " << r.top_k
       << ", \"routing\": \"uniform\", \"iters\": " << r.iters << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  js << "]\n";
  std::ofstream(o.out) << js.str();
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw mok::Error("mok_bench: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--preset") o.presets = split(next());
    else if (a == "--impl") o.impls = split(next());
    else if (a == "--pass") o.passes = split(next());
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--comm-sms") o.ep_config.comm_sms = std::stoi(next());
    else if (a == "--minibatch-rows") o.ep_config.minibatch_rows = std::stoll(next());
    else if (a == "--ring-rows") o.ep_config.ring_rows = std::stoll(next());
    else if (a == "--out") o.out = next();
    else if (a == "--commit") o.commit = next();
    else if (a == "--date") o.date = next();
    else {
      std::printf("usage: mok_bench [--preset all|NAME,...] [--impl mok,mok-ep1,cublas,plan] [--pass fwd,fwd+bwd]\n"
                  "                 [--iters N] [--warmup N] [--out FILE.json] [--commit C] [--date D]\n"
                  "                 [--comm-sms N] [--minibatch-rows N] [--ring-rows N]  (mok-ep1's Config)\n");
      return 2;
    }
  }
  if (o.iters < 1) throw mok::Error("mok_bench: --iters must be >= 1");
  if (mok::cuda_device_count() == 0) {
    std::fprintf(stderr, "mok_bench: no CUDA GPU found; the benchmark needs a Hopper GPU\n");
    return 3;
  }
  const mok::DeviceInfo dev = mok::query_device(0);
  if (!dev.is_hopper()) {
    std::fprintf(stderr, "mok_bench: GPU 0 is %s, not Hopper (sm_90)\n", dev.name.c_str());
    return 3;
  }
  std::vector<const mok::Preset*> chosen;
  for (const mok::Preset& p : mok::presets())
    if (o.presets == std::vector<std::string>{"all"} ? p.model_ep > 1 || p.tokens >= 8192
                                                     : std::count(o.presets.begin(), o.presets.end(), p.name) > 0)
      chosen.push_back(&p);
  for (const std::string& name : o.presets)
    if (name != "all") mok::find_preset(name);  // unknown names are an error
  for (const std::string& impl : o.impls)
    if (impl != "mok" && impl != "mok-ep1" && impl != "cublas" && impl != "plan")
      throw mok::Error("mok_bench: impl '" + impl + "' is not available (known: mok, mok-ep1, cublas, plan)");

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t handle;
  CUBLAS_OK(cublasCreate(&handle));
  std::vector<Record> records;
  std::printf("%-16s %-6s %-8s %10s %9s\n", "preset", "impl", "pass", "ms", "TFLOP/s");
  for (const mok::Preset* p : chosen)
    for (const std::string& impl : o.impls) {
      std::vector<std::string> passes = impl == "plan" ? std::vector<std::string>{"plan"} : o.passes;
      for (const std::string& pass : passes) {
        if (impl == "mok" || impl == "mok-ep1") records.push_back(bench_mok(o, *p, impl, pass, stream));
        else if (impl == "cublas") records.push_back(bench_dense(o, *p, pass, stream, handle));
        else records.push_back(bench_plan(o, *p, stream));
        const Record& r = records.back();
        std::printf("%-16s %-6s %-8s %10.4f %9.1f\n", r.preset.c_str(), r.impl.c_str(), r.pass.c_str(), r.ms, r.tflops);
        std::fflush(stdout);
        // Rewritten after every record: a run cut short (a machine's time limit) keeps what it measured.
        if (!o.out.empty()) write_json(o, records, dev.name);
      }
    }
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
