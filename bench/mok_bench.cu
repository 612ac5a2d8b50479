// Benchmark harness of the C++ layer. Two ways to run it:
//
//   mok_bench [--preset all|NAME,...] [--impl mok,mok-ep1,cublas,plan] ...   (standalone)
//       times implementations on named presets, with its own inputs (uniform routing), and
//       writes records in the schema shared with bench/torch_baseline.py:
//       preset, impl, pass, tokens, ep, ms (median), ms_p10, ms_p90, tflops, peak_bytes,
//       gpu, commit, date, hidden, intermediate, experts, top_k, routing, iters
//   mok_bench --serve
//       the "mok" implementation of bench/layer_bench.py: reads one command a line on
//       stdin and answers one JSON line on stdout, so that the Python driver interleaves
//       it with the PyTorch implementations on the very same inputs:
//         load PRESET SEED IDS_FILE WEIGHTS_FILE  inputs: x, weights, dy from fill_bits
//                                                 (seeded as layer_bench.py's hash_fill),
//                                                 routing from the files (i32 / f32 [T, k])
//         check PASS                              one pass with poisoned outputs; answers the
//                                                 checksum of each output (y, dx, d_topk_weights,
//                                                 every weight gradient): the driver compares
//                                                 them with mok.moe's, which it checks against
//                                                 the PyTorch path at full size
//         time PASS WARMUP ITERS                  each iteration's ms, L2 flushed before each,
//                                                 and its host time to enqueue the pass
//         peak PASS                               bytes one pass needs beyond inputs and weights
//         quit
//   mok_bench --fill-sample SEED N                 (no GPU) the first N values fill_bits gives,
//                                                 for the CPU test of layer_bench's hash_fill
//
// impls (standalone):
//   cublas cuBLAS GEMMs with the layer's FLOPs as if every routed row went to one expert
//          (+ the shared expert's): the ceiling a grouped kernel is measured against
//   plan   the device planner alone (pass "plan"): its cost inside every pass
//   mok    the fused layer: "fwd" (forward, Training::off), "fwd+bwd" (forward saving the
//          pre-activations, then the fused backward into bf16 gradients); the forward is
//          checked first on sampled tokens against the fp64 CPU reference, the backward's
//          outputs for finiteness (the full-size check is layer_bench.py's)
//   mok-ep1 the same layer through the expert-parallel machinery as an EP group of one rank
// peak_bytes (mok): the workspace + y + the high-water mark of what one pass allocates from
// a caching stream-ordered pool (scratch; fwd+bwd: saved tensor, dx, d_topk_weights, bf16
// weight gradients, allocated when the backward runs), as PyTorch's allocator would count it.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "mok/mok.hpp"
#include "mok/testing.hpp"

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

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

struct Record {
  std::string preset, impl, pass;
  std::int64_t tokens, ep, hidden, intermediate, experts, top_k, shared_intermediate;
  double ms, ms_p10, ms_p90, tflops;
  std::size_t peak_bytes;
  int iters;
};

// The layer's FLOPs (docs/design.md's convention): forward 6·H·(routed pairs·I + T·I_s),
// forward+backward 3x that.
double pass_flops(const mok::MoeShape& s, std::int64_t T, const std::string& pass) {
  return mok::forward_flops(s, T * s.top_k, T) * (pass == "fwd+bwd" ? 3.0 : 1.0);
}

Record make_record(const mok::Preset& p, const std::string& impl, const std::string& pass,
                   const std::vector<float>& ms, std::size_t peak, int iters) {
  const mok::MoeShape& s = p.shape;
  const double med = ms[ms.size() / 2];
  const double flops = pass == "plan" ? 0.0 : pass_flops(s, p.tokens, pass);
  return {p.name, impl, pass, p.tokens, 1, s.hidden, s.intermediate, s.num_experts, s.top_k, s.shared_intermediate,
          med, ms[ms.size() / 10], ms[ms.size() * 9 / 10], flops / (med * 1e-3) / 1e12, peak, iters};
}

// Device memory owned for one measurement, counted for peak_bytes.
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
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

// The benchmark's data: element i of a tensor filled with `seed` is the bf16 value
// (hash(i, seed) & 0xff - 128) / 1024, exact in bf16 (never zeros, |v| <= 1/8).
// bench/layer_bench.py's hash_fill computes the same values with PyTorch, so the
// driver and this process hold identical inputs without sharing memory.
__host__ __device__ inline std::uint16_t fill_bits(std::uint64_t i, std::uint32_t seed) {
  std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed * 0x9e3779b9u;
  h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12;
  const int level = static_cast<int>(h & 0xffu) - 128;  // [-128, 127]: 8 significant bits at most
  const float v = static_cast<float>(level) * (1.0f / 1024.0f);
  std::uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<std::uint16_t>(bits >> 16);  // exact: v has no bits below bf16's mantissa
}

__global__ void fill_kernel(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = fill_bits(i, seed);
}

void fill(std::uint16_t* p, std::size_t n, std::uint32_t seed, cudaStream_t stream) {
  fill_kernel<<<1024, 256, 0, stream>>>(p, n, seed);
  CUDA_OK(cudaGetLastError());
}

// The seeds of one problem's tensors (layer_bench.py's TENSOR_SEEDS mirrors them).
enum class Tensor : std::uint32_t { x = 1, gate, up, down, dy, shared_gate, shared_up, shared_down };
std::uint32_t tensor_seed(std::uint32_t seed, Tensor t) { return seed * 16u + static_cast<std::uint32_t>(t); }

// Checksum of a buffer of 4-byte words w_i: sum of w_i * (2i + 1) modulo 2^64. Integer
// adds commute, so the result does not depend on the order of the atomics; any change of
// one word changes it (2i + 1 is odd, so invertible modulo 2^64).
__global__ void checksum_kernel(const std::uint32_t* w, std::size_t n, unsigned long long* out) {
  unsigned long long acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    acc += static_cast<unsigned long long>(w[i]) * (2ull * i + 1ull);
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (threadIdx.x % 32 == 0) atomicAdd(out, acc);
}

std::uint64_t checksum(const void* p, std::size_t bytes, cudaStream_t stream) {
  if (bytes % 4 != 0) throw mok::Error("mok_bench: checksum of " + std::to_string(bytes) + " bytes (not whole words)");
  unsigned long long* d_sum = nullptr;
  CUDA_OK(cudaMallocAsync(&d_sum, sizeof(unsigned long long), stream));
  CUDA_OK(cudaMemsetAsync(d_sum, 0, sizeof(unsigned long long), stream));
  checksum_kernel<<<264, 256, 0, stream>>>(static_cast<const std::uint32_t*>(p), bytes / 4, d_sum);
  CUDA_OK(cudaGetLastError());
  unsigned long long sum = 0;
  CUDA_OK(cudaMemcpyAsync(&sum, d_sum, sizeof(sum), cudaMemcpyDeviceToHost, stream));
  CUDA_OK(cudaFreeAsync(d_sum, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  return sum;
}

// Times `body` with CUDA events: warm-up, then each iteration after an L2 flush. With
// `host_ms`, each iteration's host time to enqueue `body` is appended (unsorted).
template <typename Body>
std::vector<float> time_iterations(int warmup, int iters, cudaStream_t stream, Body body,
                                   std::vector<double>* host_ms = nullptr) {
  static void* flush = nullptr;
  constexpr std::size_t kFlushBytes = 256u << 20;  // > 4x the H200's 60 MB L2
  if (!flush) CUDA_OK(cudaMalloc(&flush, kFlushBytes));
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) body();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CUDA_OK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, stream));
    CUDA_OK(cudaEventRecord(start, stream));
    const auto t0 = std::chrono::steady_clock::now();
    body();
    const auto t1 = std::chrono::steady_clock::now();
    CUDA_OK(cudaEventRecord(stop, stream));
    if (host_ms) host_ms->push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
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
      if (ptr) fill(ptr, n, seed++, stream);
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
  return make_record(p, "cublas", pass, time_iterations(o.warmup, o.iters, stream, body), arena.bytes(), o.iters);
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
  const auto ms = time_iterations(o.warmup, o.iters, stream, [&] { mok::plan_device(view, 0, plan, stream); });
  return make_record(p, "plan", "plan", ms, static_cast<std::size_t>(plan.capacity_rows() * 4 * 3), o.iters);
}

// One preset's inputs on the device: x, the weights (+ shared expert), dy, the routing.
struct Problem {
  mok::MoeShape s;
  std::int64_t T = 0;
  Arena arena;
  std::uint16_t *x = nullptr, *gate = nullptr, *up = nullptr, *down = nullptr, *dy = nullptr;
  std::uint16_t *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
  std::int32_t* ids = nullptr;
  float* weights = nullptr;
  std::vector<std::int32_t> host_ids;
  std::vector<float> host_weights;

  Problem(const mok::Preset& p, std::uint32_t seed, std::vector<std::int32_t> ids_, std::vector<float> weights_,
          cudaStream_t stream)
      : s(p.shape), T(p.tokens), host_ids(std::move(ids_)), host_weights(std::move(weights_)) {
    const std::int64_t H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k, Is = s.shared_intermediate;
    if (static_cast<std::int64_t>(host_ids.size()) != T * k || static_cast<std::int64_t>(host_weights.size()) != T * k)
      throw mok::Error("mok_bench: routing of preset " + p.name + " needs " + std::to_string(T * k) + " ids and weights, got " +
                       std::to_string(host_ids.size()) + " and " + std::to_string(host_weights.size()));
    auto filled = [&](std::size_t n, Tensor t) {
      auto* ptr = arena.alloc<std::uint16_t>(n);
      fill(ptr, n, tensor_seed(seed, t), stream);
      return ptr;
    };
    x = filled(T * H, Tensor::x);
    gate = filled(E * I * H, Tensor::gate);
    up = filled(E * I * H, Tensor::up);
    down = filled(E * H * I, Tensor::down);
    dy = filled(T * H, Tensor::dy);
    if (s.has_shared()) {
      shared_gate = filled(Is * H, Tensor::shared_gate);
      shared_up = filled(Is * H, Tensor::shared_up);
      shared_down = filled(H * Is, Tensor::shared_down);
    }
    ids = arena.alloc<std::int32_t>(T * k);
    weights = arena.alloc<float>(T * k);
    CUDA_OK(cudaMemcpyAsync(ids, host_ids.data(), T * k * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(weights, host_weights.data(), T * k * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
  }
};

mok::TensorView bf16_view(const void* p, std::initializer_list<std::int64_t> shape) {
  return mok::TensorView::contiguous(p, mok::DType::bf16, mok::Device::cuda(0), shape);
}

// The fp64 reference of a few tokens: their experts' weights are copied back and
// renumbered into a small problem.
double check_sampled_tokens(const Problem& pr, const std::uint16_t* d_y) {
  const mok::MoeShape& s = pr.s;
  const std::int64_t H = s.hidden, I = s.intermediate, k = s.top_k, Is = s.shared_intermediate, T = pr.T;
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
  if (s.has_shared())
    w.shared_gate = fetch(pr.shared_gate, 0, Is * H), w.shared_up = fetch(pr.shared_up, 0, Is * H),
    w.shared_down = fetch(pr.shared_down, 0, H * Is);
  for (std::int64_t t : tokens) {
    auto xr = fetch(pr.x, t * H, H), yr = fetch(d_y, t * H, H);
    x.insert(x.end(), xr.begin(), xr.end());
    y_gpu.insert(y_gpu.end(), yr.begin(), yr.end());
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = pr.host_ids[t * k + j];
      auto at = std::find(experts.begin(), experts.end(), e);
      if (e >= 0 && at == experts.end()) {
        experts.push_back(e);
        auto g = fetch(pr.gate, e * I * H, I * H), u = fetch(pr.up, e * I * H, I * H), d = fetch(pr.down, e * H * I, H * I);
        w.gate.insert(w.gate.end(), g.begin(), g.end());
        w.up.insert(w.up.end(), u.begin(), u.end());
        w.down.insert(w.down.end(), d.begin(), d.end());
        at = experts.end() - 1;
      }
      r.ids.push_back(e < 0 ? -1 : static_cast<std::int32_t>(at - experts.begin()));
      r.weights.push_back(pr.host_weights[t * k + j]);
    }
  }
  // The sampled tokens' experts, renumbered; at least k of them so that top_k <= E holds
  // (unused extra experts get zero weights).
  small.num_experts = small.num_local_experts = std::max<std::int64_t>(k, static_cast<std::int64_t>(experts.size()));
  w.gate.resize(small.num_experts * I * H), w.up.resize(small.num_experts * I * H), w.down.resize(small.num_experts * H * I);
  const auto ref = mok::reference::forward(small, static_cast<std::int64_t>(tokens.size()), x, r, w);
  return mok::reference::relative_error(y_gpu, ref);
}

// The fused layer on one Problem: one pass ("fwd" or "fwd+bwd") as a step that can be
// timed, measured for peak memory, or run once with its outputs kept for a checksum.
// impl "mok": the one-GPU kernels; "mok-ep1": the same layer through the expert-parallel
// machinery (routing exchange, peer pulls, push combine) as an EP group of one rank.
class FusedLayer {
 public:
  FusedLayer(const Problem& pr, const std::string& impl, const std::string& pass, const mok::Config& ep_config,
             cudaStream_t stream)
      : pr_(pr), ep1_(impl == "mok-ep1"), bwd_(pass == "fwd+bwd"), stream_(stream), pool_(stream),
        ws_(pr.s, pr.T, {}, bwd_ ? mok::Training::save : mok::Training::off) {
    const mok::MoeShape& s = pr.s;
    const std::int64_t T = pr.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                       Is = s.shared_intermediate;
    const mok::Device dev = mok::Device::cuda(0);
    y_ = arena_.alloc<std::uint16_t>(T * H);
    a_.x = bf16_view(pr.x, {T, H});
    a_.topk_ids = mok::TensorView::contiguous(pr.ids, mok::DType::i32, dev, {T, k});
    a_.topk_weights = mok::TensorView::contiguous(pr.weights, mok::DType::f32, dev, {T, k});
    a_.w_gate = bf16_view(pr.gate, {E, I, H});
    a_.w_up = bf16_view(pr.up, {E, I, H});
    a_.w_down = bf16_view(pr.down, {E, H, I});
    if (s.has_shared())
      a_.shared_gate = bf16_view(pr.shared_gate, {Is, H}), a_.shared_up = bf16_view(pr.shared_up, {Is, H}),
      a_.shared_down = bf16_view(pr.shared_down, {H, Is});
    a_.y = bf16_view(y_, {T, H});
    if (ep1_) {
      group_ = std::make_unique<mok::VirtualRanks>(s, T, ep_config, bwd_ ? mok::Training::save : mok::Training::off);
      if (bwd_) {  // the EP machinery owns its buffers: fixed tensors, peak not reported
        saved_fixed_ = arena_.alloc<std::uint16_t>(ws_.saved_elements());
        outputs_ = {arena_.alloc<std::uint16_t>(T * H), arena_.alloc<float>(T * k), arena_.alloc<std::uint16_t>(E * I * H),
                    arena_.alloc<std::uint16_t>(E * I * H), arena_.alloc<std::uint16_t>(E * H * I)};
        if (s.has_shared())
          outputs_.d_shared_gate = arena_.alloc<std::uint16_t>(Is * H), outputs_.d_shared_up = arena_.alloc<std::uint16_t>(Is * H),
          outputs_.d_shared_down = arena_.alloc<std::uint16_t>(H * Is);
      }
    }
  }

  // One pass. With keep, the outputs stay allocated (poisoned before the pass) for the
  // caller to read; release_kept() frees them.
  void step(bool keep = false) {
    if (keep) CUDA_OK(cudaMemsetAsync(y_, 0xff, pr_.T * pr_.s.hidden * 2, stream_));
    if (ep1_) return step_ep1(keep);
    if (!bwd_) {
      forward(std::nullopt);
      return;
    }
    const mok::MoeShape& s = pr_.s;
    const std::int64_t T = pr_.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                       Is = s.shared_intermediate;
    // One training step's tensors: saved (forward to backward), then dx, d_topk_weights and
    // the bf16 weight gradients, allocated when the backward runs (as autograd does).
    auto* saved = pool_.alloc<std::uint16_t>(ws_.saved_elements());
    forward(saved_view(saved));
    Outputs g{pool_.alloc<std::uint16_t>(T * H), pool_.alloc<float>(T * k), pool_.alloc<std::uint16_t>(E * I * H),
              pool_.alloc<std::uint16_t>(E * I * H), pool_.alloc<std::uint16_t>(E * H * I)};
    if (s.has_shared())
      g.d_shared_gate = pool_.alloc<std::uint16_t>(Is * H), g.d_shared_up = pool_.alloc<std::uint16_t>(Is * H),
      g.d_shared_down = pool_.alloc<std::uint16_t>(H * Is);
    if (keep) poison(g);
    const std::int64_t bytes = ws_.backward_scratch_bytes(mok::DType::bf16);
    auto* scratch = pool_.alloc<std::uint8_t>(bytes);
    mok::backward(a_, grads(g), ws_, stream_, saved_view(saved), u8(scratch, bytes));
    pool_.free(scratch);
    pool_.free(saved);
    if (keep) outputs_ = g, kept_ = true;
    else for (void* q : g.all()) pool_.free(q);
  }

  // (name, bytes) of every output of the last kept pass.
  using Buffers = std::vector<std::pair<std::string, std::pair<void*, std::size_t>>>;
  Buffers outputs() const {
    Buffers out{{"y", {y_, pr_.T * pr_.s.hidden * 2}}};
    if (!bwd_) return out;
    Buffers g = gradient_buffers(outputs_);
    out.insert(out.end(), g.begin(), g.end());
    return out;
  }

  void release_kept() {
    if (kept_ && !ep1_)
      for (void* q : outputs_.all()) pool_.free(q);
    kept_ = false;
  }

  // Raises if a kernel recorded an error.
  void check_status() {
    if (ep1_) group_->check(stream_);
    else ws_.check(stream_);
  }

  // What one pass needs beyond its inputs and weights: the workspace, y and the pool's
  // high-water mark (EP machinery: not measured, 0).
  std::size_t peak_bytes() {
    if (ep1_) return 0;
    const std::size_t high = pool_.high_water([&] { step(); });
    return static_cast<std::size_t>(ws_.bytes()) + 2 * pr_.T * pr_.s.hidden + high;
  }

  const std::uint16_t* y() const { return y_; }
  // The kept pass's dx and d_topk_weights, copied to the host.
  void copy_dx_and_d_topk_weights(std::vector<mok::bf16>* dx, std::vector<float>* dtw) const {
    dx->resize(pr_.T * pr_.s.hidden), dtw->resize(pr_.T * pr_.s.top_k);
    CUDA_OK(cudaMemcpy(dx->data(), outputs_.dx, dx->size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dtw->data(), outputs_.d_topk_weights, dtw->size() * 4, cudaMemcpyDeviceToHost));
  }

 private:
  struct Outputs {
    std::uint16_t* dx = nullptr;
    float* d_topk_weights = nullptr;
    std::uint16_t *d_w_gate = nullptr, *d_w_up = nullptr, *d_w_down = nullptr;
    std::uint16_t *d_shared_gate = nullptr, *d_shared_up = nullptr, *d_shared_down = nullptr;
    std::vector<void*> all() const {
      std::vector<void*> v{dx, d_topk_weights, d_w_gate, d_w_up, d_w_down};
      for (void* q : {d_shared_gate, d_shared_up, d_shared_down})
        if (q) v.push_back(q);
      return v;
    }
  };

  static mok::TensorView u8(void* p, std::int64_t bytes) {
    return mok::TensorView::contiguous(p, mok::DType::u8, mok::Device::cuda(0), {bytes});
  }
  mok::TensorView saved_view(std::uint16_t* at) const { return bf16_view(at, {ws_.saved_elements()}); }

  void forward(const std::optional<mok::TensorView>& saved) {
    auto* scratch = pool_.alloc<std::uint8_t>(ws_.forward_scratch_bytes());
    mok::forward(a_, ws_, stream_, saved, u8(scratch, ws_.forward_scratch_bytes()));
    pool_.free(scratch);
  }

  // (name, bytes) of a backward's outputs, as the layer writes them.
  Buffers gradient_buffers(const Outputs& g) const {
    const mok::MoeShape& s = pr_.s;
    const std::size_t T = pr_.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                      Is = s.shared_intermediate;
    Buffers out{{"dx", {g.dx, T * H * 2}},
                {"d_topk_weights", {g.d_topk_weights, T * k * 4}},
                {"d_w_gate", {g.d_w_gate, E * I * H * 2}},
                {"d_w_up", {g.d_w_up, E * I * H * 2}},
                {"d_w_down", {g.d_w_down, E * H * I * 2}}};
    if (s.has_shared())
      out.insert(out.end(), {{"d_shared_gate", {g.d_shared_gate, Is * H * 2}},
                             {"d_shared_up", {g.d_shared_up, Is * H * 2}},
                             {"d_shared_down", {g.d_shared_down, H * Is * 2}}});
    return out;
  }

  void poison(const Outputs& g) {
    for (const auto& [name, buffer] : gradient_buffers(g))
      CUDA_OK(cudaMemsetAsync(buffer.first, 0xff, buffer.second, stream_));
  }

  mok::BackwardArgs grads(const Outputs& g) const {
    const mok::MoeShape& s = pr_.s;
    const std::int64_t T = pr_.T, H = s.hidden, I = s.intermediate, E = s.num_local_experts, k = s.top_k,
                       Is = s.shared_intermediate;
    mok::BackwardArgs b;
    b.dy = bf16_view(pr_.dy, {T, H});
    b.dx = bf16_view(g.dx, {T, H});
    b.d_topk_weights = mok::TensorView::contiguous(g.d_topk_weights, mok::DType::f32, mok::Device::cuda(0), {T, k});
    b.d_w_gate = bf16_view(g.d_w_gate, {E, I, H});
    b.d_w_up = bf16_view(g.d_w_up, {E, I, H});
    b.d_w_down = bf16_view(g.d_w_down, {E, H, I});
    if (s.has_shared())
      b.d_shared_gate = bf16_view(g.d_shared_gate, {Is, H}), b.d_shared_up = bf16_view(g.d_shared_up, {Is, H}),
      b.d_shared_down = bf16_view(g.d_shared_down, {H, Is});
    return b;
  }

  void step_ep1(bool keep) {
    if (!bwd_) {
      group_->forward(std::span<const mok::ForwardArgs>(&a_, 1), stream_);
      return;
    }
    if (keep) poison(outputs_);
    const mok::TensorView sv = saved_view(saved_fixed_);
    const mok::BackwardArgs b = grads(outputs_);
    group_->forward(std::span<const mok::ForwardArgs>(&a_, 1), stream_, std::span<const mok::TensorView>(&sv, 1));
    group_->backward(std::span<const mok::ForwardArgs>(&a_, 1), std::span<const mok::BackwardArgs>(&b, 1), stream_,
                     std::span<const mok::TensorView>(&sv, 1));
    kept_ = keep;
  }

  const Problem& pr_;
  const bool ep1_, bwd_;
  cudaStream_t stream_;
  Arena arena_;
  StepPool pool_;
  mok::Workspace ws_;
  std::unique_ptr<mok::VirtualRanks> group_;
  mok::ForwardArgs a_;
  std::uint16_t* y_ = nullptr;
  std::uint16_t* saved_fixed_ = nullptr;
  Outputs outputs_;
  bool kept_ = false;
};

// Standalone "mok" / "mok-ep1": own inputs (uniform routing), sampled fp64 check of the
// forward, finiteness of the backward's outputs, then timing and peak.
Record bench_mok(const Options& o, const mok::Preset& p, const std::string& impl, const std::string& pass,
                 cudaStream_t stream) {
  const mok::MoeShape& s = p.shape;
  auto ids = mok::make_routing(mok::RoutingKind::uniform, p.tokens, s.num_experts, s.top_k, 7);
  auto weights = mok::make_routing_weights(ids, s.top_k, 7);
  const Problem pr(p, 11, std::move(ids), std::move(weights), stream);
  FusedLayer layer(pr, impl, pass, o.ep_config, stream);
  layer.step(/*keep=*/true);
  layer.check_status();
  const double err = check_sampled_tokens(pr, layer.y());
  if (!(err <= 1e-2))
    throw mok::Error("mok_bench: fused forward wrong on " + p.name + ": relative error " + std::to_string(err));
  if (pass == "fwd+bwd") {
    std::vector<float> dtw;
    std::vector<mok::bf16> dx;
    layer.copy_dx_and_d_topk_weights(&dx, &dtw);
    for (mok::bf16 v : dx)
      if (!std::isfinite(v.to_float())) throw mok::Error("mok_bench: fused backward wrote a non-finite dx on " + p.name);
    for (float v : dtw)
      if (!std::isfinite(v)) throw mok::Error("mok_bench: fused backward wrote a non-finite d_topk_weights on " + p.name);
  }
  layer.release_kept();
  const std::size_t peak = layer.peak_bytes();
  const std::vector<float> ms = time_iterations(o.warmup, o.iters, stream, [&] { layer.step(); });
  layer.check_status();
  return make_record(p, impl, pass, ms, peak, o.iters);
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
       << ", \"shared_intermediate\": " << r.shared_intermediate
       << ", \"routing\": \"uniform\", \"iters\": " << r.iters << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  js << "]\n";
  std::ofstream(o.out) << js.str();
}

template <typename T>
std::vector<T> read_binary(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw mok::Error("mok_bench: cannot read " + path);
  const std::streamsize bytes = in.tellg();
  if (bytes % sizeof(T) != 0) throw mok::Error("mok_bench: " + path + " is not a whole number of elements");
  std::vector<T> v(bytes / sizeof(T));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), bytes);
  return v;
}

// --serve: the "mok" implementation of bench/layer_bench.py (see the top of this file).
int serve() {
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<Problem> problem;
  std::unique_ptr<FusedLayer> layers[2];  // fwd, fwd+bwd
  auto layer = [&](const std::string& pass) -> FusedLayer& {
    if (!problem) throw mok::Error("mok_bench: 'load' a preset first");
    if (pass != "fwd" && pass != "fwd+bwd") throw mok::Error("mok_bench: pass must be fwd or fwd+bwd, got '" + pass + "'");
    auto& l = layers[pass == "fwd+bwd"];
    if (!l) l = std::make_unique<FusedLayer>(*problem, "mok", pass, mok::Config{}, stream);
    return *l;
  };
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    std::string cmd, pass;
    in >> cmd;
    std::ostringstream reply;
    try {
      if (cmd == "quit") break;
      if (cmd == "load") {
        std::string preset, ids_path, weights_path;
        std::uint32_t seed = 0;
        if (!(in >> preset >> seed >> ids_path >> weights_path)) throw mok::Error("mok_bench: load PRESET SEED IDS WEIGHTS");
        layers[0].reset(), layers[1].reset(), problem.reset();
        problem = std::make_unique<Problem>(mok::find_preset(preset), seed, read_binary<std::int32_t>(ids_path),
                                            read_binary<float>(weights_path), stream);
        reply << "{\"ok\": true}";
      } else if (cmd == "check") {
        in >> pass;
        FusedLayer& l = layer(pass);
        l.step(/*keep=*/true);
        l.check_status();
        reply << "{\"checksums\": {";
        const auto outs = l.outputs();
        for (std::size_t i = 0; i < outs.size(); ++i)
          reply << (i ? ", " : "") << "\"" << outs[i].first << "\": \""
                << checksum(outs[i].second.first, outs[i].second.second, stream) << "\"";
        reply << "}}";
        l.release_kept();
      } else if (cmd == "time") {
        int warmup = 0, iters = 0;
        if (!(in >> pass >> warmup >> iters) || iters < 1) throw mok::Error("mok_bench: time PASS WARMUP ITERS");
        FusedLayer& l = layer(pass);
        std::vector<double> host_ms;
        const auto ms = time_iterations(warmup, iters, stream, [&] { l.step(); }, &host_ms);
        l.check_status();
        reply << "{\"ms\": [";
        for (std::size_t i = 0; i < ms.size(); ++i) reply << (i ? ", " : "") << ms[i];
        reply << "], \"host_ms\": [";
        for (std::size_t i = 0; i < host_ms.size(); ++i) reply << (i ? ", " : "") << host_ms[i];
        reply << "]}";
      } else if (cmd == "peak") {
        in >> pass;
        reply << "{\"peak_bytes\": " << layer(pass).peak_bytes() << "}";
      } else {
        throw mok::Error("mok_bench: unknown command '" + cmd + "' (load, check, time, peak, quit)");
      }
    } catch (const std::exception& e) {
      reply.str("");
      reply << "{\"error\": \"" << json_escape(e.what()) << "\"}";
    }
    std::cout << reply.str() << std::endl;  // (endl flushes: the driver waits for the line)
  }
  layers[0].reset(), layers[1].reset(), problem.reset();
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  bool serving = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw mok::Error("mok_bench: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--fill-sample") {  // no GPU needed
      const auto seed = static_cast<std::uint32_t>(std::stoul(next()));
      const std::uint64_t n = std::stoull(next());
      for (std::uint64_t j = 0; j < n; ++j) std::printf("%u\n", fill_bits(j, seed));
      return 0;
    }
    if (a == "--serve") serving = true;
    else if (a == "--preset") o.presets = split(next());
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
                  "                 [--comm-sms N] [--minibatch-rows N] [--ring-rows N]  (mok-ep1's Config)\n"
                  "       mok_bench --serve            (bench/layer_bench.py's mok implementation)\n"
                  "       mok_bench --fill-sample SEED N\n");
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
  if (serving) return serve();
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
  std::printf("%-16s %-7s %-8s %10s %9s\n", "preset", "impl", "pass", "ms", "TFLOP/s");
  for (const mok::Preset* p : chosen)
    for (const std::string& impl : o.impls) {
      std::vector<std::string> passes = impl == "plan" ? std::vector<std::string>{"plan"} : o.passes;
      for (const std::string& pass : passes) {
        if (impl == "mok" || impl == "mok-ep1") records.push_back(bench_mok(o, *p, impl, pass, stream));
        else if (impl == "cublas") records.push_back(bench_dense(o, *p, pass, stream, handle));
        else records.push_back(bench_plan(o, *p, stream));
        const Record& r = records.back();
        std::printf("%-16s %-7s %-8s %10.4f %9.1f\n", r.preset.c_str(), r.impl.c_str(), r.pass.c_str(), r.ms, r.tflops);
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
