// mok_bench's support: options, records and their FLOPs, the device arena and the
// stream-ordered step pool, deterministic fills and checksums, cuBLAS GEMMs.
#pragma once

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

#include "mok/mok.hpp"

namespace mok_bench {

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
  bool check = true;  // --no-check: no sampled fp64 check before timing (profiling runs: it copies
                      // the sampled tokens' experts to the host, ~1 min on the large presets)
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
// `host_ms`, each iteration's host time to enqueue `body` is appended (unsorted). Synced (the
// default), the host waits for each iteration before it flushes for the next, so the GPU idles
// between them while the host catches up; `queued` enqueues every iteration (flush, start event,
// body, stop event) before it waits once, as a training loop runs ahead of its GPU: the GPU goes
// from one iteration's flush to the next without idling, and an iteration's time is its events'.
template <typename Body>
std::vector<float> time_iterations(int warmup, int iters, cudaStream_t stream, Body body,
                                   std::vector<double>* host_ms = nullptr, bool queued = false) {
  static void* flush = nullptr;
  constexpr std::size_t kFlushBytes = 256u << 20;  // > 4x the H200's 60 MB L2
  if (!flush) CUDA_OK(cudaMalloc(&flush, kFlushBytes));
  std::vector<cudaEvent_t> start(queued ? iters : 1), stop(start.size());
  for (std::size_t i = 0; i < start.size(); ++i) {
    CUDA_OK(cudaEventCreate(&start[i]));
    CUDA_OK(cudaEventCreate(&stop[i]));
  }
  for (int i = 0; i < warmup; ++i) body();
  std::vector<float> ms;
  auto elapsed = [&](std::size_t e) {
    float t = 0;
    CUDA_OK(cudaEventElapsedTime(&t, start[e], stop[e]));
    ms.push_back(t);
  };
  for (int i = 0; i < iters; ++i) {
    const std::size_t e = queued ? i : 0;
    CUDA_OK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, stream));
    CUDA_OK(cudaEventRecord(start[e], stream));
    const auto t0 = std::chrono::steady_clock::now();
    body();
    const auto t1 = std::chrono::steady_clock::now();
    CUDA_OK(cudaEventRecord(stop[e], stream));
    if (host_ms) host_ms->push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    if (!queued) {
      CUDA_OK(cudaEventSynchronize(stop[e]));
      elapsed(e);
    }
  }
  if (queued) {
    CUDA_OK(cudaStreamSynchronize(stream));
    for (int i = 0; i < iters; ++i) elapsed(i);
  }
  CUDA_OK(cudaGetLastError());
  for (std::size_t i = 0; i < start.size(); ++i) {
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
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

}  // namespace mok_bench
