// Helpers for tests that need a GPU: they skip (reported as skipped) without one.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <vector>

#include "mok/device.hpp"

#define MOK_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

// Skips the test unless device 0 is a Hopper GPU (the kernels are built for sm_90a only).
#define MOK_REQUIRE_HOPPER()                                                             \
  do {                                                                                   \
    if (mok::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU on this machine";     \
    if (!mok::query_device(0).is_hopper())                                               \
      GTEST_SKIP() << "GPU 0 is " << mok::query_device(0).name << ", not Hopper (sm_90)"; \
  } while (0)

namespace mok::testing {

// A device allocation that frees itself.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n > 0 && cudaMalloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T)) != cudaSuccess) throw std::bad_alloc();
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void upload(const std::vector<T>& host, cudaStream_t stream = nullptr) {
    if (!host.empty()) cudaMemcpyAsync(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
  }
  std::vector<T> download() const {
    std::vector<T> out(n_);
    if (n_ > 0) cudaMemcpy(out.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return out;
  }
  T* get() const { return ptr_; }
  std::size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

// Whether two host arrays hold the same bits (bitwise-equality checks of results).
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// A CUDA graph of what `step` enqueues on `stream` (captured once, instantiated), destroyed
// with this object. Check error() before launching.
class CapturedGraph {
 public:
  template <typename Step>
  CapturedGraph(cudaStream_t stream, Step&& step) {
    error_ = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
    if (error_ != cudaSuccess) return;
    step();
    error_ = cudaStreamEndCapture(stream, &graph_);
    if (error_ == cudaSuccess) error_ = cudaGraphInstantiate(&exec_, graph_, 0);
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  cudaError_t error() const { return error_; }
  cudaError_t launch(cudaStream_t stream) const { return cudaGraphLaunch(exec_, stream); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace mok::testing
